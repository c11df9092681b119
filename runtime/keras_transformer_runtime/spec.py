"""The search specification: greedy and beam search for one sentence, written plainly.

Every decoder of this project follows these rules: the batched numpy loops
(`keras_transformer_runtime.search.greedy_loop` and `beam_loop`), the Keras
decoder (`keras_transformer.decoding`) and the ONNX search graphs
(`greedy_search`, `greedy_batch_search`, `beam_search`, `beam_batch_search`).
They are fast, batched, cached and hard to read; this module is slow and
easy to read, and the tests check each of them against it (same tokens,
scores within float32 round-off).

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

Needs numpy only.
"""

from __future__ import annotations

import numpy as np

from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID


def banned_ids(ignore_eos=False):
    """Ids never generated: padding and BOS (and EOS with `ignore_eos`)."""
    return [PAD_ID, BOS_ID] + ([EOS_ID] if ignore_eos else [])


def length_penalty_factor(length, alpha=0.6):
    """((5 + length) / 6) ** alpha, the length normalisation of Wu et al. (2016)."""
    return ((5.0 + np.asarray(length, np.float64)) / 6.0) ** alpha


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


def beam(log_probs, limit, beam_size, length_penalty=0.6):
    """Beam search for one sentence: `(tokens, length-penalized score)`.

    Args:
        log_probs: as for `greedy`.
        limit: the most tokens generated, EOS included; 0 for an empty source.
        beam_size: live hypotheses kept.
        length_penalty: alpha of `length_penalty_factor`; 0 disables it.
    """
    if limit == 0:
        return [], 0.0

    def penalty(length):
        return length_penalty_factor(length, length_penalty)

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
            len(finished) >= beam_size and top / penalty(t + 1) <= best
        ):
            break
        alive = grown
    score, tokens = max(finished, key=lambda f: f[0])  # the first of equal scores
    return tokens, score
