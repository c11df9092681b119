"""The ONNX Runtime decoder: an export's graphs behind the `decoder.Decoder` interface.

`OnnxDecoder` runs `encoder.onnx` and the cached `decoder_step.onnx` for
`search.search_loop`, the exported search graphs (`greedy_search`,
`greedy_batch_search`, `beam_search`, `beam_batch_search`) as its fast
paths for plain options, and the teacher-forced graphs for forced scores and
alignments.
On a CPU with several threads it searches a large batch as one part per
thread, the parts at once (`split_batches`).

Importing this module imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from keras_transformer_runtime.export_format import (
    ALIGNMENT_INPUT,
    LENGTH_PENALTY_FORM_IDS,
    LENGTH_PENALTY_FORM_INPUT,
    MANIFEST,
    ExportFileError,
    check_weights,
    read_manifest,
)
from keras_transformer_runtime.onnx_sessions import (
    CPU,
    available_cores,
    default_providers,
    load_tokenizer,
    make_session,
    spins,
)
from keras_transformer_runtime.onnx_state import OnnxSearchState
from keras_transformer_runtime.options import NO_MASKS
from keras_transformer_runtime.shortlist import Shortlist
from keras_transformer_runtime.specials import EOS_ID, PAD_ID
from keras_transformer_runtime.split_batches import length_runs

# Greedy batches of at most this many sentences run as one call of the
# greedy_search graph (which computes a finished sentence's row to the end);
# larger ones as one call of greedy_batch_search, whose loop drops each
# sentence when it ends (docs/performance.md, "Runtime choices").
GRAPH_LOOP_MAX_SENTENCES = 4
# The same for beam search: beam_search up to this many sentences, beam_batch_search above.
BEAM_GRAPH_MAX_SENTENCES = 4
# A search on N > 1 CPU threads runs as N searches of part of the batch at
# once, one thread each, when every part holds at least this many decoder
# rows (sentences x beam): a step's operators are too small to share
# threads well (docs/performance.md, "Runtime choices").
SPLIT_MIN_ROWS = 8


def check_ids(name, array, rank=2):
    """`array` as int32, refused with a message naming `name` unless integer of `rank`."""
    array = np.asarray(array)
    if array.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}. Received shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids. Received dtype {array.dtype}")
    return array.astype(np.int32, copy=False)


class OnnxDecoder:
    """An ONNX export folder's graphs as a `decoder.Decoder`.

    Args:
        onnx_dir: the export folder (`manifest.json`, the `.onnx` graphs and
            `spm.model` or `vocab.txt`).
        providers: ONNX Runtime execution providers; default CUDA when usable,
            otherwise CPU. `self.provider` says which one runs.
        num_threads: intra-op threads (default: ONNX Runtime's choice).
        precision: "float32", or "float16" / "int8" for graphs exported with it.
        split_batches: on the CPU with more than one thread (`num_threads`,
            or every core the process may use), search a batch as one part
            per thread, the parts at once, each on one thread of sessions of
            its own (those hold the weights once per thread). None (the
            default): float32 and float16 graphs, where each part has at
            least `SPLIT_MIN_ROWS` rows (int8 graphs quantize a step's
            activations with one scale per batch, so a part's translations
            could differ from the whole batch's); True: any batch of at
            least one sentence per thread; False: never.
        shortlist: None (the default): an export made with a vocabulary
            shortlist (`keras_transformer_runtime.shortlist`) searches with it,
            through its `*_shortlist` graphs, each batch scoring only its own
            list's pieces; False: the full vocabulary. `self.shortlist` is the
            list in use, or None. Searches the graphs do not run (constraints,
            sampling, prefixes, a beam wider than the graphs take) score the
            full vocabulary either way.

    The export must be of `export_format.FORMAT_VERSION`; any other raises
    `ExportFileError`, which says to re-export.
    """

    source_multiple = 1  # ONNX Runtime takes any source length at no cost

    def __init__(
        self,
        onnx_dir,
        providers=None,
        num_threads=None,
        precision="float32",
        split_batches=None,
        shortlist=None,
    ):
        self.onnx_dir = os.fspath(onnx_dir)
        self.manifest = read_manifest(self.onnx_dir)
        config, precisions = self.manifest["config"], self.manifest["precisions"]
        if precision not in precisions:
            raise ValueError(
                f"This export has no {precision!r} graphs (it has {', '.join(precisions)})."
            )
        self.precision = precision
        check_weights(self.manifest, self.onnx_dir, precision)
        try:
            # The decoder's depth: caches per layer (exports before separate
            # depths have num_layers only).
            self.num_layers = int(config.get("num_decoder_layers") or config["num_layers"])
            self.num_heads = int(config["num_heads"])
            self.head_dim = int(config["hidden_dim"]) // self.num_heads
            self.max_length = int(config["max_length"])
            self.vocabulary_size = int(config["vocabulary_size"])
            self._graph_files = {
                name: entry[precision] for name, entry in self.manifest["graphs"].items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ExportFileError(
                f"{os.path.join(self.onnx_dir, MANIFEST)} is not a valid export manifest: "
                f"{error!r} is missing or malformed."
            ) from error
        self._use_shortlist = shortlist
        self.shortlist = None
        listed = self.manifest.get("shortlist")
        if listed and shortlist is not False:
            self.shortlist = Shortlist.load(os.path.join(self.onnx_dir, listed["file"]))
        # The language the translate commands split documents by (None: not recorded).
        self.source_language = self.manifest.get("source_language")
        tokenizer = self.manifest.get("tokenizer")
        self.tokenizer = (
            load_tokenizer(os.path.join(self.onnx_dir, tokenizer)) if tokenizer else None
        )
        self._providers = list(providers) if providers is not None else default_providers()
        self._num_threads = num_threads
        self._sessions = {}
        self._copies = []  # the decoders of parallel beam searches (`parallel`)
        self._split = None if split_batches is None else bool(split_batches)
        self._split_workers = []  # one one-thread decoder per part of a split search
        self._split_pool = None  # runs the parts after the first
        self._split_lock = threading.Lock()
        self._last_encoded = None  # (the source batch, what `encode` gave for it)
        self._self_names = self.cache_names("self")
        self._new_self_names = ["new_" + name for name in self._self_names]
        self.encoder_session = self.session("encoder")
        self.step_session = self.session("decoder_step")
        self.provider = self.step_session.get_providers()[0]

    def session(self, name):
        """The ONNX Runtime session of graph `name` ("encoder", "decoder_step", "alignment", ...)."""
        if name not in self._sessions:
            if name not in self._graph_files:
                raise ExportFileError(f"{MANIFEST} in {self.onnx_dir} lists no {name!r} graph.")
            path = os.path.join(self.onnx_dir, self._graph_files[name])
            spinning = spins(name, self.precision)
            self._sessions[name] = make_session(path, self._providers, self._num_threads, spinning)
        return self._sessions[name]

    def _copy(self, **changes):
        """A decoder of the same export and settings (but `changes`), with sessions of its own."""
        settings = {
            "providers": self._providers,
            "num_threads": self._num_threads,
            "precision": self.precision,
            "split_batches": self._split,
            "shortlist": self._use_shortlist,
        }
        return OnnxDecoder(self.onnx_dir, **{**settings, **changes})

    def parallel(self, count, beam_size):
        """The decoders of `count` searches run at once.

        Beam searches get one each: this one and `count - 1` copies (made
        once, then kept), each with sessions of its own, on which parallel
        beam searches of one sentence ran faster than on shared ones
        (docs/performance.md, "Runtime choices"). Greedy searches share this
        one's sessions: no gain showed for them, and each copy holds the
        weights again.
        """
        if beam_size == 1:
            return [self] * count
        while len(self._copies) < count - 1:
            self._copies.append(self._copy())
        return [self, *self._copies[: count - 1]]

    def threads(self):
        """The intra-op threads of a search: `num_threads`, or the cores this process may use."""
        return int(self._num_threads) if self._num_threads is not None else available_cores()

    def split_parts(self, sentences, beam_size=1):
        """Into how many parts a search of `sentences` runs (1: whole; see `split_batches`)."""
        parts = self.threads()
        if self._split is False or self.provider != CPU or parts < 2 or sentences < parts:
            return 1
        if self._split is None and (
            self.precision == "int8" or sentences * beam_size < parts * SPLIT_MIN_ROWS
        ):
            return 1
        return parts

    def _split_search(self, source, limits, parts, search):
        """`search(decoder, source, limits)` on `parts` parts of the batch at once: what
        it returns per sentence (`(tokens, scores, ...)`, lists), for every sentence in order.

        The parts are runs of the sentences in order of length, sized so that
        they end together (`length_runs`), each on a one-thread decoder.
        """
        with self._split_lock:
            while len(self._split_workers) < parts:
                self._split_workers.append(self._copy(num_threads=1, split_batches=False))
            if self._split_pool is None:
                self._split_pool = ThreadPoolExecutor(parts - 1, "split-search")
            workers, pool = self._split_workers[:parts], self._split_pool
        lengths = (source != PAD_ID).sum(1)
        groups = length_runs(lengths, parts)

        def rows(group):
            # A part is as wide as its own longest source: the short part of a
            # batch of mixed lengths computes no padding of the long one.
            return source[group, : max(1, int(lengths[group].max()))]

        # The first part runs on this thread; the pool's threads only search.
        futures = [
            pool.submit(search, worker, rows(group), limits[group])
            for worker, group in zip(workers[1:], groups[1:], strict=True)
        ]
        results = [search(workers[0], rows(groups[0]), limits[groups[0]])]
        results += [future.result() for future in futures]
        merged = [[None] * len(source) for _ in results[0]]
        for group, result in zip(groups, results, strict=True):
            for column, values in zip(merged, result, strict=True):
                for row, value in zip(group, values, strict=True):
                    column[row] = value
        return tuple(merged)

    # ----------------------------------------------------------------------- graphs

    def encode(self, source_ids):
        """Runs `encoder.onnx`: returns `(encoder_output, source_mask, cross_caches)`.

        The last batch's outputs are kept and returned again for the same ids.

        `cross_caches` is `[cross_key_0, cross_value_0, cross_key_1, ...]`,
        each `(batch, heads, source_len, head_dim)`.
        """
        source_ids = check_ids("source_ids", source_ids)
        key = (source_ids.shape, source_ids.tobytes())
        last = self._last_encoded
        if last is not None and last[0] == key:
            return last[1]
        encoded, mask, *cross = self.encoder_session.run(None, {"source_ids": source_ids})
        # Kept for the teacher-forced pass that follows a search of the same
        # batch (alignments): it then does not encode the batch again.
        self._last_encoded = (key, (encoded, mask, cross))
        return encoded, mask, cross

    def cache_names(self, kind):
        """`[kind_key_0, kind_value_0, kind_key_1, ...]` for kind "cross" or "self"."""
        return [f"{kind}_{part}_{i}" for i in range(self.num_layers) for part in ("key", "value")]

    def empty_self_caches(self, batch_size):
        """The self-attention keys and values before the first step (length 0)."""
        shape = (batch_size, self.num_heads, 0, self.head_dim)
        return [np.zeros(shape, np.float32) for _ in range(2 * self.num_layers)]

    def decoder_step(self, token_ids, source_mask, cross_caches, self_caches):
        """Runs `decoder_step.onnx` for one new token per sequence.

        Args:
            token_ids: int `(batch, 1)`, the newest token of each sequence.
            source_mask: bool `(sentences, source_len)` from `encode`.
            cross_caches: the cross keys and values from `encode`.
                `batch` may be a multiple of `sentences`: rows `s * G` to
                `s * G + G - 1` (G = batch / sentences, e.g. the beams of
                sentence s) all read sentence s.
            self_caches: `[self_key_0, self_value_0, ...]`, float32 `(batch,
                heads, t, head_dim)`; `empty_self_caches(batch)` at the first step.

        Returns:
            `(log_probs (batch, vocabulary), new_self_caches)` with caches one longer.
        """
        token_ids = check_ids("token_ids", token_ids)
        if token_ids.shape[1] != 1:
            raise ValueError(f"token_ids must have shape (batch, 1). Received {token_ids.shape}")
        source_mask = np.asarray(source_mask)
        if source_mask.ndim != 2 or source_mask.dtype != np.bool_:
            raise ValueError(
                "source_mask must be a bool (batch, source_len) array. Received "
                f"{source_mask.dtype} {source_mask.shape}"
            )
        rows, sentences = len(token_ids), len(source_mask)
        if sentences == 0 or rows % sentences:
            raise ValueError(
                f"token_ids has {rows} rows, not a multiple of the {sentences} sentences "
                "of source_mask (the rows of a sentence, e.g. its beams, are consecutive)."
            )
        feeds = {"token_ids": token_ids, "source_mask": source_mask}
        for kind, caches in (("cross", cross_caches), ("self", self_caches)):
            names = self.cache_names(kind)
            if len(caches) != len(names):
                raise ValueError(
                    f"Expected {len(names)} {kind}-attention arrays ({', '.join(names[:2])}, "
                    f"... one key and one value per layer). Received {len(caches)}"
                )
            for name, cache in zip(names, caches, strict=True):
                cache = np.asarray(cache)
                batch, length = (
                    (sentences, source_mask.shape[1]) if kind == "cross" else (rows, None)
                )
                expected = (batch, self.num_heads, length, self.head_dim)
                if cache.ndim != 4 or any(
                    e is not None and e != got for e, got in zip(expected, cache.shape, strict=True)
                ):
                    raise ValueError(
                        f"{name} must have shape ({'sentences' if kind == 'cross' else 'batch'}"
                        f"={batch}, heads={self.num_heads}, "
                        f"length, head_dim={self.head_dim}). Received {cache.shape}"
                    )
                if cache.dtype != np.float32:
                    raise ValueError(f"{name} must be float32. Received dtype {cache.dtype}")
                feeds[name] = cache
        return self.run_log_probs(feeds)

    def run_log_probs(self, feeds, top_k=0):
        """The step's whole `log_probs` and new self caches, for complete `feeds`;
        with `top_k`, also its selection: `(log_probs, (top_log_probs, top_ids),
        new_caches)`, each row's `top_k` best tokens but padding and BOS (ties:
        the lower id), at most all of those."""
        if not top_k:
            feeds["top_k"] = np.array([1], np.int64)  # the selection is not read
            log_probs, *new_caches = self.step_session.run(
                ["log_probs", *self._new_self_names], feeds
            )
            return log_probs, new_caches
        feeds["top_k"] = np.array([min(top_k, self.vocabulary_size - 2)], np.int64)
        log_probs, values, ids, *new_caches = self.step_session.run(
            ["log_probs", "top_log_probs", "top_ids", *self._new_self_names], feeds
        )
        return log_probs, (values, ids), new_caches

    def search_feeds(self, mask, cross_caches):
        """The per-sentence feeds of the step and search graphs: the mask, the cross caches."""
        feeds = {"source_mask": mask}
        feeds.update(zip(self.cache_names("cross"), cross_caches, strict=True))
        return feeds

    def teacher_forced(self, graph, source, target_inputs, **feeds):
        """Runs the teacher-forced graph `graph` (`forced_scores`, `alignment` or
        `teacher_forced`) on the encoded `source` and `target_inputs` (BOS first): its output."""
        _, mask, cross = self.encode(source)
        feeds = dict(
            self.search_feeds(mask, cross),
            target_ids=check_ids("target_ids", target_inputs),
            **feeds,
        )
        return self.session(graph).run(None, feeds)[0]

    def log_probs(self, source_ids, target_ids):
        """The teacher-forced log-probabilities `(batch, target_len, vocabulary)`, float32
        (`teacher_forced.onnx`: the search specification's view of the model)."""
        return self.teacher_forced(
            "teacher_forced", check_ids("source_ids", source_ids), target_ids
        )

    # ----------------------------------------------------------------------- the interface

    def start(self, source, rows, steps):
        """Encodes `source` once per sentence; a state of `rows` hypotheses per sentence
        (its caches grow step by step: `steps` is not needed)."""
        return OnnxSearchState(self, source, rows)

    def greedy(self, source, limits, masks=NO_MASKS, attention=False):
        """Greedy search under the stateless `masks` as one call of a search graph
        (`greedy_search` for up to `GRAPH_LOOP_MAX_SENTENCES` sentences,
        `greedy_batch_search` above); None where the masks drop more tokens than
        the graph's selection takes. `attention`: also the alignment weights
        (`decoder.Decoder.greedy`)."""
        graph = self._listed(
            "greedy_search" if len(source) <= GRAPH_LOOP_MAX_SENTENCES else "greedy_batch_search"
        )
        if not self._takes(graph, 1, masks):
            return None
        parts = self.split_parts(len(source))
        if parts > 1:
            return self._split_search(
                source,
                limits,
                parts,
                lambda worker, part, lims: worker.greedy(part, lims, masks, attention),
            )
        return self.run_greedy_graph(source, limits, graph, masks, attention)

    def _listed(self, graph):
        """`graph`, or its shortlisted version where this decoder searches with a shortlist."""
        return f"{graph}_shortlist" if self.shortlist is not None else graph

    def shortlist_feeds(self, graph, source, width, masks):
        """The `shortlist` input of a shortlisted search graph: the batch's ids, at
        least as many as a step selects (`width` plus one per maskable token)."""
        if not graph.endswith("_shortlist"):
            return {}
        wide = width + len(masks.suppressed) + (masks.min_length > 0)
        return {"shortlist": self.shortlist.ids(source, at_least=wide)}

    def _takes(self, graph, width, masks):
        """Whether `graph` selects `width` tokens a step under `masks`: it selects one
        more per token the masks may drop, up to its manifest's `max_top_k` (the
        blocks of a blocked selection) and the vocabulary."""
        if graph not in self._graph_files:
            return False
        wide = width + len(masks.suppressed) + (masks.min_length > 0)
        limit = self.manifest["graphs"][graph].get("max_top_k", self.vocabulary_size)
        return wide <= min(limit, self.vocabulary_size)

    @staticmethod
    def mask_feeds(masks):
        """The search graphs' `suppressed` and `min_length` inputs for `masks`."""
        return {
            "suppressed": np.asarray(masks.suppressed, np.int64).reshape(-1),
            "min_length": np.array(masks.min_length, np.int64),
        }

    def run_greedy_graph(
        self, source, limits, graph="greedy_search", masks=NO_MASKS, attention=False
    ):
        """Greedy search as one call of the search graph `graph`: `(tokens, token_scores)`,
        each sentence's step scores (EOS included when produced); with `attention`,
        also each sentence's alignment weights, `(steps, source_len)` (None from a
        graph without them)."""
        _, mask, cross = self.encode(source)
        feeds = self.search_feeds(mask, cross)
        feeds.update(self.mask_feeds(masks))
        feeds.update(self.shortlist_feeds(graph, source, 1, masks))
        feeds["limits"] = np.asarray(limits, np.int64)
        aligned = self._alignment_feed(graph, attention, feeds)
        tokens, step_scores, *weights = self.session(graph).run(None, feeds)
        # A sentence's output stops at its first EOS (ended) or -1 (done before).
        stops = (tokens == EOS_ID) | (tokens < 0)
        lengths = np.where(stops.any(0), stops.argmax(0), len(tokens))
        # Its steps: its tokens, and EOS where it ended with one.
        ended = np.array(
            [n < len(tokens) and tokens[n, i] == EOS_ID for i, n in enumerate(lengths)]
        )
        steps = lengths + ended
        found = [tokens[: lengths[i], i].tolist() for i in range(len(limits))]
        scores = [
            step_scores[: steps[i], i].astype(np.float64).tolist() for i in range(len(limits))
        ]
        if not attention:
            return found, scores
        rows = [weights[0][: steps[i], i] if aligned else None for i in range(len(limits))]
        return found, scores, rows

    def _alignment_feed(self, graph, attention, feeds):
        """Feeds a search graph's `alignment` input where it has one (exports of
        format 8 made before it lack it); whether the graph returns alignments."""
        if ALIGNMENT_INPUT not in self.manifest["graphs"][graph]["inputs"]:
            return False
        feeds[ALIGNMENT_INPUT] = np.array(bool(attention))
        return bool(attention)

    def _beam_graph(self, sentences, beam_size, masks=NO_MASKS, form="gnmt"):
        """The beam graph that searches `sentences` at `beam_size` under `masks` and the
        length penalty `form`, or None.

        A graph selects block by block, so it takes `2 * beam_size` (and one
        more per token the masks may drop) up to its number of blocks (the
        manifest's `max_top_k`); wider beams run the loop, as the average form
        does in exports older than the graphs' `length_penalty_form` input.
        """
        names = [self._listed("beam_batch_search")]
        if sentences <= BEAM_GRAPH_MAX_SENTENCES:
            names.insert(0, self._listed("beam_search"))
        graphs = self.manifest["graphs"]
        return next(
            (
                name
                for name in names
                if self._takes(name, 2 * beam_size, masks)
                and (form == "gnmt" or LENGTH_PENALTY_FORM_INPUT in graphs[name]["inputs"])
            ),
            None,
        )

    def beam(
        self,
        source,
        limits,
        beam_size,
        length_penalty,
        n_best=1,
        masks=NO_MASKS,
        length_penalty_form="gnmt",
        attention=False,
    ):
        """Beam search as one call of a search graph: `(tokens, scores, token_scores)`,
        each per sentence a list of its `n_best` best hypotheses' (best first); None
        where no graph takes the beam or the form. `attention`: also the alignment
        weights (`decoder.Decoder.beam`)."""
        graph = self._beam_graph(len(source), beam_size, masks, length_penalty_form)
        if graph is None:
            return None
        parts = self.split_parts(len(source), beam_size)
        rules = (n_best, masks, length_penalty_form, attention)
        if parts > 1:
            return self._split_search(
                source,
                limits,
                parts,
                lambda worker, part, lims: worker.beam(
                    part, lims, beam_size, length_penalty, *rules
                ),
            )
        return self.run_beam_graph(source, limits, beam_size, length_penalty, graph, *rules)

    def run_beam_graph(
        self,
        source,
        limits,
        beam_size,
        length_penalty,
        graph="beam_search",
        n_best=1,
        masks=NO_MASKS,
        length_penalty_form="gnmt",
        attention=False,
    ):
        """Beam search as one call of the search graph `graph`: `(tokens, scores,
        token_scores)`, per sentence its `n_best` best hypotheses' (fewer where fewer
        finished), best first; with `attention`, also their alignment weights,
        `(steps, source_len)` each (None from a graph without them).

        Each sentence is encoded once; the graph gives its beams its row.
        """
        _, mask, cross = self.encode(source)
        feeds = self.search_feeds(mask, cross)
        feeds["limits"] = np.asarray(limits, np.int64)
        feeds["beam_size"] = np.array(beam_size, np.int64)
        feeds["length_penalty"] = np.array(length_penalty, np.float64)
        feeds["n_best"] = np.array(n_best, np.int64)
        if LENGTH_PENALTY_FORM_INPUT in self.manifest["graphs"][graph]["inputs"]:
            form = LENGTH_PENALTY_FORM_IDS[length_penalty_form]
            feeds[LENGTH_PENALTY_FORM_INPUT] = np.array(form, np.int64)
        feeds.update(self.mask_feeds(masks))
        feeds.update(self.shortlist_feeds(graph, source, 2 * beam_size, masks))
        aligned = self._alignment_feed(graph, attention, feeds)
        tokens, lengths, scores, steps, *weights = self.session(graph).run(None, feeds)
        # A hypothesis's step scores: its tokens', and EOS's where it ended with
        # one (under its limit). A score of -inf: fewer finished than n_best.
        taken = lengths + (lengths < np.asarray(limits)[:, None])
        found = ([], [], [], [])
        for i in range(len(limits)):
            kept = [j for j in range(n_best) if scores[i, j] > -np.inf]
            found[0].append([tokens[i, j, : lengths[i, j]].tolist() for j in kept])
            found[1].append([float(scores[i, j]) for j in kept])
            found[2].append([steps[i, j, : taken[i, j]].tolist() for j in kept])
            found[3].append([weights[0][i, j, : taken[i, j]] if aligned else None for j in kept])
        return found if attention else found[:3]

    def label_log_probs(self, source, target_inputs, labels):
        """The log-probabilities of `labels` `(batch, target_len)` in one pass of
        `forced_scores.onnx` (a float32 log-softmax in the graph, one number per
        label out); 0 where the input is padding."""
        labels = check_ids("labels", labels)
        target_inputs = check_ids("target_ids", target_inputs)
        found = np.zeros(labels.shape, np.float64)
        # The graph scores the labels of the positions whose input is not padding.
        found[target_inputs != PAD_ID] = self.teacher_forced(
            "forced_scores", source, target_inputs, labels=labels
        )
        return found

    def alignment_weights(self, source, target_inputs):
        """`alignment.onnx`'s weights: the alignment layer's cross-attention, heads averaged."""
        return self.teacher_forced("alignment", source, target_inputs)
