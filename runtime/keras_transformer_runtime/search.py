"""Batched greedy and beam search loops in numpy, for the Keras decoder and the runtime.

Both decoders hand these loops a `step` function that returns the
log-probabilities (or the best tokens) of the next token; the loops own
everything else (which tokens may be produced, when a sentence stops, the
length penalty, which beams survive). The rules themselves are written once,
plainly, in `keras_transformer_runtime.spec`; these loops apply them to a
whole batch at once, with a decoder state that shrinks as sentences finish,
and the tests check them against that specification.

This module needs numpy only: `keras_transformer_runtime.runtime` imports it without
TensorFlow or Keras.

Conventions: the special ids of `keras_transformer_runtime.specials`. Returned token ids exclude BOS and
stop before EOS. An empty source gives an empty output with score 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

from keras_transformer_runtime.constraints import ConstrainedSearch
from keras_transformer_runtime.progress import Progress
from keras_transformer_runtime.spec import (
    Hypothesis,
    SentenceSearch,
    banned_ids,
    length_penalty_factor,
    sentence_rng,
    truncate_source,
)
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID, UNK_ID

__all__ = [
    "EXTRA_OUTPUT_TOKENS",
    "banned_ids",
    "beam_loop",
    "check_beam_arguments",
    "add_alignments",
    "check_positive_int",
    "encode_prefixes",
    "forced_scores",
    "greedy_loop",
    "hypothesis_records",
    "length_penalty_factor",
    "options_loop",
    "output_limits",
    "plain_hypotheses",
    "prefixed_limits",
    "search_texts",
    "source_array",
    "teacher_inputs",
    "translate_texts",
]

EXTRA_OUTPUT_TOKENS = 50  # default maximum output length = source length + 50
# `beam_loop(drop_finished=True)` shrinks the decoder state once more than this
# fraction of its sentences are finished: each shrink copies every cache, so
# shrinking at every finished sentence cost more than the rows it saved
# (benchmarks.onnx_vs_ctranslate2, beam 4 at batch 32).
DROP_FRACTION = 0.25


def check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")


def check_beam_arguments(beam_size, length_penalty):
    check_positive_int("beam_size", beam_size)
    if (
        isinstance(length_penalty, bool)
        or not isinstance(length_penalty, (int, float))
        or length_penalty < 0
    ):
        raise ValueError(
            f"length_penalty must be a non-negative number. Received: {length_penalty!r}"
        )


def source_array(source_ids, model_max_length, multiple=8):
    """Pads token-id lists (or checks an array) into an int32 `(batch, width)` array.

    The width is a multiple of `multiple`: 8 (the default) so that a new
    source length rarely means a new compiled shape for a compiled decoder;
    1 for a runtime that takes any shape at no cost, so that no padding
    column is computed. Returns `(array, lengths)`. Nothing is truncated: a
    source longer than `model_max_length` (the positions the model trained
    on) is taken whole, its later positions computed rather than read from
    the table.
    """
    if isinstance(source_ids, np.ndarray):
        if source_ids.ndim != 2:
            raise ValueError(
                "source_ids must have shape (batch_size, source_len). "
                f"Received shape {source_ids.shape}"
            )
        if not np.issubdtype(source_ids.dtype, np.integer):
            raise ValueError(
                f"source_ids must hold integer token ids. Received dtype {source_ids.dtype}"
            )
        rows = [row[row != PAD_ID] for row in source_ids]
    else:
        if not isinstance(source_ids, Sequence) or isinstance(source_ids, (str, bytes)):
            raise ValueError("source_ids must be a 2-D int array or a list of lists of token ids.")
        rows = [np.asarray(list(row), np.int64) for row in source_ids]
        for row in rows:
            if row.size and not np.issubdtype(row.dtype, np.integer):
                raise ValueError("source_ids must hold integer token ids.")
    lengths = np.array([len(row) for row in rows], np.int64)
    longest = int(lengths.max(initial=0))
    width = max(multiple, -(-longest // multiple) * multiple)
    if 0 < longest <= model_max_length:
        width = min(width, model_max_length)
    array = np.zeros((len(rows), max(width, 1)), np.int32)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return array, lengths


def output_limits(lengths, max_length, model_max_length):
    """Per-sentence maximum number of generated tokens (EOS included); 0 for empty sources.

    Given `max_length`, that for every sentence. Otherwise the source length
    plus `EXTRA_OUTPUT_TOKENS`, at most `model_max_length` or twice the
    source length, whichever is larger: a source longer than the model's
    training positions may get an output as long.
    """
    if max_length is not None:
        check_positive_int("max_length", max_length)
        limits = np.full(len(lengths), max_length, np.int64)
    else:
        lengths = np.asarray(lengths, np.int64)
        cap = np.maximum(model_max_length, 2 * lengths)
        limits = np.minimum(lengths + EXTRA_OUTPUT_TOKENS, cap)
    return np.where(np.asarray(lengths) == 0, 0, limits)


def greedy_loop(step, limits, ignore_eos=False):
    """Greedy search over a step function, by the rules of `spec.greedy`.

    Args:
        step: `step(inputs, t) -> log_probs`, where `inputs` is the int32
            `(batch, t + 1)` decoder input so far (BOS first; a finished
            sentence is fed EOS) and `log_probs` is `(batch, vocab)`; or
            `-> (top_log_probs, top_ids)`, each `(batch, 1)`: the best token
            of each row other than `banned_ids()` (not with `ignore_eos`).
        limits: per-sentence maximum output length (EOS included); 0 = empty.
        ignore_eos: never stop at EOS (for benchmarks).

    Returns:
        `(tokens, scores)`: int lists cut before EOS, and float64 summed
        log-probabilities (EOS included when produced).
    """
    limits = np.asarray(limits)
    batch = len(limits)
    steps = int(limits.max(initial=0))
    rows = np.arange(batch)
    tokens = np.zeros((batch, steps), np.int32)
    lengths = np.zeros(batch, np.int64)
    scores = np.zeros(batch, np.float64)
    done = limits == 0
    inputs = np.full((batch, 1), BOS_ID, np.int32)
    banned = banned_ids(ignore_eos)
    for t in range(steps):
        if done.all():
            break
        out = step(inputs, t)
        if isinstance(out, tuple):  # the step chose already
            if ignore_eos:
                raise ValueError("ignore_eos needs a step that returns the whole log_probs")
            chosen, next_ids = out[0][:, 0], np.asarray(out[1][:, 0], np.int32)
        else:
            log_probs = np.asarray(out)
            masked = log_probs.copy()
            masked[:, banned] = -np.inf
            next_ids = masked.argmax(-1).astype(np.int32)
            chosen = log_probs[rows, next_ids]
        live = ~done
        scores[live] += chosen[live].astype(np.float64)
        ended = next_ids == EOS_ID
        grows = live & ~ended
        tokens[grows, t] = next_ids[grows]
        lengths[grows] += 1
        done = done | ended | (t + 1 >= limits)
        inputs = np.concatenate([inputs, np.where(done, EOS_ID, next_ids)[:, None]], axis=1)
    return [tokens[i, : lengths[i]].tolist() for i in range(batch)], scores


def beam_loop(
    step,
    reorder,
    limits,
    beam_size,
    length_penalty=0.6,
    ignore_eos=False,
    drop_finished=False,
    shared_first_step=False,
):
    """Beam search over a step function; row `p * beam_size + j` is beam j of sentence p.

    The rules are those of `keras_transformer_runtime.spec.beam`, applied to
    every sentence of the batch at once.

    Args:
        step: `step(last, t) -> log_probs`: `last` is the int32 newest token
            of every row of the decoder state, `(sentences * beam_size,)`;
            the result is `(sentences * beam_size, vocab)`. Or `-> (top_log_probs,
            top_ids)`, each `(sentences * beam_size, w)`, w >= min(2 * beam_size,
            vocab): each row's w best tokens other than `banned_ids()`, best
            first (not with `ignore_eos`).
        reorder: `reorder(rows)`, called before every step after the first:
            row i of the decoder state must become row `rows[i]` of the
            previous state (the beams that survived).
        limits: per-sentence maximum output length (EOS included); 0 = empty.
        beam_size: beams kept per sentence.
        length_penalty: alpha of the length penalty; 0 disables it.
        ignore_eos: never finish at EOS (for benchmarks).
        drop_finished: leave finished sentences out of the decoder state
            (once more than `DROP_FRACTION` of them are): `rows` then covers
            only the sentences still searched (in input order), so the
            state, and each step's batch, shrinks. For decoders whose step
            takes any batch size; the results are the same either way.
        shared_first_step: the beams of a sentence all start from BOS, so
            the first step runs one row per sentence (`last` is
            `(sentences,)`) and the first `reorder` gives every beam its
            sentence's row (`rows[p * beam_size + j] = p`): the first step
            costs one row per sentence instead of `beam_size`. For decoders
            whose step takes any batch size; the results are the same.

    Returns:
        `(tokens, scores)`: the best hypothesis of each sentence (int list cut
        before EOS) and its length-penalized score (float64).
    """
    check_beam_arguments(beam_size, length_penalty)
    limits = np.asarray(limits)
    batch, k = len(limits), beam_size
    best_tokens = [[] for _ in range(batch)]
    best_scores = np.zeros(batch, np.float64)
    done = limits == 0
    if done.all():
        return best_tokens, best_scores

    def penalty(length):
        return length_penalty_factor(length, length_penalty)

    alive = [[[] for _ in range(k)] for _ in range(batch)]  # tokens of live beams
    alive_scores = np.full((batch, k), -np.inf)
    alive_scores[:, 0] = 0.0  # one live beam at the start
    finished = [[] for _ in range(batch)]  # (normalized score, tokens)
    active = np.arange(batch)  # the sentences the decoder state holds, in state order
    last = np.full(batch * k, BOS_ID, np.int32)
    banned = banned_ids(ignore_eos)

    for t in range(int(limits.max())):
        # A sentence's 2k best candidates are among the 2k best tokens of each
        # of its beams: select per row first (or take the step's selection),
        # then rank only those.
        shared = shared_first_step and t == 0  # the state holds one row per sentence
        n = 1 if shared else k  # rows of each sentence in the state
        out = step(last[::k] if shared else last, t)
        if isinstance(out, tuple):
            if ignore_eos:
                raise ValueError("ignore_eos needs a step that returns the whole log_probs")
            top_scores, top = np.asarray(out[0], np.float64), np.asarray(out[1], np.int64)
            vocab = int(top.max()) + 1  # any bound above the ids orders beam * vocab + token
        else:
            log_probs = np.array(out, dtype=np.float32)  # a copy: banned ids are set
            log_probs[:, banned] = -np.inf
            vocab = log_probs.shape[-1]
            width = min(2 * k, vocab)
            top = np.argpartition(-log_probs, width - 1, axis=1)[:, :width]  # (rows, width)
            top_scores = np.take_along_axis(log_probs, top, axis=1).astype(np.float64)
        count, width = len(active), top.shape[1]
        candidates = (
            alive_scores[active][:, :n, None] + top_scores.reshape(count, n, width)
        ).reshape(count, n * width)
        flat = (np.arange(n)[:, None] * vocab + top.reshape(count, n, width)).reshape(
            count, n * width
        )  # beam * vocab + token
        # Default: each row keeps its own state (its sentence's only row at a shared step).
        origin = np.zeros(count * k, np.int64) if shared else np.tile(np.arange(k), count)
        for p, b in enumerate(active):
            if done[b]:
                continue
            # The 2k best candidates, best first (ties: lower beam * vocab + token).
            ranked = np.lexsort((flat[p], -candidates[p]))[: 2 * k]
            new_alive, new_scores = [], []
            for rank, i in enumerate(ranked):
                score = candidates[p, i]
                if not np.isfinite(score):
                    break
                beam, token = divmod(int(flat[p, i]), vocab)
                if token == EOS_ID:
                    if rank < k:
                        finished[b].append((score / penalty(t + 1), alive[b][beam]))
                    continue
                new_alive.append((alive[b][beam] + [token], beam))
                new_scores.append(score)
                if len(new_alive) == k:
                    break
            if t + 1 >= limits[b]:  # out of room: live beams end here, without EOS
                for (tokens, _), score in zip(new_alive, new_scores, strict=True):
                    finished[b].append((score / penalty(t + 1), tokens))
                new_alive = []
            best_finished = max((s for s, _ in finished[b]), default=-np.inf)
            can_improve = bool(new_scores) and (
                max(new_scores) / penalty(limits[b]) > best_finished
            )
            settled = len(finished[b]) >= k and (
                not new_scores or max(new_scores) / penalty(t + 1) <= best_finished
            )
            if settled or not can_improve:
                done[b] = True
                score, tokens = max(finished[b], key=lambda item: item[0], default=(-np.inf, []))
                best_tokens[b], best_scores[b] = tokens, score
                continue
            alive_scores[b] = -np.inf
            for j, ((tokens, beam), score) in enumerate(zip(new_alive, new_scores, strict=True)):
                alive[b][j] = tokens
                alive_scores[b, j] = score
                origin[p * k + j] = beam
                last[p * k + j] = tokens[-1]
        if done.all():
            break
        rows = np.arange(count * k) // k * n + origin
        if drop_finished and done[active].sum() > DROP_FRACTION * count:
            keep = np.flatnonzero(~done[active])  # positions in the state
            rows = rows.reshape(count, k)[keep].reshape(-1)
            last = last.reshape(count, k)[keep].reshape(-1)
            active = active[keep]
        reorder(rows.astype(np.int32))
    return best_tokens, best_scores


def prefixed_limits(limits, prefixes, max_length):
    """The output limits with room for each prefix: without `max_length`, a
    sentence's default limit grows to its prefix plus one token; with it, a
    prefix that leaves no room is refused by `SentenceSearch`."""
    limits = np.array(limits, np.int64)
    if max_length is None and prefixes is not None:
        for i, prefix in enumerate(prefixes):
            if limits[i] and prefix:
                limits[i] = max(limits[i], len(prefix) + 1)
    return limits


def options_loop(
    step,
    reorder,
    limits,
    options,
    prefixes=None,
    indices=None,
    drop_finished=False,
    constraints=None,
):
    """The search of `keras_transformer_runtime.spec.SentenceSearch` for a batch of sentences.

    Each sentence's `SentenceSearch` decides (the rules are written once,
    there); this loop only runs the model for every live hypothesis of
    every sentence at once and keeps the decoder state in step. Row
    `p * options.beam_size + j` of the state is live hypothesis j of
    sentence p (rows of fewer live hypotheses repeat the sentence's first).

    Args:
        step: `step(last, t) -> log_probs`: `last` is the int32 newest token
            of every row, `(sentences * beam_size,)`; the result is
            `(sentences * beam_size, vocab)`.
        reorder: `reorder(rows)`, before every step after the first: row i
            of the state becomes row `rows[i]` of the previous state.
        limits: per-sentence maximum output length (EOS included); 0 = empty.
        options: a `SearchOptions`.
        prefixes: per-sentence target prefix ids, or None.
        indices: each sentence's index in its input, which seeds its
            sampling generator (`spec.sentence_rng`); default 0, 1, ...
        constraints: per-sentence terminology constraints (a
            `constraints.Constraints`, or a list of token-id phrases), or
            None: a sentence with phrases runs `constraints.ConstrainedSearch`.
        drop_finished: leave finished sentences out of the state (as
            `beam_loop` does; `rows` then covers only the sentences still
            searched, in input order), for decoders whose step takes any batch.

    Returns:
        per sentence, the list of its `spec.Hypothesis` (`options.n_best` of
        them at most), best first.
    """
    limits = np.asarray(limits)
    k = options.beam_size
    prefixes = prefixes if prefixes is not None else [()] * len(limits)
    indices = indices if indices is not None else range(len(limits))
    constraints = constraints if constraints is not None else [()] * len(limits)
    if len(constraints) != len(limits):
        raise ValueError(f"{len(constraints)} constraint lists for {len(limits)} sentences.")
    searches = [
        ConstrainedSearch(limit, options, phrases, prefix)
        if len(phrases)
        else SentenceSearch(
            limit, options, prefix, sentence_rng(options.seed, i) if options.sampling else None
        )
        for limit, prefix, i, phrases in zip(limits, prefixes, indices, constraints, strict=True)
    ]
    active = np.arange(len(searches))  # the sentences the state holds, in state order
    last = np.full(len(searches) * k, BOS_ID, np.int32)
    t = 0
    while not all(search.done for search in searches):
        log_probs = np.asarray(step(last, t))
        rows = np.repeat(np.arange(len(active)) * k, k)
        for p, b in enumerate(active):
            search = searches[b]
            if search.done:
                continue
            parents = search.advance(log_probs[p * k : p * k + len(search.live)])
            for j, parent in enumerate(parents):
                rows[p * k + j] = p * k + parent
                last[p * k + j] = search.live[j][0][-1]
        t += 1
        if all(search.done for search in searches):
            break
        if drop_finished:
            keep = np.flatnonzero([not searches[b].done for b in active])
            if len(keep) < len(active):
                rows = rows.reshape(len(active), k)[keep].reshape(-1)
                last = last.reshape(len(active), k)[keep].reshape(-1)
                active = active[keep]
        reorder(rows.astype(np.int32))
    return [search.results() for search in searches]


def search_texts(
    texts,
    encode,
    search,
    model_max_length,
    batch_size=32,
    progress=False,
    warn=None,
    parallel_batches=1,
    max_input_length=None,
):
    """Searches strings in batches with `search(sources, indices) -> results`, in order.

    Each text becomes `encode(text) + [EOS]` (an empty or whitespace-only
    text stays empty), cut to `max_input_length` tokens when given
    (`spec.truncate_source`); texts are sorted by length into batches, so
    padding stays small, and the results (one per text, whatever `search`
    returns for it) are put back in input order. `indices` are the texts'
    places in `texts`. A text longer than `model_max_length` (the positions
    the model trained on) is searched whole, and `warn(message)`, when
    given, hears of it (and of every truncated text) before the search
    and their count after it.

    `parallel_batches` > 1 searches that many batches at once, each on its
    own thread, so `search` must then be safe to call from several threads.
    """
    check_positive_int("batch_size", batch_size)
    check_positive_int("parallel_batches", parallel_batches)
    sources = []
    truncated = []
    for i, text in enumerate(texts):
        ids = encode(text) if text.strip() else []
        ids = ids + [EOS_ID] if ids else []
        if max_input_length is not None and len(ids) > max_input_length:
            truncated.append(i)
            if warn is not None:
                warn(
                    f"line {i + 1} has {len(ids)} tokens, more than max_input_length="
                    f"{max_input_length}; its first {max_input_length - 1} are translated"
                )
            ids = truncate_source(ids, max_input_length)
        sources.append(ids)
    too_long = [i for i, s in enumerate(sources) if len(s) > model_max_length]
    if warn is not None:
        for i in too_long:
            warn(
                f"line {i + 1} has {len(sources[i])} tokens, more than the model's "
                f"max_length={model_max_length}; translated whole, quality may suffer"
            )
    order = np.argsort([len(s) for s in sources], kind="stable")
    results = [None] * len(sources)
    bar = Progress(len(sources), progress)
    chunks = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]

    def finish(chunk, found):
        for i, result in zip(chunk, found, strict=True):
            results[i] = result
        bar.update(len(chunk))

    def run(chunk):
        return search([sources[i] for i in chunk], [int(i) for i in chunk])

    if parallel_batches == 1 or len(chunks) < 2:
        for chunk in chunks:
            finish(chunk, run(chunk))
    else:
        with ThreadPoolExecutor(max_workers=min(parallel_batches, len(chunks))) as pool:
            running = {pool.submit(run, chunk): chunk for chunk in chunks}
            for future in as_completed(running):
                finish(running[future], future.result())
    if warn is not None and too_long:
        warn(
            f"{len(too_long)} of {len(sources)} lines were longer than the model's "
            f"max_length={model_max_length} tokens and were translated whole"
        )
    if warn is not None and truncated:
        warn(
            f"{len(truncated)} of {len(sources)} lines were longer than "
            f"max_input_length={max_input_length} tokens and were truncated"
        )
    return results


def translate_texts(
    texts,
    encode,
    decode,
    search,
    model_max_length,
    batch_size=32,
    progress=False,
    warn=None,
    parallel_batches=1,
):
    """Translates strings in order with a batched `search(sources) -> token lists`.

    Each text becomes `encode(text) + [EOS]` (an empty or whitespace-only text
    stays empty and translates to ""); texts are sorted by length into
    batches, so padding stays small, and the outputs are put back in input
    order. Every text is translated: one longer than `model_max_length`
    tokens (the positions the model trained on) is translated whole, and
    `warn(message)`, when given, gets one line for each such text before
    the search and their count after it.

    `parallel_batches` > 1 searches that many batches at once, each on its
    own thread, so `search` must be safe to call from several threads. It
    pays where one search leaves cores idle: its Python steps run between
    the runtime's calls, and a small batch is split badly across threads.
    The outputs are the same either way.
    """
    outputs = search_texts(
        texts,
        encode,
        lambda sources, indices: search(sources),
        model_max_length,
        batch_size=batch_size,
        progress=progress,
        warn=warn,
        parallel_batches=parallel_batches,
    )
    return [decode(tokens) for tokens in outputs]


def encode_prefixes(tokenizer, texts, max_length=None):
    """Target prefixes as ids (no EOS), one per text (None or "" for none).

    A prefix with a word the vocabulary lacks (it would read as UNK) is
    refused, naming the word: forcing UNK is never what was meant. So is,
    naming its line, a prefix that leaves no room under `max_length` (the
    most tokens generated, EOS included), before any batch is searched.
    """
    prefixes = []
    for n, text in enumerate(texts):
        ids = tokenizer.encode(text) if text and text.strip() else []
        if UNK_ID in ids:
            words = [w for w in text.split() if UNK_ID in tokenizer.encode(w)]
            raise ValueError(
                f"the target prefix of line {n + 1} ({text!r}) holds "
                f"{words[0] if words else 'a piece'!r}, which is not in the vocabulary."
            )
        if max_length is not None and ids and len(ids) >= max_length:
            raise ValueError(
                f"the target prefix of line {n + 1} ({text!r}) is {len(ids)} tokens: it "
                f"leaves no room under max_length={max_length} (EOS included); raise "
                "max_length or shorten the prefix."
            )
        prefixes.append(ids)
    return prefixes


def plain_hypotheses(tokens, scores, limits, options):
    """The fast searches' `(tokens, scores)` as `spec.Hypothesis` lists (one each).

    A beam search's summed log-probability is its score times the length
    penalty of its length: EOS included when the output is shorter than its
    limit (an output that reached it ended without EOS).
    """
    found = []
    for row, score, limit in zip(tokens, scores, limits, strict=True):
        log_prob = float(score)
        if options.beam_size > 1 and limit:
            length = len(row) + (len(row) < limit)
            log_prob = float(score * length_penalty_factor(length, options.length_penalty))
        found.append([Hypothesis(list(row), float(score), log_prob)])
    return found


def add_alignments(found, sources, align):
    """Sets `alignment` on every hypothesis of `found` (per source, a list) with
    `align(source_ids, target_ids) -> per pair, source positions`, one call."""
    pairs = [
        (source, h) for source, hypotheses in zip(sources, found, strict=True) for h in hypotheses
    ]
    if pairs:
        for (_, h), positions in zip(
            pairs, align([s for s, _ in pairs], [h.tokens for _, h in pairs]), strict=True
        ):
            h.alignment = positions


def hypothesis_records(hypotheses, decode):
    """A sentence's hypotheses as JSON-ready dicts: text, score, log_prob (and
    token_scores, alignment: source positions, one per output token)."""
    records = []
    for h in hypotheses:
        record = {"text": decode(h.tokens), "score": h.score, "log_prob": h.log_prob}
        if h.token_scores is not None:
            record["token_scores"] = h.token_scores
        if h.alignment is not None:
            record["alignment"] = h.alignment
        records.append(record)
    return records


def forced_scores(log_probs, targets):
    """Per sentence `(log_prob, token_scores)`: the scores of `targets` (+ EOS) in
    teacher-forced `log_probs (batch, width, vocab)`, read in float64."""
    found = []
    for row, target in zip(log_probs, targets, strict=True):
        labels = [*target, EOS_ID]
        steps = [float(row[i, token]) for i, token in enumerate(labels)]
        found.append((float(np.sum(steps)), steps))
    return found


def teacher_inputs(targets):
    """`(BOS + target)` rows padded into an int32 array, for `forced_scores`."""
    width = max(len(t) for t in targets) + 1
    array = np.zeros((len(targets), width), np.int32)
    for i, target in enumerate(targets):
        array[i, : len(target) + 1] = [BOS_ID, *target]
    return array
