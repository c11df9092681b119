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
    graph-resident search does not run them: a `SearchLoop` over all the
    sentences from the start. The server's continuous batching runs the same
    `SearchLoop`, admitting sentences between steps.

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
    prefixes = prefixes if prefixes is not None else [()] * len(limits)
    indices = indices if indices is not None else range(len(limits))
    constraints = constraints if constraints is not None else [()] * len(limits)
    if len(constraints) != len(limits):
        raise ValueError(f"{len(constraints)} constraint lists for {len(limits)} sentences.")
    searches = sentence_searches(limits, options, prefixes, indices, constraints)
    loop = SearchLoop(step, reorder, options, searches, drop_finished, selects)
    while loop.live:
        loop.step()
    return [search.results() for search in searches]


def sentence_searches(limits, options, prefixes, indices, constraints):
    """Each sentence's search: a `ConstrainedSearch` where it has phrases (the
    constrained ones of the call stepped together by one `ConstrainedBatch`),
    else a `SentenceSearch`."""
    searches = [
        ConstrainedSearch(limit, options, phrases, prefix)
        if len(phrases)
        else SentenceSearch(
            limit, options, prefix, sentence_rng(options.seed, i) if options.sampling else None
        )
        for limit, prefix, i, phrases in zip(limits, prefixes, indices, constraints, strict=True)
    ]
    constrained = [s for s in searches if isinstance(s, ConstrainedSearch)]
    if constrained:
        ConstrainedBatch(constrained)
    return searches


class SearchLoop:
    """The searches of a batch stepped together over one decoder state.

    Row `p * options.beam_size + j` of the state is live hypothesis j of the
    sentence at position p (the rows of a sentence with fewer live
    hypotheses, or done, keep their own state: they are stepped, never
    read, and cost no copy). Each sentence's search decides (the rules are
    written once, there); the loop only runs the model for every live
    hypothesis at once and keeps the state in step.

    Args:
        step, reorder, options, drop_finished, selects: as for `search_loop`.
        searches: the searches the state holds from its start, in state order
            (`sentence_searches`).

    `admit` places more searches between steps (continuous batching) where the
    state takes new sentences (`admit_state`).
    """

    def __init__(self, step, reorder, options, searches, drop_finished=False, selects=False):
        self._step, self._reorder = step, reorder
        self.options, self.k = options, options.beam_size
        self.drop_finished, self.selects = drop_finished, selects
        self.searches = list(searches)  # per state position
        self.last = np.full(len(self.searches) * self.k, BOS_ID, np.int32)
        self.t = 0
        self._rows = None  # the reorder of the last step, not yet applied

    @property
    def live(self):
        """The searches still running."""
        return sum(not search.done for search in self.searches)

    def step(self):
        """One decoder step of every live hypothesis; returns `(position, search)` for
        the searches that ended."""
        self._settle(0)
        k = self.k
        if self.selects:
            log_probs, (top_values, top_ids) = self._step(
                self.last, self.t, top_k=SELECTED_PER_BEAM * k
            )
        else:
            log_probs, top_values = np.asarray(self._step(self.last, self.t)), None
        rows = np.arange(len(self.searches) * k)
        stepped = {}  # state position -> parents
        together = {}  # constrained batch -> (members, starts, positions)
        for p, search in enumerate(self.searches):
            if search.done:
                continue
            if isinstance(search, ConstrainedSearch):  # stepped together, below
                members, starts, positions = together.setdefault(search.batch, ([], [], []))
                members.append(search.index)
                starts.append(p * k)
                positions.append(p)
                continue
            at = slice(p * k, p * k + len(search.live))
            top = None if top_values is None else (top_values[at], top_ids[at])
            stepped[p] = search.advance(log_probs[at], top)
        for batch, (members, starts, positions) in together.items():
            top = None if top_values is None else (top_values, top_ids)
            found = batch.advance(members, log_probs, starts, top)
            stepped.update(zip(positions, found, strict=True))
        ended = []
        for p, parents in stepped.items():
            search = self.searches[p]
            for j, parent in enumerate(parents):
                rows[p * k + j] = p * k + parent
                self.last[p * k + j] = search.live[j][0][-1]
            if search.done:
                ended.append((p, search))
        self.t += 1
        self._rows = rows
        return ended

    def _settle(self, refill):
        """Applies the last step's reorder, leaving out finished sentences (`drop_finished`)
        once more than `DROP_FRACTION` of the positions are, bar `refill` of them
        that new searches are about to take."""
        if self._rows is None:
            return
        rows, self._rows = self._rows, None
        k = self.k
        done = np.flatnonzero([search.done for search in self.searches])
        if self.drop_finished and len(done) - refill > DROP_FRACTION * len(self.searches):
            dropped = set(done[refill:].tolist()) if refill > 0 else set(done.tolist())
            keep = [p for p in range(len(self.searches)) if p not in dropped]
            rows = rows.reshape(len(self.searches), k)[keep].reshape(-1)
            self.last = self.last.reshape(len(self.searches), k)[keep].reshape(-1)
            self.searches = [self.searches[p] for p in keep]
        self._reorder(rows.astype(np.int32))

    def admit(self, searches, admit_state):
        """Places `searches` (fresh, none done) between steps: in the positions of
        finished sentences first, then after the others. `admit_state(positions)`
        readies the state's rows of those positions (their sentences' encoder
        outputs, an empty history). Returns the positions."""
        self._settle(len(searches))
        free = [p for p, search in enumerate(self.searches) if search.done][: len(searches)]
        positions = free + list(
            range(len(self.searches), len(self.searches) + len(searches) - len(free))
        )
        grown = len(positions) - len(free)
        self.searches += [None] * grown
        self.last = np.concatenate([self.last, np.empty(grown * self.k, np.int32)])
        for p, search in zip(positions, searches, strict=True):
            self.searches[p] = search
            self.last[p * self.k : (p + 1) * self.k] = BOS_ID
        admit_state(positions)
        return positions


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
