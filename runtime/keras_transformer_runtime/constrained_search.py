"""Constrained beam search: terminology constraints as one more per-hypothesis state.

The search is the beam search of `spec.SentenceSearch` with the phrases of
`constraints.Constraints` (Post and Vilar 2018, "Fast Lexically Constrained
Decoding with Dynamic Beam Allocation"; Hu et al. 2019, "Improved Lexically
Constrained Decoding"): `ConstrainedSearch` per sentence. `ConstrainedBatch`
steps the constrained sentences of a batch together, with numpy over all
their hypotheses; `search.search_loop` runs it for both decoders (Keras and
ONNX Runtime), and `constrained_beam` runs one sentence (the reference of
the tests). The rules:

- Progress. A hypothesis tracks, for every phrase, how many of its tokens
  the end of the output matches (as a string search does: a mismatch falls
  back to the longest matching shorter prefix, so an output may restart a
  phrase). A phrase matched to its end is met, and stays met. The
  hypothesis's *met tokens* are the lengths of its met phrases plus the
  longest partial match of the others.
- Candidates. Each live hypothesis ranks its next token by
  `spec.step_scores` (so a prefix, masks and penalties apply as without
  constraints) and is extended by its `2 * beam_size` best tokens and by
  every token that advances one of its unmet phrases (the next token of
  each), unless those rules forbid it. EOS is a candidate only for a
  hypothesis that has met every phrase. Right after a token that ends a
  phrase, no token that continues a word (`word_continuations`) is a
  candidate: a phrase stands as whole words.
- Dynamic beam allocation. The candidates are grouped in banks by their
  met tokens (an EOS candidate: its hypothesis's), each bank ranked by
  summed log-probability (ties: the earlier beam, then the lower id), and
  put in stripe order: the best of each bank from the most met tokens
  down, then the second best of each, and so on. A bank with fewer
  candidates leaves its places to the others. So a phrase never needs the
  whole beam, and the hypothesis that has met the most is always kept.
- Finishing. In stripe order, an EOS among the first `beam_size`
  candidates finishes its hypothesis, scored as plain beam search scores it
  (summed log-probability divided by the length penalty); the first
  `beam_size` others live on. With one bank (no phrases) the stripe order
  is the score order, and these are plain beam search's rules.
- Stopping, as `spec.SentenceSearch`: at the limit the live hypotheses
  finish as they are; a sentence stops early when no live hypothesis can
  beat the `n_best`-th best finished one, or when `beam_size` have
  finished and none beats it at its current length.
- The winner (the fallback rule): the finished hypothesis with the most met
  tokens, then the best score (the first found of equal ones); the n best
  are ranked the same way. Whenever the
  phrases fit in the limit (their tokens together at most `limit - 1`, room
  left for EOS), the hypothesis with the most met tokens gains one at every
  step and is never dropped, so the winner has met every phrase; the
  searches refuse phrases that do not fit (`check_fits`). With no phrases,
  the rules are those of plain beam search (`spec.beam`), result for result.

Needs numpy only.
"""

from __future__ import annotations

import numpy as np

from keras_transformer_runtime.constraints import Constraints, PhraseTable, check_fits
from keras_transformer_runtime.options import SearchOptions
from keras_transformer_runtime.spec import SentenceSearch, banned_ids, step_scores
from keras_transformer_runtime.specials import EOS_ID

__all__ = ["ConstrainedBatch", "ConstrainedSearch", "constrained_beam", "top_tokens"]


def top_tokens(scores, width):
    """Each row's `width` best tokens, best first (ties: the lower id): `(ids, scores)`."""
    width = min(width, scores.shape[-1])
    part = np.argpartition(-scores, width - 1, axis=-1)[..., :width]
    values = np.take_along_axis(scores, part, axis=-1)
    # Of tokens tied with the last one taken, the lower ids: argpartition may take any.
    bar = values.min(-1, keepdims=True)
    if (np.sum(scores >= bar, -1) > width).any():
        ids = np.broadcast_to(np.arange(scores.shape[-1]), scores.shape)
        order = np.lexsort((ids, -scores), axis=-1)[..., :width]
        return order, np.take_along_axis(scores, order, axis=-1)
    order = np.lexsort((part, -values), axis=-1)
    return np.take_along_axis(part, order, axis=-1), np.take_along_axis(values, order, axis=-1)


