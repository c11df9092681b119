"""Translate with exported ONNX graphs on ONNX Runtime: numpy, onnxruntime and sentencepiece only.

Importing this module imports neither TensorFlow nor Keras. Every search
follows the rules of `keras_transformer_runtime.spec`, as the Keras decoder
does (the tests check both against it), so both give the same translations.

Example:

    translator = OnnxTranslator("runs/demo-onnx")
    translator.translate(["ko mina tel"], beam_size=4)
"""

from __future__ import annotations

import json
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from keras_transformer_runtime import tokenizers
from keras_transformer_runtime.constraints import sentence_constraints, word_continuations
from keras_transformer_runtime.search import (
    add_alignments,
    beam_loop,
    check_beam_arguments,
    encode_prefixes,
    forced_scores,
    hypothesis_records,
    options_loop,
    output_limits,
    plain_hypotheses,
    prefixed_limits,
    search_texts,
    source_array,
    teacher_inputs,
    translate_texts,
)
from keras_transformer_runtime.spec import SearchOptions, alignments, truncate_source
from keras_transformer_runtime.specials import EOS_ID, PAD_ID

MANIFEST = "manifest.json"
# The export format this runtime reads: `keras-transformer export` writes it
# into the manifest as `format_version` (the exporter imports it from here),
# and an export of any other version is refused. 5: the encoder, the decoder
# step with its `top_k` selection and cross keys and values once per
# sentence, the four search graphs, and one weights file per precision;
# 6: `model.onnx` also returns the alignment layer's cross-attention.
FORMAT_VERSION = 6
# Greedy batches of at most this many sentences run as one call of the
# greedy_search graph (the loop inside ONNX Runtime, which computes a finished
# sentence's row to the end); larger ones as one call of greedy_batch_search,
# whose loop drops each sentence when it ends. Measured in docs/performance.md
# ("Runtime choices").
GRAPH_LOOP_MAX_SENTENCES = 4
# The same for beam search: beam_search up to this many sentences (it computes
# every finished sentence's beams to the end), beam_batch_search above; a beam
# too wide for the graphs' selection searches step by step from Python.
BEAM_GRAPH_MAX_SENTENCES = 4
# The graphs whose idle worker threads spin between parallel sections instead
# of sleeping, so that the many small products of a decoder step do not each
# wait for a thread to wake. The encoder's threads sleep: each session has
# its own pool, and the encoder's spinning on while a search runs leaves more
# busy threads than cores. Faster than no spinning in most cells, every graph
# spinning slower than both (docs/performance.md, "Runtime choices"). With one
# thread per search (`num_threads=1`) there is no worker to spin.
SPINNING_GRAPHS = (
    "decoder_step",
    "greedy_search",
    "greedy_batch_search",
    "beam_search",
    "beam_batch_search",
)
# Of those, the graphs whose threads sleep all the same in float32: the
# float32 greedy batch graph was faster with sleeping threads at 2 threads
# and batch 32, the one cell where it was so on both CPUs measured (the same
# command, `2x1:none` against `2x1`); in int8 its threads spin.
SLEEPING_FLOAT32_GRAPHS = ("greedy_batch_search",)
# On a CPU, a search on N > 1 intra-op threads runs as N searches of part of
# the batch at once, each on one thread, where every part holds at least
# this many decoder rows (sentences x beam size); a smaller batch runs whole.
# The operators of a decoder step are small: threads that share each one
# wait on each other at every one of them, while searches of part of the
# batch each never wait. Float32 and float16 translations are
# the same either way; int8 graphs quantize a step's activations with one
# scale per batch, so a part's translations may differ from the whole
# batch's, and by default they keep whole batches (their outputs then do
# not depend on the thread count). `split_batches` chooses otherwise.
SPLIT_MIN_ROWS = 8
# The parts of a split batch are runs of its sentences in order of length,
# sized so that the parts end together. A part's time is taken as (rows +
# this) x its longest source: the rows' work, and the part of every step that
# does not grow with the rows (the operators' fixed cost), in rows.
SPLIT_STEP_ROWS = 8


