"""The one batched search loop over a decoder step, and the records of its hypotheses.

A decoder (`keras_transformer_runtime.decoder`) hands `search_loop` a
`step` that returns the next-token log-probabilities of every row of its
state and a `reorder` that keeps the state in step with the hypotheses; the
rules of the search are those of `spec.SentenceSearch`, one per sentence,
and the tests check them against the plain one-sentence `spec.greedy` and
`spec.beam`. Graph-resident searches (the ONNX search graphs, the Keras
compiled greedy loop) follow the same rules for plain options.

Needs numpy only. Returned token ids exclude BOS and stop before EOS; an
empty source gives an empty output with score 0.
"""

from __future__ import annotations

import numpy as np

from keras_transformer_runtime.constrained_search import ConstrainedBatch, ConstrainedSearch
from keras_transformer_runtime.spec import (
    Hypothesis,
    SentenceSearch,
    alignments,
    length_penalty_factor,
    sentence_rng,
)
from keras_transformer_runtime.specials import BOS_ID

# `search_loop(drop_finished=True)` shrinks the decoder state once more than
# this fraction of its sentences are finished: each shrink copies every
# cache, so shrinking at every finished sentence cost more than the rows it
# saved (beam 4 at batch 32, docs/performance.md).
DROP_FRACTION = 0.25

# With `selects`, the loop asks each step for this many times `beam_size` best
# tokens per row: a search reads the first `2 * beam_size`, and a constrained
# hypothesis that just ended a phrase, barred from word-continuing pieces,
# finds its `2 * beam_size` others among them in over 91% of cases (Multi30k test,
# beam 5); 8 x beam slowed the step more than it saved (docs/performance.md).
SELECTED_PER_BEAM = 4


def search_loop(
    step,
    reorder,
    limits,
    options,
    prefixes=None,
    indices=None,
    drop_finished=False,
    constraints=None,
    selects=False,
):
    """The one search loop: `spec.SentenceSearch` for a batch of sentences.

    Greedy, beam, sampling and constrained search, every decoding option and
    both decoders (Keras and ONNX Runtime) go through this loop whenever a
    graph-resident search does not run them. Each sentence's
    `SentenceSearch` (or `constrained_search.ConstrainedSearch`, stepped
    with the batch's others by one `ConstrainedBatch`) decides: the rules
    are written once, there. This loop only runs the model for every live hypothesis of
    every sentence at once and keeps the decoder state in step. Row
    `p * options.beam_size + j` of the state is live hypothesis j of
    sentence p (the rows of a sentence with fewer live hypotheses, or done,
    keep their own state: they are stepped, never read, and cost no copy).

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
            None: a sentence with phrases runs `constrained_search.ConstrainedSearch`.
        drop_finished: leave finished sentences out of the state once more
            than `DROP_FRACTION` of them are (`rows` then covers only the
            sentences still searched, in input order), for decoders whose
            step takes any batch; the results are the same either way.
        selects: whether `step` takes `top_k` (`decoder.DecoderState.selects`):
            each step then also gives every row's best tokens
            (`SELECTED_PER_BEAM`), which the searches read in place of their own selection
            at the steps no option rescores (the same results, less numpy).

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
    constrained = [s for s in searches if isinstance(s, ConstrainedSearch)]
    batch = ConstrainedBatch(constrained) if constrained else None
    active = np.arange(len(searches))  # the sentences the state holds, in state order
    last = np.full(len(searches) * k, BOS_ID, np.int32)
    t = 0
    while not all(search.done for search in searches):
        if selects:
            log_probs, (top_values, top_ids) = step(last, t, top_k=SELECTED_PER_BEAM * k)
        else:
            log_probs, top_values = np.asarray(step(last, t)), None
        rows = np.arange(len(active) * k)
        stepped = {}  # state position -> parents
        members, starts = [], []
        for p, b in enumerate(active):
            search = searches[b]
            if search.done:
                continue
            if isinstance(search, ConstrainedSearch):  # stepped together, below
                members.append(search.index)
                starts.append(p * k)
                continue
            at = slice(p * k, p * k + len(search.live))
            top = None if top_values is None else (top_values[at], top_ids[at])
            stepped[p] = search.advance(log_probs[at], top)
        if members:
            top = None if top_values is None else (top_values, top_ids)
            found = batch.advance(members, log_probs, starts, top)
            stepped.update(zip((start // k for start in starts), found, strict=True))
        for p, parents in stepped.items():
            live = searches[active[p]].live
            for j, parent in enumerate(parents):
                rows[p * k + j] = p * k + parent
                last[p * k + j] = live[j][0][-1]
        t += 1
        if all(search.done for search in searches):
            break
        if drop_finished:
            keep = np.flatnonzero([not searches[b].done for b in active])
            if len(active) - len(keep) > DROP_FRACTION * len(active):
                rows = rows.reshape(len(active), k)[keep].reshape(-1)
                last = last.reshape(len(active), k)[keep].reshape(-1)
                active = active[keep]
        reorder(rows.astype(np.int32))
    return [search.results() for search in searches]


def plain_hypotheses(tokens, scores, token_scores, limits, options):
    """The fast searches' results (per sentence, lists of its hypotheses' tokens,
    scores and step scores, best first) as `spec.Hypothesis` lists, with their
    `token_scores` where `options.token_scores` asks for them.

    A beam search's summed log-probability is its score times the length
    penalty of its length: EOS included when the output is shorter than its
    limit (an output that reached it ended without EOS).
    """
    found = []
    for rows, row_scores, row_steps, limit in zip(
        tokens, scores, token_scores, limits, strict=True
    ):
        hypotheses = []
        for row, score, steps in zip(rows, row_scores, row_steps, strict=True):
            log_prob = float(score)
            if options.beam_size > 1 and limit:
                length = len(row) + (len(row) < limit)
                factor = length_penalty_factor(
                    length, options.length_penalty, options.length_penalty_form
                )
                log_prob = float(score * factor)
            steps = list(steps) if options.token_scores else None
            hypotheses.append(Hypothesis(list(row), float(score), log_prob, steps))
        found.append(hypotheses)
    return found


def add_alignments(found, sources, align, weights=None):
    """Sets `alignment` on every hypothesis of `found` (per source, a list): from its
    alignment weights in `weights` (per source, per hypothesis: `(steps,
    source_len)` rows from the search, or None), else with `align(source_ids,
    target_ids) -> per pair, source positions`, one call for all the others."""
    pairs = []
    for i, (source, hypotheses) in enumerate(zip(sources, found, strict=True)):
        for j, h in enumerate(hypotheses):
            rows = None if weights is None else weights[i][j]
            if rows is None:
                pairs.append((source, h))
            else:  # as `spec.alignments` reads the teacher-forced weights
                h.alignment = alignments([rows], [len(source)], [len(h.tokens)])[0]
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