class ConstrainedSearch(SentenceSearch):
    """`spec.SentenceSearch` with terminology constraints: the rules of this module.

    Every other option applies as in `SentenceSearch`: each hypothesis ranks
    its next token by `spec.step_scores` (a prefix is forced first, masks
    and penalties apply), and a phrase token that those rules forbid is no
    candidate. A beam of one follows the same rules as a wider beam (its
    score is length-penalized). Sampling is refused: a constraint needs a
    search. `results()` ranks by met tokens, then score (the fallback
    rule), and returns `options.n_best`.

    A search is stepped by the `ConstrainedBatch` it joined; `advance` steps
    it alone (in a batch of its own, made at its first step, if none took it).

    Args:
        limit: the most tokens generated, EOS included; 0 for an empty source.
        options: a `options.SearchOptions`.
        constraints: a `Constraints` (or a list of token-id phrases).
        prefix: target prefix ids, forced first.
    """

    def __init__(self, limit, options, constraints, prefix=()):
        if options.sampling:
            raise ValueError(
                "constraints need a search, not sampling: set sampling_topk to 1. "
                f"Received: sampling_topk={options.sampling_topk}"
            )
        super().__init__(limit, options, prefix)
        if not isinstance(constraints, Constraints):
            constraints = Constraints(constraints)
        self.constraints = constraints
        if self.limit:
            check_fits(constraints, self.limit - len(self.prefix))
        self.met = []  # the met tokens of each finished hypothesis
        self.batch = None  # the ConstrainedBatch that steps it (`join`)

    def join(self, batch, index, width):
        """Becomes sentence `index` of `batch`, whose progress rows are `width` wide:
        per live hypothesis its progress, and whether its last token met a phrase."""
        self.batch, self.index = batch, index
        self.progress = np.zeros((len(self.live), width), np.int64)
        self.ended_phrase = np.zeros(len(self.live), bool)

    def _finish(self, t, tokens, total, steps, met):
        self.finished.append((total / self._penalty(t + 1), tokens, total, steps))
        self.met.append(met)

    def settle(self, finished, grown, progress, ended_phrase):
        """Ends a step chosen by `ConstrainedBatch.advance`: `finished` candidates
        `(beam, summed score, step score, met tokens)` finish (EOS), in stripe
        order; `grown` ones `(beam, token, summed score, step score, met tokens)`,
        in score order, live on with their `progress` and `ended_phrase` rows.
        Returns the parents of the new live hypotheses."""
        t = self.step
        self.step += 1
        for beam, total, step, met in finished:
            tokens, _, steps = self.live[beam]
            self._finish(t, tokens, total, steps + [step], met)
        live = [
            (self.live[beam][0] + [token], total, self.live[beam][2] + [step])
            for beam, token, total, step, _ in grown
        ]
        if t + 1 >= self.limit:  # out of room: live hypotheses end here, without EOS
            for (tokens, total, steps), (*_, met) in zip(live, grown, strict=True):
                self._finish(t, tokens, total, steps, met)
            live = []
        if self._ends(live, t):
            self.done, self.live = True, []
            self.progress, self.ended_phrase = progress[:0], ended_phrase[:0]
            return []
        self.live, self.progress, self.ended_phrase = live, progress, ended_phrase
        return [beam for beam, *_ in grown]

    def advance(self, rows, top=None):
        """One step of this search alone: `rows[j]` are the log-probabilities after
        `live[j]`, `top` optionally the decoder's selection (as for
        `SentenceSearch.advance`); returns the index of the live hypothesis
        each new one extends."""
        if self.batch is None:
            ConstrainedBatch([self])
        return self.batch.advance([self.index], np.asarray(rows), [0], top)[0]

    def results(self):
        """The `n_best` finished hypotheses with the most met tokens, then the best
        scores (the first found of equal ones), best first."""
        if not self.limit or not self.finished:
            return super().results()
        order = sorted(
            range(len(self.finished)), key=lambda i: (-self.met[i], -self.finished[i][0])
        )
        return self._hypotheses([self.finished[i] for i in order[: self.options.n_best]])