def length_runs(lengths, parts, step_rows=SPLIT_STEP_ROWS):
    """Indices of `lengths` cut into `parts` runs in order of length (shortest first), each
    non-empty, that make the longest estimated part time, `(rows + step_rows) x longest
    length`, as short as it can be.

    Against dealing the sentences out in turn (every part then runs as long as
    the longest sentence of the whole batch), a part of short sentences takes
    more of them and ends with the part of long ones: the padding of a batch
    of mixed lengths is not computed.
    """
    lengths = np.asarray(lengths)
    order = np.argsort(lengths, kind="stable")
    ordered = np.maximum(lengths[order], 1).astype(np.float64)
    count = len(order)
    parts = max(1, min(parts, count))

    def cuts_within(limit):
        """Ends of the runs, made greedily from the shortest, none over `limit`; or None."""
        ends, start = [], 0
        while start < count:
            end = start + 1
            if (1 + step_rows) * ordered[start] > limit:
                return None
            while end < count and (end + 1 - start + step_rows) * ordered[end] <= limit:
                end += 1
            ends.append(end)
            start = end
        return ends if len(ends) <= parts else None

    low, high = 0.0, (count + step_rows) * ordered[-1]
    for _ in range(50):  # bisection on the longest part time
        middle = (low + high) / 2
        if cuts_within(middle) is None:
            low = middle
        else:
            high = middle
    ends = cuts_within(high)
    # Fewer runs than parts: split the largest runs so that every part has work.
    runs = [order[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    while len(runs) < parts:
        largest = max(range(len(runs)), key=lambda i: len(runs[i]))
        run = runs.pop(largest)
        runs[largest:largest] = [run[: len(run) // 2], run[len(run) // 2 :]]
    return runs


_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"


class ExportFileError(RuntimeError):
    """A file of an ONNX export folder is missing, unreadable or of another format version.

    The message names the file and says what to do.
    """


def available_cores():
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _check_format_version(manifest, path):
    """Refuses a manifest of a format version other than `FORMAT_VERSION`, saying to re-export."""
    version = manifest.get("format_version")
    redo = "re-export the run with `keras-transformer export RUN_DIR --out OUT_DIR`"
    if version is None:
        raise ExportFileError(
            f"{path} has no format_version (an export older than format versions); this "
            f"runtime reads format_version {FORMAT_VERSION}: {redo}."
        )
    if isinstance(version, bool) or not isinstance(version, int):
        raise ExportFileError(
            f"{path} has format_version {version!r}, not a whole number; this runtime reads "
            f"format_version {FORMAT_VERSION}: {redo}."
        )
    if version < FORMAT_VERSION:
        raise ExportFileError(
            f"{path} is an export of format_version {version}, older than the "
            f"format_version {FORMAT_VERSION} this runtime reads: {redo}."
        )
    if version > FORMAT_VERSION:
        raise ExportFileError(
            f"{path} is an export of format_version {version}, newer than the "
            f"format_version {FORMAT_VERSION} this runtime reads: install the "
            f"keras-transformer-runtime of the exporter that wrote it, or {redo} "
            "using this runtime's version of keras-transformer."
        )


def load_tokenizer(path):
    """The export's tokenizer; a missing or unreadable file raises `ExportFileError` naming it."""
    if not os.path.isfile(path):
        raise ExportFileError(f"Tokenizer file missing: {path}")
    try:
        return tokenizers.load_tokenizer(path)
    except (OSError, ValueError) as error:
        raise ExportFileError(f"Cannot read the tokenizer {path}: {error}") from error


# --------------------------------------------------------------------------- sessions


def _nvidia_driver_present():
    """Whether an NVIDIA driver library loads here (without it CUDA cannot run)."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def default_providers():
    """CUDA (then CPU) when this ONNX Runtime has CUDA and a driver is present, otherwise CPU.

    Checking for the driver first keeps a GPU build of ONNX Runtime on a
    machine without a GPU from logging CUDA load errors before it falls back.
    """
    import onnxruntime as ort

    if _CUDA in ort.get_available_providers() and _nvidia_driver_present():
        return [_CUDA, _CPU]
    return [_CPU]


def _session(path, providers, num_threads, spinning=False):
    import onnxruntime as ort

    if not os.path.isfile(path):
        raise ExportFileError(f"ONNX graph missing: {path}")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if num_threads is not None:
        options.intra_op_num_threads = int(num_threads)
    # Which graphs spin: `SPINNING_GRAPHS`.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    try:
        return ort.InferenceSession(path, sess_options=options, providers=providers)
    except Exception as error:  # onnxruntime raises its own exception types
        raise ExportFileError(f"Cannot load the ONNX graph {path}: {error}") from error


def _check_ids(name, array, rank=2):
    array = np.asarray(array)
    if array.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}. Received shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids. Received dtype {array.dtype}")
    return array.astype(np.int32, copy=False)


class OnnxTranslator:
    """Greedy and beam-search translation with the graphs written by `export_onnx`.

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
            its own (`SPLIT_MIN_ROWS`; those sessions hold the weights once
            per thread). None (the default): float32 and float16 graphs,
            where each part has at least `SPLIT_MIN_ROWS` rows; True: any
            batch of at least one sentence per thread, int8 too; False:
            never.

    The export must be of `FORMAT_VERSION`; any other raises
    `ExportFileError`, which says to re-export. The search graphs' idle
    threads spin and the encoder's sleep (`SPINNING_GRAPHS`).
    """

    def __init__(
        self,
        onnx_dir,
        providers=None,
        num_threads=None,
        precision="float32",
        split_batches=None,
    ):
        self.onnx_dir = os.fspath(onnx_dir)
        if not os.path.isdir(self.onnx_dir):
            raise ExportFileError(f"ONNX export folder not found: {self.onnx_dir}")
        manifest_path = os.path.join(self.onnx_dir, MANIFEST)
        try:
            with open(manifest_path, encoding="utf-8") as f:
                self.manifest = json.load(f)
            _check_format_version(self.manifest, manifest_path)
            graphs = self.manifest["graphs"]
            config = self.manifest["config"]
            precisions = self.manifest["precisions"]
        except FileNotFoundError as error:
            raise ExportFileError(f"{MANIFEST} missing: {manifest_path}") from error
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ExportFileError(
                f"{manifest_path} is not a valid export manifest: {error}"
            ) from error
        if precision not in precisions:
            raise ValueError(
                f"This export has no {precision!r} graphs (it has {', '.join(precisions)})."
            )
        self.precision = precision
        self._check_weights(precision)
        self.num_layers = int(config["num_layers"])
        self.num_heads = int(config["num_heads"])
        self.head_dim = int(config["hidden_dim"]) // self.num_heads
        self.max_length = int(config["max_length"])
        self.vocabulary_size = int(config["vocabulary_size"])
        tokenizer = self.manifest.get("tokenizer")
        self.tokenizer = (
            load_tokenizer(os.path.join(self.onnx_dir, tokenizer)) if tokenizer else None
        )
        self._providers = list(providers) if providers is not None else default_providers()
        self._num_threads = num_threads
        self._graph_files = {name: entry[precision] for name, entry in graphs.items()}
        self._sessions = {}
        self._copies = []  # for parallel beam searches: `_parallel_translators`
        self._split = None if split_batches is None else bool(split_batches)
        self._split_workers = []  # one one-thread translator per part of a split search
        self._split_pool = None  # runs the parts after the first
        self._split_lock = threading.Lock()
        self._self_names = self.cache_names("self")
        self._new_self_names = ["new_" + name for name in self._self_names]
        self.encoder_session = self.session("encoder")
        self.step_session = self.session("decoder_step")
        self.provider = self.step_session.get_providers()[0]

    def _check_weights(self, precision):
        """The shared weights file of `precision` is there and whole (`weights.bin`...)."""
        try:
            weights = self.manifest["weights"][precision]
        except (KeyError, TypeError) as error:
            raise ExportFileError(
                f"{MANIFEST} in {self.onnx_dir} lists no {precision} weights file: "
                "the export is incomplete; export the run again."
            ) from error
        path = os.path.join(self.onnx_dir, weights)
        if not os.path.isfile(path):
            raise ExportFileError(
                f"{weights} missing from {self.onnx_dir}: it holds the {precision} weights "
                "of every graph that translates; copy the whole export folder."
            )
        expected = self.manifest.get("weight_bytes", {}).get(precision)
        if expected is not None and os.path.getsize(path) != expected:
            raise ExportFileError(
                f"{path} has {os.path.getsize(path)} bytes, not the {expected} the export "
                "wrote: it is truncated or from another export; copy it again."
            )

    def session(self, name):
        """The ONNX Runtime session of graph `name` ("encoder", "decoder_step" or "model")."""
        if name not in self._sessions:
            if name not in self._graph_files:
                raise ExportFileError(f"{MANIFEST} in {self.onnx_dir} lists no {name!r} graph.")
            path = os.path.join(self.onnx_dir, self._graph_files[name])
            spinning = name in SPINNING_GRAPHS and not (
                self.precision == "float32" and name in SLEEPING_FLOAT32_GRAPHS
            )
            self._sessions[name] = _session(path, self._providers, self._num_threads, spinning)
        return self._sessions[name]

    def _parallel_translators(self, count, beam_size):
        """The translators of `count` searches run at once.

        Beam searches get one each: this translator and `count - 1` copies of
        it (made once, then kept), each with ONNX Runtime sessions of its own,
        on which parallel beam searches of one sentence ran faster than on
        shared ones (docs/performance.md, "Runtime choices"). Greedy searches
        share this one's sessions: no gain showed for them, and each copy
        holds the weights again.
        """
        if beam_size == 1:
            return [self] * count
        while len(self._copies) < count - 1:
            self._copies.append(self._copy())
        return [self, *self._copies[: count - 1]]

    def _copy(self, **changes):
        """A translator of the same export and settings (but `changes`), with sessions of its own."""
        settings = {
            "providers": self._providers,
            "num_threads": self._num_threads,
            "precision": self.precision,
            "split_batches": self._split,
        }
        return OnnxTranslator(self.onnx_dir, **{**settings, **changes})

    def threads(self):
        """The intra-op threads of a search: `num_threads`, or the cores this process may use."""
        return int(self._num_threads) if self._num_threads is not None else available_cores()

    def split_parts(self, sentences, beam_size=1):
        """Into how many parts a search of `sentences` runs (1: whole; see `split_batches`)."""
        # One part per thread or none: the parts' translators (each with a
        # copy of the weights) are made once, one per thread.
        parts = self.threads()
        if self._split is False or self.provider != _CPU or parts < 2 or sentences < parts:
            return 1
        if self._split is None and (
            self.precision == "int8" or sentences * beam_size < parts * SPLIT_MIN_ROWS
        ):
            return 1
        return parts

    def _split_search(self, source, parts, search):
        """`search(translator, rows)` on `parts` parts of `source` at once; results in order.

        The parts are runs of the sentences in order of length, sized so that
        they end together (`length_runs`). Each part runs on a one-thread
        translator of its own.
        """
        with self._split_lock:
            while len(self._split_workers) < parts:
                self._split_workers.append(self._copy(num_threads=1, split_batches=False))
            if self._split_pool is None:
                self._split_pool = ThreadPoolExecutor(parts - 1, "split-search")
            workers, pool = self._split_workers[:parts], self._split_pool
        groups = length_runs((source != PAD_ID).sum(1), parts)
        # The first part runs on this thread; the pool's threads only search.
        futures = [
            pool.submit(search, worker, source[group])
            for worker, group in zip(workers[1:], groups[1:], strict=True)
        ]
        results = [search(workers[0], source[groups[0]])]
        results += [future.result() for future in futures]
        tokens = [None] * len(source)
        scores = np.zeros(len(source), np.float64)
        for group, (part_tokens, part_scores) in zip(groups, results, strict=True):
            for row, output, score in zip(group, part_tokens, part_scores, strict=True):
                tokens[row], scores[row] = output, score
        return tokens, scores

    # ----------------------------------------------------------------------- graphs

    def encode(self, source_ids):
        """Runs `encoder.onnx`: returns `(encoder_output, source_mask, cross_caches)`.

        `cross_caches` is `[cross_key_0, cross_value_0, cross_key_1, ...]`,
        each `(batch, heads, source_len, head_dim)`.
        """
        source_ids = _check_ids("source_ids", source_ids)
        encoded, mask, *cross = self.encoder_session.run(None, {"source_ids": source_ids})
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
        token_ids = _check_ids("token_ids", token_ids)
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
        return self._run_log_probs(feeds)

    def _run_log_probs(self, feeds):
        """The step's whole `log_probs` and new self caches, for complete `feeds`."""
        feeds["top_k"] = np.array([1], np.int64)  # the selection is not read
        log_probs, *new_caches = self.step_session.run(["log_probs", *self._new_self_names], feeds)
        return log_probs, new_caches

    def _search_feeds(self, mask, cross_caches):
        feeds = {"source_mask": mask}
        feeds.update(zip(self.cache_names("cross"), cross_caches, strict=True))
        return feeds

    @staticmethod
    def _kept_feeds(feeds, rows):
        """The per-source feeds (`source_mask`, the cross caches) of `rows` only."""
        return {
            name: value[rows]
            for name, value in feeds.items()
            if name == "source_mask" or name.startswith("cross_")
        }

    def _run_step(self, token_ids, feeds, self_caches, top_k):
        """`decoder_step` without the input checks, for the search loops.

        Returns `(scores, new_self_caches)`: the graph's `(top_log_probs,
        top_ids)` of width `top_k`, as `beam_loop` takes them.
        """
        feeds["token_ids"] = token_ids
        feeds.update(zip(self._self_names, self_caches, strict=True))
        feeds["top_k"] = np.array([min(top_k, self.vocabulary_size)], np.int64)
        values, ids, *new_caches = self.step_session.run(
            ["top_log_probs", "top_ids", *self._new_self_names], feeds
        )
        return (values, ids), new_caches

    def logits(self, source_ids, target_ids):
        """Teacher-forced logits from `model.onnx` (for parity checks)."""
        feeds = {
            "source_ids": _check_ids("source_ids", source_ids),
            "target_ids": _check_ids("target_ids", target_ids),
        }
        return self.session("model").run(None, feeds)[0]

    # ----------------------------------------------------------------------- search

    def _prepare(self, source_ids, max_length):
        # ONNX Runtime takes any source length: no padding beyond the longest.
        source, lengths = source_array(source_ids, self.max_length, multiple=1)
        return source, output_limits(lengths, max_length, self.max_length)

    def greedy_search(self, source_ids, max_length=None):
        """Greedy search; same arguments, rules and results as `keras_transformer.decoding`.

        One call of a search graph: `greedy_search` for up to
        `GRAPH_LOOP_MAX_SENTENCES` sentences, `greedy_batch_search` above.
        """
        source, limits = self._prepare(source_ids, max_length)
        if (limits == 0).all():
            return [[] for _ in limits], np.zeros(len(limits), np.float64)
        parts = self.split_parts(len(source))
        if parts > 1:
            return self._split_search(
                source,
                parts,
                lambda worker, rows: worker.greedy_search(rows, max_length=max_length),
            )
        _, mask, cross = self.encode(source)
        if len(source) <= GRAPH_LOOP_MAX_SENTENCES:
            return self._greedy_in_graph(mask, cross, limits)
        return self._greedy_in_graph(mask, cross, limits, "greedy_batch_search")

    def _greedy_in_graph(self, mask, cross, limits, graph="greedy_search"):
        """The greedy search as one call of the `graph` graph (same results)."""
        feeds = self._search_feeds(mask, cross)
        feeds["limits"] = np.asarray(limits, np.int64)
        tokens, step_scores = self.session(graph).run(None, feeds)
        # A sentence's output stops at its first EOS (ended) or -1 (done before).
        stops = (tokens == EOS_ID) | (tokens < 0)
        lengths = np.where(stops.any(0), stops.argmax(0), len(tokens))
        scores = np.zeros(len(limits), np.float64)
        for row in step_scores:  # summed step by step in float64, as the specification does
            scores += row.astype(np.float64)
        return [tokens[: lengths[i], i].tolist() for i in range(len(limits))], scores

    def beam_search(self, source_ids, beam_size=4, length_penalty=0.6, max_length=None):
        """Beam search; same arguments, rules and results as `keras_transformer.decoding`."""
        check_beam_arguments(beam_size, length_penalty)
        source, limits = self._prepare(source_ids, max_length)
        if (limits == 0).all():
            return beam_loop(None, None, limits, beam_size, length_penalty)
        parts = self.split_parts(len(source), beam_size)
        if parts > 1:
            return self._split_search(
                source,
                parts,
                lambda worker, rows: worker.beam_search(
                    rows, beam_size=beam_size, length_penalty=length_penalty, max_length=max_length
                ),
            )
        # Each sentence is encoded once, and its first step runs once: the
        # first reorder gives its beams copies of its row. The cross keys and
        # values stay one row per sentence.
        _, mask, cross = self.encode(source)

        def graph_takes(graph):
            # A graph that selects block by block takes 2 * beam_size up to its
            # number of blocks (`max_top_k`); larger beams search in Python.
            entry = self.manifest["graphs"].get(graph, {})
            limit = entry.get("max_top_k", self.vocabulary_size)
            return graph in self._graph_files and 2 * beam_size <= limit

        if 2 * beam_size <= self.vocabulary_size:
            if len(source) <= BEAM_GRAPH_MAX_SENTENCES and graph_takes("beam_search"):
                return self._beam_in_graph(mask, cross, limits, beam_size, length_penalty)
            if graph_takes("beam_batch_search"):
                return self._beam_in_graph(
                    mask, cross, limits, beam_size, length_penalty, "beam_batch_search"
                )
        state = {
            "feeds": self._search_feeds(mask, cross),
            "caches": self.empty_self_caches(len(mask)),
        }

        def step(last, t):
            scores, state["caches"] = self._run_step(
                last[:, None].copy(), state["feeds"], state["caches"], 2 * beam_size
            )
            return scores

        def reorder(rows):
            previous = len(state["caches"][0])
            if len(rows) == previous:
                # Same rows: move only the beams whose origin changed, in place
                # (the caches are this loop's own arrays). Many beams keep their
                # row, and writing into existing memory spares the fresh
                # allocation (and its page faults) of a full copy.
                moved = np.flatnonzero(rows != np.arange(previous))
                origins = rows[moved]
                for cache in state["caches"]:
                    cache[moved] = cache[origins]
            else:
                state["caches"] = [cache[rows] for cache in state["caches"]]
            sentences = len(state["feeds"]["source_mask"])
            # A sentence's beams come from its own rows of the previous
            # state (`previous // sentences` of them): its first beam
            # names it. Only finished sentences leaving changes the rows.
            kept = rows[::beam_size] // (previous // sentences)
            if len(kept) != sentences:
                state["feeds"] = self._kept_feeds(state["feeds"], kept)

        return beam_loop(
            step,
            reorder,
            limits,
            beam_size,
            length_penalty,
            drop_finished=True,
            shared_first_step=True,
        )

    def _beam_in_graph(self, mask, cross, limits, beam_size, length_penalty, graph="beam_search"):
        """The beam search as one call of the `graph` graph (same results)."""
        feeds = self._search_feeds(mask, cross)
        feeds["limits"] = np.asarray(limits, np.int64)
        feeds["beam_size"] = np.array(beam_size, np.int64)
        feeds["length_penalty"] = np.array(length_penalty, np.float64)
        tokens, lengths, scores = self.session(graph).run(None, feeds)
        return [tokens[i, : lengths[i]].tolist() for i in range(len(limits))], scores

    def search(self, source_ids, options=None, prefixes=None, indices=None, constraints=None):
        """The best hypotheses of each source under `options` (a `spec.SearchOptions`).

        Args:
            source_ids: as for `beam_search`.
            options: default `SearchOptions()` (beam 4).
            prefixes: per-sentence target prefix ids (forced first), or None.
            indices: each sentence's index in its input, which seeds its
                sampling (`spec.sentence_rng`); default 0, 1, ...
            constraints: per-sentence terminology constraints, each a list
                of target phrases as token-id lists (or a
                `constraints.Constraints`), or None: every output holds its
                phrases (`constraints.ConstrainedSearch`).

        Returns:
            per sentence, its `spec.Hypothesis` list (`options.n_best` at most),
            best first, with their `alignment` when `options.alignment` asks
            for it (`align_ids`). Plain options without prefixes run the search graphs
            (`greedy_search`, `beam_search`), so options not used cost
            nothing; any other runs `search.options_loop` over the decoder
            step, by the rules of `spec.SentenceSearch`.
        """
        options = options if options is not None else SearchOptions()
        if isinstance(source_ids, np.ndarray):
            source_ids = [
                row[row != PAD_ID].tolist() for row in _check_ids("source_ids", source_ids)
            ]
        if options.max_input_length is not None:
            source_ids = [truncate_source(row, options.max_input_length) for row in source_ids]
        if prefixes is not None and len(prefixes) != len(source_ids):
            raise ValueError(
                f"{len(prefixes)} target prefixes for {len(source_ids)} sentences: give one "
                "per sentence (an empty one for none)."
            )
        options.check_ids(self.vocabulary_size, prefixes)
        if constraints is not None and len(constraints) != len(source_ids):
            raise ValueError(
                f"{len(constraints)} constraint lists for {len(source_ids)} sentences: give "
                "one per sentence (an empty one for none)."
            )
        found = self._search_checked(source_ids, options, prefixes, indices, constraints)
        if options.alignment:  # read after the search: it never changes the search
            add_alignments(found, source_ids, self.align_ids)
        return found

    def _search_checked(self, source_ids, options, prefixes, indices, constraints):
        """`search` once its arguments are checked (no alignments)."""
        if options.is_plain() and not any(prefixes or ()) and not any(map(len, constraints or ())):
            _, limits = self._prepare(source_ids, options.max_length)
            if options.beam_size == 1:
                found = self.greedy_search(source_ids, max_length=options.max_length)
            else:
                found = self.beam_search(
                    source_ids,
                    beam_size=options.beam_size,
                    length_penalty=options.length_penalty,
                    max_length=options.max_length,
                )
            return plain_hypotheses(*found, limits, options)
        source, limits = self._prepare(source_ids, options.max_length)
        limits = prefixed_limits(limits, prefixes, options.max_length)
        if (limits == 0).all():
            return options_loop(
                None, None, limits, options, prefixes, indices, constraints=constraints
            )
        _, mask, cross = self.encode(source)
        k = options.beam_size
        state = {
            "feeds": self._search_feeds(mask, cross),
            "caches": self.empty_self_caches(len(mask) * k),
        }

        def step(last, t):
            feeds = dict(state["feeds"], token_ids=last[:, None].copy())
            feeds.update(zip(self._self_names, state["caches"], strict=True))
            log_probs, state["caches"] = self._run_log_probs(feeds)
            return log_probs

        def reorder(rows):
            state["caches"] = [cache[rows] for cache in state["caches"]]
            kept = rows[::k] // k  # each sentence's first row names it
            if len(kept) != len(state["feeds"]["source_mask"]):
                state["feeds"] = self._kept_feeds(state["feeds"], kept)

        return options_loop(
            step,
            reorder,
            limits,
            options,
            prefixes,
            indices,
            drop_finished=True,
            constraints=constraints,
        )

    def score_ids(self, source_ids, target_ids):
        """Forced decoding: per sentence `(log_prob, token_scores)` of `target_ids[i]`
        (no BOS, no EOS) given `source_ids[i]`, EOS scored last, from `model.onnx`.

        The scores are the model's log-probabilities, no option applied; an
        empty source scores `(None, None)`.
        """
        if len(source_ids) != len(target_ids):
            raise ValueError(
                f"{len(target_ids)} targets for {len(source_ids)} sources: give one each."
            )
        found = [(None, None)] * len(source_ids)
        rows = [i for i, source in enumerate(source_ids) if len(source)]
        if not rows:
            return found
        source, _ = source_array([source_ids[i] for i in rows], self.max_length, multiple=1)
        targets = [[int(t) for t in target_ids[i]] for i in rows]
        logits = self.logits(source, teacher_inputs(targets)).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        for i, result in zip(rows, forced_scores(log_probs, targets), strict=True):
            found[i] = result
        return found

    def align_ids(self, source_ids, target_ids):
        """Per sentence, the source position each token of `target_ids[i]` attends to
        most (`spec.alignments`, from `model.onnx`'s `alignment_weights`)."""
        if len(source_ids) != len(target_ids):
            raise ValueError(
                f"{len(target_ids)} targets for {len(source_ids)} sources: give one each."
            )
        if not len(source_ids):
            return []
        source, lengths = source_array(source_ids, self.max_length, multiple=1)
        targets = [[int(t) for t in target] for target in target_ids]
        feeds = {"source_ids": source, "target_ids": teacher_inputs(targets)}
        (weights,) = self.session("model").run(["alignment_weights"], feeds)
        return alignments(weights, lengths, [len(t) for t in targets])

    def _checked_texts(self, sentences, name="sentences"):
        if isinstance(sentences, str):
            raise TypeError(f"{name} must be a list of strings, not one string.")
        if self.tokenizer is None:
            raise ExportFileError(f"The export in {self.onnx_dir} has no tokenizer file.")
        sentences = list(sentences)
        for i, text in enumerate(sentences):
            if not isinstance(text, str):
                raise TypeError(f"Sentence {i} is a {type(text).__name__}, not a string.")
        return sentences

    def translate_hypotheses(
        self,
        sentences,
        options=None,
        prefixes=None,
        batch_size=32,
        progress=False,
        warn=None,
        constraints=None,
    ):
        """Translates strings under `options`: per sentence a list of dicts, best first,
        with `text`, `score`, `log_prob` and (`options.token_scores`) `token_scores`.

        `prefixes` are target-side texts, one per sentence ("" for none), each
        forced at the start of its translation; one with a word the vocabulary
        lacks is refused. Batching, order and long sentences: as `translate`.

        `constraints`, one entry per sentence (a list of target phrases, or
        None or `[]` for none), makes every translation hold its phrases
        (docs/constraints.md). A phrase that tokenizes to nothing or to the
        unknown token, or that cannot fit in its sentence's output, raises a
        `ValueError` naming it and its line before anything is translated.
        """
        options = options if options is not None else SearchOptions()
        sentences = self._checked_texts(sentences)
        prefix_ids = None
        if prefixes is not None:
            prefixes = self._checked_texts(prefixes, "prefixes")
            if len(prefixes) != len(sentences):
                raise ValueError(f"{len(prefixes)} prefixes for {len(sentences)} sentences.")
            prefix_ids = encode_prefixes(self.tokenizer, prefixes, options.max_length)
        phrases = None
        if constraints is not None:
            phrases = sentence_constraints(
                sentences,
                constraints,
                self.tokenizer.encode,
                self.max_length,
                options.max_length,
                continuations=word_continuations(self.tokenizer),
            )

        def search(sources, indices):
            chosen = None if prefix_ids is None else [prefix_ids[i] for i in indices]
            chosen_phrases = None if phrases is None else [phrases[i] for i in indices]
            return self.search(sources, options, chosen, indices, chosen_phrases)

        found = search_texts(
            sentences,
            self.tokenizer.encode,
            search,
            self.max_length,
            batch_size=batch_size,
            progress=progress,
            warn=warn,
            max_input_length=options.max_input_length,
        )
        return [hypothesis_records(hypotheses, self.tokenizer.decode) for hypotheses in found]

    def score(self, sources, targets, batch_size=32, progress=False, warn=None):
        """Forced decoding of texts: per pair a dict of `log_prob` (summed, EOS included)
        and `token_scores` (None for an empty source). See `score_ids`."""
        sources = self._checked_texts(sources, "sources")
        targets = self._checked_texts(targets, "targets")
        if len(sources) != len(targets):
            raise ValueError(f"{len(targets)} targets for {len(sources)} sources.")

        def search(batch, indices):
            return self.score_ids(batch, [self.tokenizer.encode(targets[i]) for i in indices])

        found = search_texts(
            sources, self.tokenizer.encode, search, self.max_length, batch_size, progress, warn
        )
        return [{"log_prob": total, "token_scores": steps} for total, steps in found]

    def translate(
        self,
        sentences,
        beam_size=4,
        max_length=None,
        batch_size=32,
        progress=False,
        warn=None,
        length_penalty=0.6,
        parallel_batches=1,
        options=None,
        prefixes=None,
        constraints=None,
    ):
        """Translates a list of strings; `beam_size=1` is greedy search.

        `options` (a `spec.SearchOptions`), when given, replaces `beam_size`,
        `length_penalty` and `max_length`; with `prefixes` (target texts) or
        `constraints` (per sentence, target phrases every translation must
        hold; docs/constraints.md), the search is `translate_hypotheses`'s
        and its best text is kept.

        `length_penalty` is the beam search's alpha (see `beam_search`).
        `parallel_batches` > 1 searches that many batches at once, each on
        its own thread (ONNX Runtime runs a session from several threads).
        Give each search its share of the cores through `num_threads`. On
        a CPU, one thread per batch (`num_threads=1`, `parallel_batches` =
        the cores) keeps every core busy while a search runs its Python
        steps between the runtime's calls. One search on several threads
        splits a large float32 or float16 batch into one part per thread
        itself (`split_batches`).

        Sentences are sorted by length into batches and put back in order.
        An empty (or whitespace-only) string gives an empty string; a sentence
        longer than the model's `max_length` is translated whole; `warn(message)`
        hears about each one (see `translate_texts`).
        """
        if isinstance(sentences, str):
            raise TypeError("translate takes a list of strings, not one string.")
        if options is not None or prefixes is not None or constraints is not None:
            options = options or SearchOptions(beam_size, length_penalty, max_length=max_length)
            found = self.translate_hypotheses(
                sentences, options, prefixes, batch_size, progress, warn, constraints
            )
            return [hypotheses[0]["text"] for hypotheses in found]
        sentences = self._checked_texts(sentences)
        check_beam_arguments(beam_size, length_penalty)

        def one_search(translator, batch):
            if beam_size == 1:
                return translator.greedy_search(batch, max_length=max_length)[0]
            return translator.beam_search(
                batch, beam_size=beam_size, length_penalty=length_penalty, max_length=max_length
            )[0]

        if parallel_batches > 1:
            # Each search running holds one translator (`_parallel_translators`).
            free = queue.SimpleQueue()
            for translator in self._parallel_translators(parallel_batches, beam_size):
                free.put(translator)

            def search(batch):
                translator = free.get()
                try:
                    return one_search(translator, batch)
                finally:
                    free.put(translator)
        else:

            def search(batch):
                return one_search(self, batch)

        return translate_texts(
            sentences,
            self.tokenizer.encode,
            self.tokenizer.decode,
            search,
            self.max_length,
            batch_size=batch_size,
            progress=progress,
            warn=warn,
            parallel_batches=parallel_batches,
        )
