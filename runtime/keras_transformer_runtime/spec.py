"""The search specification: greedy and beam search for one sentence, written plainly,
and the decoding options (`SearchOptions`) with their per-step rules (`step_scores`).

Every search of this project follows these rules: the one batched loop
(`keras_transformer_runtime.search.search_loop`, over `SentenceSearch`) for
both decoders, the Keras compiled greedy loop and the ONNX search graphs
(`greedy_search`, `greedy_batch_search`, `beam_search`, `beam_batch_search`).
They are fast, batched, cached and hard to read; `greedy` and `beam` here
are slow and easy to read: the documented test oracle, against which the
tests check each of them (same tokens, scores within float32 round-off).

A search here sees the model only through `log_probs(prefix)`: the
next-token log-probabilities (a 1-D array over the vocabulary) after the
generated tokens `prefix` (BOS excluded). The rules:

- Padding and BOS are never generated (`banned_ids`).
- Greedy takes the best allowed token at every step. It stops after EOS or
  after `limit` tokens; the score is the summed log-probability of the
  generated tokens, EOS included when produced.
- Beam search keeps `beam_size` live hypotheses. At each step it ranks the
  candidates (every live hypothesis extended by every allowed token) by
  summed log-probability, ties broken by `beam * vocabulary + token` (the
  earlier beam, then the lower id). Of the `2 * beam_size` best, an EOS
  among the first `beam_size` finishes its hypothesis; the first
  `beam_size` others live on. A finished hypothesis scores its summed
  log-probability (EOS included) divided by `length_penalty_factor` of its
  length (EOS included). At the limit, the live hypotheses finish as they
  are. The search stops early when no live hypothesis can beat the best
  finished one, even with the penalty of the maximum length, or when
  `beam_size` hypotheses have finished and no live one beats the best at
  its current length. The best finished hypothesis wins (the first found of
  equal scores).
- Returned tokens exclude BOS and stop before EOS; a limit of 0 (an empty
  source) gives no tokens and score 0.

With options other than the plain ones, every decoder follows
`SentenceSearch` (the rules of `greedy` and `beam`, plus `step_scores`,
prefixes, n-best lists and sampling); with the plain ones it gives exactly
`greedy`'s and `beam`'s results, which the tests check.

Needs numpy only.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID, UNK_ID


def banned_ids():
    """Ids never generated: padding and BOS."""
    return [PAD_ID, BOS_ID]


def length_penalty_factor(length, alpha=0.6, form="gnmt"):
    """((5 + length) / 6) ** alpha, the length normalisation of Wu et al. (2016); with
    `form="average"`, length ** alpha (transformers' and fairseq's)."""
    length = np.asarray(length, np.float64)
    if form == "average":
        return length**alpha
    return ((5.0 + length) / 6.0) ** alpha


def greedy(log_probs, limit):
    """Greedy search for one sentence: `(tokens, summed log-probability)`.

    Args:
        log_probs: `log_probs(prefix) -> (vocabulary,)` array, the next-token
            log-probabilities after the generated tokens `prefix`.
        limit: the most tokens generated, EOS included; 0 for an empty source.
    """
    tokens, score = [], 0.0
    for _ in range(limit):
        row = np.asarray(log_probs(tokens), np.float64)
        allowed = row.copy()
        allowed[banned_ids()] = -np.inf
        token = int(allowed.argmax())  # the lowest id of equal scores
        score += row[token]
        if token == EOS_ID:
            break
        tokens.append(token)
    return tokens, score


def beam(log_probs, limit, beam_size, length_penalty=0.6, form="gnmt"):
    """Beam search for one sentence: `(tokens, length-penalized score)`.

    Args:
        log_probs: as for `greedy`.
        limit: the most tokens generated, EOS included; 0 for an empty source.
        beam_size: live hypotheses kept.
        length_penalty: alpha of `length_penalty_factor`; 0 disables it.
        form: the penalty's form, "gnmt" or "average" (`length_penalty_factor`).
            With "average" the search stops only when no live hypothesis can
            win at the longest length (the bound, which holds for either form);
            with "gnmt" also once beam_size have finished and none can win at
            its present length.
    """
    if limit == 0:
        return [], 0.0

    def penalty(length):
        return length_penalty_factor(length, length_penalty, form)

    alive = [([], 0.0)]  # (tokens, summed log-probability)
    finished = []  # (length-penalized score, tokens)
    for t in range(limit):
        candidates = []  # (summed log-probability, beam * vocabulary + token)
        for j, (tokens, score) in enumerate(alive):
            row = np.asarray(log_probs(tokens), np.float64)
            vocabulary = len(row)
            for token in range(vocabulary):
                if token not in banned_ids():
                    candidates.append((score + float(row[token]), j * vocabulary + token))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        grown = []
        for rank, (score, key) in enumerate(candidates[: 2 * beam_size]):
            j, token = divmod(key, vocabulary)
            if token == EOS_ID:
                if rank < beam_size:
                    finished.append((score / penalty(t + 1), alive[j][0]))
            elif len(grown) < beam_size:
                grown.append((alive[j][0] + [token], score))
        if t + 1 == limit:  # out of room: the live hypotheses end here, without EOS
            finished += [(score / penalty(t + 1), tokens) for tokens, score in grown]
            break
        if not grown:
            break
        best = max((score for score, _ in finished), default=-np.inf)
        top = max(score for _, score in grown)
        if top / penalty(limit) <= best or (
            form == "gnmt" and len(finished) >= beam_size and top / penalty(t + 1) <= best
        ):
            break
        alive = grown
    score, tokens = max(finished, key=lambda f: f[0])  # the first of equal scores
    return tokens, score


def alignment_layer(num_layers):
    """The decoder layer whose cross-attention aligns: the last one.

    Chosen on the one set with a known alignment at hand, the toy language
    pair (reversed word order, some words rewritten as two; no hand-aligned
    German-English set is here): with the tiny preset's two layers, the
    last layer's head mean found 70% of the gold links of 50 held-out
    sentences, the first layer's 41%, any single head of the last layer at
    most 62%, and the attention of the step that reads the token (rather
    than predicts it) 34%. Garg et al. (2019) found the last-but-one layer
    best in a 6-layer model; for deep models that remains to be measured.
    The last layer is also the one `--plot-attention` draws.
    """
    return int(num_layers) - 1


def alignments(weights, source_lengths, target_lengths):
    """For each output token, the source position it attends to most.

    Args:
        weights: `(batch, target_len, source_len)` cross-attention of
            `alignment_layer`, averaged over heads, teacher-forced on BOS +
            the output: row i is the step that predicts output token i.
        source_lengths, target_lengths: the real lengths (no padding; the
            target's without EOS).

    Returns:
        per sentence, a list of 0-based source positions (of the source's
        tokens, EOS last), one per output token (the lower position of ties).
    """
    found = []
    for row, s, t in zip(np.asarray(weights), source_lengths, target_lengths, strict=True):
        found.append([int(i) for i in row[:t, :s].argmax(-1)] if s and t else [])
    return found


def truncate_source(ids, max_input_length):
    """The first `max_input_length - 1` tokens and the source's last one (its EOS).

    `max_input_length` None keeps the source whole.
    """
    ids = list(ids)
    if max_input_length is None or len(ids) <= max_input_length:
        return ids
    return ids[: max_input_length - 1] + ids[-1:]


def step_scores(log_probs, tokens, options, prefix=()):
    """The log-probabilities one hypothesis ranks its next token by, after the rules.

    Args:
        log_probs: the model's next-token log-probabilities, `(vocabulary,)`.
        tokens: the hypothesis's tokens so far (BOS excluded).
        options: a `SearchOptions`.
        prefix: the sentence's target prefix (ids); its tokens are forced in order.

    The rules, in order: the repetition penalty multiplies the (negative)
    log-probability of every token already in `tokens` by
    `repetition_penalty`; then padding, BOS, UNK (`disable_unk`), EOS before
    `min_length` tokens, the last token of a suppressed sequence whose other
    tokens end `tokens`, and a token that would repeat an n-gram
    (`no_repeat_ngram_size`) get -inf; while `tokens` is shorter than
    `prefix`, every token but the prefix's next one gets -inf (a forced
    token keeps its penalized score, whatever the masks say). No
    renormalization: the plain search's scores stay the model's
    log-probabilities. Terminology constraints choose among these scores
    (`constrained_search.ConstrainedSearch`): a phrase token they forbid stays out.
    """
    scores = np.array(log_probs, np.float64)
    if options.repetition_penalty != 1 and tokens:
        seen = np.unique(np.asarray(tokens, np.int64))
        scores[seen] *= options.repetition_penalty
    if len(tokens) < len(prefix):
        forced = int(prefix[len(tokens)])
        kept = scores[forced]
        scores[:] = -np.inf
        scores[forced] = kept
        return scores
    penalized = scores
    scores = penalized.copy()
    scores[banned_ids()] = -np.inf
    if options.disable_unk:
        scores[UNK_ID] = -np.inf
    if len(tokens) < options.min_length:
        scores[EOS_ID] = -np.inf
    for sequence in options.suppress_sequences:
        head = list(sequence[:-1])
        if not head or tokens[len(tokens) - len(head) :] == head:
            scores[sequence[-1]] = -np.inf
    n = options.no_repeat_ngram_size
    if n and len(tokens) >= n - 1:
        tail = list(tokens[len(tokens) - n + 1 :]) if n > 1 else []
        for i in range(len(tokens) - n + 1):
            if list(tokens[i : i + n - 1]) == tail:
                scores[tokens[i + n - 1]] = -np.inf
    return scores


def sample(scores, options, rng):
    """A token drawn from `scores` (`step_scores`'s output) by the sampling options.

    The scores are divided by `sampling_temperature`; of the tokens allowed,
    the `sampling_topk` best are kept (0: all), then the smallest set of the
    best whose probability reaches `sampling_topp` (always the best one).
    One `rng.random()` draw per token: the same generator gives the same
    tokens. Ties rank by the lower id.
    """
    order = np.lexsort((np.arange(len(scores)), -scores))  # best first, lower id of ties
    order = order[np.isfinite(scores[order])]
    if options.sampling_topk:
        order = order[: options.sampling_topk]
    logits = scores[order] / options.sampling_temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if options.sampling_topp < 1:
        keep = int(np.searchsorted(np.cumsum(probs), options.sampling_topp)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    pick = int(np.searchsorted(np.cumsum(probs), rng.random(), side="right"))
    return int(order[min(pick, len(order) - 1)])


@dataclasses.dataclass
class Hypothesis:
    """One output of a search: `tokens` (no BOS, cut before EOS), `score` (the
    search's score: beam search divides `log_prob` by the length penalty),
    `log_prob` (the summed step scores, EOS included when produced) and
    `token_scores` (each step's score, EOS included; None when not asked for)
    and `alignment` (per token, the source position it attends to most; set
    after the search, when asked for)."""

    tokens: list
    score: float
    log_prob: float
    token_scores: list | None = None
    alignment: list | None = None


class SentenceSearch:
    """The search of one sentence under `SearchOptions`, step by step.

    `live` holds the hypotheses to extend, as `(tokens, log_prob,
    token_scores)`; `advance(rows)` takes the model's log-probabilities
    after each of them (in `live` order) and returns, for each new live
    hypothesis, the index of the one it extends, which is all a batched
    decoder needs to reorder its cache. `run(log_probs)` is the whole
    search for a `log_probs(prefix)` function, as `greedy` and `beam` take.

    Beam size 1 follows `greedy` (the score is the summed log-probability;
    with sampling the token is drawn by `sample`); a larger beam follows
    `beam`, but ranks by `step_scores`, forces the prefix, and stops only
    when no live hypothesis can beat the `n_best`-th best finished one (the
    best one itself with `n_best=1`), so its first result is at least as
    good as the plain search's. Plain options give exactly `greedy` and
    `beam`'s results.

    Args:
        limit: the most tokens generated, EOS included; 0 for an empty source.
        options: a `SearchOptions`.
        prefix: target prefix ids, forced first.
        rng: a numpy Generator, for sampling.
    """

    def __init__(self, limit, options, prefix=(), rng=None):
        self.limit = int(limit)
        self.options = options
        self.prefix = [int(i) for i in prefix]
        if self.limit and len(self.prefix) >= self.limit:
            raise ValueError(
                f"a target prefix of {len(self.prefix)} tokens leaves no room under the "
                f"output limit of {self.limit} tokens (EOS included): raise max_length."
            )
        if options.sampling and rng is None:
            raise ValueError("sampling needs a random generator (rng).")
        self.rng = rng
        self.step = 0
        self.live = [([], 0.0, [])] if self.limit else []
        self.finished = []  # (score, tokens, log_prob, token_scores)
        self.done = not self.limit

    def _ends(self, live, t):
        """Whether the search ends after step `t`, `live` being what would go on.

        It ends with nothing live, or when no live hypothesis can still beat
        the n-th best finished one: not even at the longest length allowed,
        or (the GNMT form only), once beam_size have finished, not at its
        present length.
        """
        ranks = sorted((f[0] for f in self.finished), reverse=True)
        n = self.options.n_best
        bar = ranks[n - 1] if len(ranks) >= n else -np.inf
        top = max((total for _, total, _ in live), default=-np.inf)
        heuristic = self.options.length_penalty_form == "gnmt"
        return (
            not live
            or top / self._penalty(self.limit) <= bar
            or (
                heuristic
                and len(self.finished) >= self.options.beam_size
                and top / self._penalty(t + 1) <= bar
            )
        )

    def _penalty(self, length):
        return length_penalty_factor(
            length, self.options.length_penalty, self.options.length_penalty_form
        )

    def rescored(self):
        """Whether `step_scores` does more at this step than ban padding and BOS:
        penalties, masks, sampling or a prefix still being forced. If not, a
        step's best tokens (`advance`'s `top`) are all it needs."""
        o = self.options
        return bool(
            o.repetition_penalty != 1
            or o.disable_unk
            or o.suppress_sequences
            or o.no_repeat_ngram_size
            or o.sampling
            or self.step < max(len(self.prefix), o.min_length)
        )

    def advance(self, rows, top=None):
        """One step: `rows[j]` are the log-probabilities after `live[j]`.

        `top`, optional: `(values, ids)`, each row's best `2 * beam_size` (or
        more) tokens other than padding and BOS, best first (ties: the lower id),
        as the decoder step selects them; read instead of `rows` where no
        option rescores the step (`rescored`), with the same results.
        """
        k = self.options.beam_size
        if top is not None and not self.rescored():
            self.step += 1
            return self._advance_selected(rows.shape[-1], *top)
        scored = [
            step_scores(row, tokens, self.options, self.prefix)
            for row, (tokens, _, _) in zip(rows, self.live, strict=True)
        ]
        self.step += 1
        if k == 1:
            return self._advance_one(scored[0])
        vocabulary = len(scored[0])
        candidates = np.stack(
            [score + row for (_, score, _), row in zip(self.live, scored, strict=True)]
        ).reshape(-1)
        width = min(2 * k, len(candidates))
        bar = np.partition(candidates, len(candidates) - width)[len(candidates) - width]
        chosen = np.flatnonzero(candidates >= bar)  # the 2k best, with every tie
        ranked = chosen[np.lexsort((chosen, -candidates[chosen]))][: 2 * k]
        steps = [float(scored[key // vocabulary][key % vocabulary]) for key in ranked]
        return self._take(candidates[ranked], ranked, steps, vocabulary)

    def _advance_selected(self, vocabulary, values, ids):
        """`advance` from each live row's best tokens (`values`, `ids`): the 2k best
        candidates of the whole beam are among them, in the same order (summed
        score, then `beam * vocabulary + token`)."""
        width = 2 * self.options.beam_size
        values, ids = np.asarray(values[:, :width], np.float64), ids[:, :width]
        if self.options.beam_size == 1:
            return self._advance_one_token(int(ids[0, 0]), float(values[0, 0]))
        totals = np.array([total for _, total, _ in self.live])[:, None] + values
        keys = np.arange(len(self.live))[:, None] * vocabulary + np.asarray(ids, np.int64)
        totals, keys, values = totals.reshape(-1), keys.reshape(-1), values.reshape(-1)
        order = np.lexsort((keys, -totals))[:width]
        return self._take(totals[order], keys[order], values[order].tolist(), vocabulary)

    def _take(self, totals, keys, steps, vocabulary):
        """The beam rule of step `self.step - 1` over the ranked candidates (the 2k
        best): summed scores `totals`, `keys` (`beam * vocabulary + token`) and
        step scores `steps`. Returns the parent of each new live hypothesis."""
        t, k = self.step - 1, self.options.beam_size
        grown, parents = [], []
        for rank, (total, key, step) in enumerate(
            zip(totals.tolist(), keys.tolist(), steps, strict=True)
        ):
            if not math.isfinite(total):
                break
            beam, token = divmod(key, vocabulary)
            tokens, _, before = self.live[beam]
            if token == EOS_ID:
                if rank < k:
                    finished = (total / self._penalty(t + 1), tokens, total, before + [step])
                    self.finished.append(finished)
                continue
            grown.append((tokens + [token], total, before + [step]))
            parents.append(beam)
            if len(grown) == k:
                break
        if t + 1 >= self.limit:  # out of room: live hypotheses end here, without EOS
            for tokens, total, before in grown:
                self.finished.append((total / self._penalty(t + 1), tokens, total, before))
            grown = []
        if self._ends(grown, t):
            self.done, self.live = True, []
            return []
        self.live = grown
        return parents

    def _advance_one(self, scores):
        tokens, total, steps = self.live[0]
        if self.options.sampling:
            token = sample(scores, self.options, self.rng)
        else:
            token = int(scores.argmax())  # the lowest id of equal scores
        return self._advance_one_token(token, float(scores[token]))

    def _advance_one_token(self, token, score):
        """A beam of one takes `token`, of step score `score`."""
        tokens, total, steps = self.live[0]
        if not np.isfinite(score):  # every token is masked: end here
            self.finished.append((total, tokens, total, steps))
            self.done, self.live = True, []
            return []
        total += score
        steps = steps + [score]
        if token != EOS_ID:
            tokens = tokens + [token]
        if token == EOS_ID or self.step >= self.limit:
            self.finished.append((total, tokens, total, steps))
            self.done, self.live = True, []
            return []
        self.live = [(tokens, total, steps)]
        return [0]

    def results(self):
        """The `n_best` best finished hypotheses, best first (the first found of equal scores)."""
        if not self.limit:
            return [Hypothesis([], 0.0, 0.0, [] if self.options.token_scores else None)]
        ranked = sorted(self.finished, key=lambda f: -f[0])[: self.options.n_best]
        if not ranked:  # every candidate was masked at the first step
            ranked = [(-np.inf, [], -np.inf, [])]
        return self._hypotheses(ranked)

    def _hypotheses(self, ranked):
        """`Hypothesis` records of finished entries `(score, tokens, log_prob, steps)`."""
        return [
            Hypothesis(
                list(tokens),
                float(score),
                float(log_prob),
                list(steps) if self.options.token_scores else None,
            )
            for score, tokens, log_prob, steps in ranked
        ]

    def run(self, log_probs):
        """The whole search over `log_probs(prefix) -> (vocabulary,)`; returns `results()`."""
        while not self.done:
            self.advance([log_probs(tokens) for tokens, _, _ in self.live])
        return self.results()


def sentence_rng(seed, index):
    """The sampling generator of sentence `index`: the same whatever the batch it is in."""
    return np.random.default_rng([int(seed), int(index)])