def _group_starts(*keys):
    """For rows sorted by `keys` (arrays of one length), the index of the first
    row of each row's run of equal keys."""
    change = np.zeros(len(keys[0]), bool)
    change[:1] = True
    for key in keys:
        change[1:] |= key[1:] != key[:-1]
    return np.maximum.accumulate(np.where(change, np.arange(len(change)), 0))


class ConstrainedBatch:
    """The constrained searches of a batch, stepped together: one numpy pass over
    all their hypotheses per step, by the rules of this module.

    Args:
        searches: `ConstrainedSearch`es, fresh (no step taken); each joins
            this batch.
    """

    def __init__(self, searches):
        self.searches = list(searches)
        self.table = PhraseTable([s.constraints for s in self.searches])
        for i, search in enumerate(self.searches):
            search.join(self, i, self.table.width)

    def advance(self, members, log_probs, starts, top=None):
        """One step of the searches `members` (indices, none done): the live rows of
        member m are `log_probs[starts[m] : starts[m] + len(live)]`, and of
        `top = (values, ids)`, the decoder's selection (or None). Returns each
        member's parents: for each new live hypothesis, the one it extends."""
        searches = [self.searches[i] for i in members]
        counts = np.array([len(s.live) for s in searches])
        k = searches[0].options.beam_size
        offsets = np.cumsum(counts) - counts  # each member's first row
        member = np.repeat(np.arange(len(searches)), counts)  # per row
        local = np.arange(len(member)) - np.repeat(offsets, counts)
        rows = np.repeat(np.asarray(starts), counts) + local  # in log_probs
        sentence = np.asarray(members)[member]
        progress = np.concatenate([s.progress for s in searches])
        ended = np.concatenate([s.ended_phrase for s in searches])
        vocabulary = log_probs.shape[-1]

        ids, rescored = self._selected(
            searches, log_probs, rows, top, k, offsets, ended, member, sentence
        )
        # The phrases' next tokens not already selected; EOS only once all are met.
        nexts = self.table.next(sentence, progress)
        ids = np.where((ids == EOS_ID) & (nexts >= 0).any(1, keepdims=True), -1, ids)
        seen = (nexts[:, :, None] == ids[:, None, :]).any(-1)
        seen |= np.tril(nexts[:, :, None] == nexts[:, None, :], -1).any(-1)
        tokens = np.concatenate([ids, np.where(seen, -1, nexts)], axis=1)
        values = log_probs[rows[:, None], np.maximum(tokens, 0)].astype(np.float64)
        for m, scored in rescored.items():  # scores after the options' rules
            at = slice(offsets[m], offsets[m] + len(scored))
            values[at] = np.take_along_axis(scored, np.maximum(tokens[at], 0), axis=1)
        if ended.any():  # a phrase stands as whole words
            values[ended[:, None] & self.table.continue_words(sentence, tokens)] = -np.inf

        # The candidates, flat.
        valid = (tokens >= 0) & np.isfinite(values)
        row, place = np.nonzero(valid)
        token = tokens[row, place]
        step = values[row, place]
        totals = np.array([total for s in searches for _, total, _ in s.live])[row] + step
        owner = member[row]
        keys = local[row] * vocabulary + token
        after = self.table.advance(sentence[row], progress[row], token[:, None])[:, 0]
        eos = token == EOS_ID
        after[eos] = progress[row[eos]]
        banks = self.table.met(sentence[row], after)
        # Within a bank, by summed score (ties: the lower key); a candidate's
        # stripe is its rank in its bank. The stripes in order, each from the
        # most met tokens down; with one bank, the score order.
        order = np.lexsort((keys, -totals, -banks, owner))
        stripe = np.empty(len(order), np.int64)
        stripe[order] = np.arange(len(order)) - _group_starts(owner[order], banks[order])
        striped = np.lexsort((-banks, stripe, owner))
        position = np.arange(len(striped)) - _group_starts(owner[striped])
        eos_at = eos[striped]
        finishing = striped[eos_at & (position < k)]
        others = striped[~eos_at]
        growing = others[np.arange(len(others)) - _group_starts(owner[others]) < k]
        growing = growing[np.lexsort((keys[growing], -totals[growing], owner[growing]))]
        met_phrase = self.table.ends_phrase(
            sentence[row[growing]], progress[row[growing]], after[growing]
        )

        # Per search: its finished and new live hypotheses, in that order.
        new_progress = after[growing]
        finishing_at = np.searchsorted(owner[finishing], np.arange(len(searches) + 1)).tolist()
        growing_at = np.searchsorted(owner[growing], np.arange(len(searches) + 1)).tolist()
        f_beam, f_total, f_step, f_bank = (
            a[finishing].tolist() for a in (local[row], totals, step, banks)
        )
        g_beam, g_token, g_total, g_step, g_bank = (
            a[growing].tolist() for a in (local[row], token, totals, step, banks)
        )
        parents = []
        for m, search in enumerate(searches):
            finished = [
                (f_beam[c], f_total[c], f_step[c], f_bank[c])
                for c in range(finishing_at[m], finishing_at[m + 1])
            ]
            at = slice(growing_at[m], growing_at[m + 1])
            grown = list(
                zip(g_beam[at], g_token[at], g_total[at], g_step[at], g_bank[at], strict=True)
            )
            parents.append(search.settle(finished, grown, new_progress[at], met_phrase[at]))
        return parents

    def _selected(self, searches, log_probs, rows, top, k, offsets, ended, member, sentence):
        """Each row's `2 * k` best tokens `(rows, 2k)` (-1: none), after the bans,
        and `{member: scored rows}` for the members whose options rescore the step
        (their candidates take those scores)."""
        rescored = {}
        if top is not None:
            selected = np.asarray(top[1])[rows]
            ids = selected[:, : 2 * k].copy()
        else:
            ids = np.full((len(rows), 2 * k), -1, np.int64)
        for m, search in enumerate(searches):
            if top is not None and not search.rescored():
                continue
            at = slice(offsets[m], offsets[m] + len(search.live))
            scored = np.stack(
                [
                    step_scores(log_probs[r], tokens, search.options, search.prefix)
                    for r, (tokens, _, _) in zip(rows[at], search.live, strict=True)
                ]
            )
            if search.ended_phrase.any():
                rules = search.constraints
                scored[np.ix_(np.flatnonzero(search.ended_phrase), rules.continuations)] = -np.inf
            found = top_tokens(scored, 2 * k)[0]
            ids[at] = -1
            ids[at, : found.shape[1]] = found
            rescored[m] = scored
        # Rows after a met phrase, that read the selection: its best tokens that
        # continue no word, from the wider selection when it holds enough of
        # them (or every allowed token), else from the whole row.
        if top is not None and ended.any():
            at = np.flatnonzero(ended & ~np.isin(member, list(rescored)) if rescored else ended)
            words = ~self.table.continue_words(sentence[at], selected[at])
            # The first 2k words of each row, in selection order, then -1.
            taken = words & (np.cumsum(words, axis=1) <= 2 * k)
            order = np.argsort(~taken, axis=1, kind="stable")[:, : 2 * k]
            chosen = np.take_along_axis(selected[at], order, axis=1)
            ids[at] = np.where(np.take_along_axis(taken, order, axis=1), chosen, -1)
            whole = selected.shape[1] >= log_probs.shape[-1] - len(banned_ids())
            for r in at[(taken.sum(1) < 2 * k) & (not whole)]:
                row = np.array(log_probs[rows[r]], np.float64)
                row[banned_ids()] = -np.inf
                row[searches[member[r]].constraints.continuations] = -np.inf
                found = top_tokens(row[None], 2 * k)[0][0]
                found = found[np.isfinite(row[found])]
                ids[r] = -1
                ids[r, : len(found)] = found
        return ids, rescored


def constrained_beam(log_probs, limit, beam_size, constraints, length_penalty=0.6):
    """Constrained beam search for one sentence: `(tokens, length-penalized score)`.

    The reference the batched searches are tested against, shaped as
    `spec.beam`: the model is queried one hypothesis at a time.
    """
    options = SearchOptions(beam_size=beam_size, length_penalty=length_penalty)
    best = ConstrainedSearch(limit, options, constraints).run(log_probs)[0]
    return best.tokens, best.score
