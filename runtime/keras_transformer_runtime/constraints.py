"""Terminology constraints: target phrases that must appear in a translation.

A user gives, per sentence, a list of target phrases ("this source term
must be translated as that target term"). Each phrase is tokenized with the
target tokenizer; the search then keeps only finished translations that
contain every phrase as a run of consecutive tokens.

The search is beam search with constraints as one more per-hypothesis state
(Post and Vilar 2018, "Fast Lexically Constrained Decoding with Dynamic Beam
Allocation"; Hu et al. 2019, "Improved Lexically Constrained Decoding"). The
rules, applied to every sentence by both `constrained_beam` (one sentence,
written plainly, for the tests) and `constrained_beam_loop` (a batch over a
decoder step, for the Keras decoder and the ONNX Runtime translator):

- Progress. A hypothesis tracks, for every phrase, how many of its tokens
  the end of the output matches (as a string search does: a mismatch falls
  back to the longest matching shorter prefix, so an output may restart a
  phrase). A phrase matched to its end is met, and stays met. The
  hypothesis's *met tokens* are the lengths of its met phrases plus the
  longest partial match of the others.
- Candidates. Each live hypothesis is extended by its `2 * beam_size` best
  tokens (padding and BOS never) and by every token that advances one of
  its unmet phrases (the next token of each). EOS is a candidate only for a
  hypothesis that has met every phrase.
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
- Stopping, as plain beam search: at the limit the live hypotheses finish
  as they are; a sentence stops early when no live hypothesis can beat the
  best finished one, or when `beam_size` have finished and none beats the
  best at its current length.
- The winner (the fallback rule): the finished hypothesis with the most met
  tokens, then the best score (the first found of equal ones). Whenever the
  phrases fit in the limit (their tokens together at most `limit - 1`, room
  left for EOS), the hypothesis with the most met tokens gains one at every
  step and is never dropped, so the winner has met every phrase; the
  searches refuse phrases that do not fit (`check_fits`). With no phrases,
  the rules are those of plain beam search (`spec.beam`), result for result.

Needs numpy only.
"""

from __future__ import annotations

import json
import os

import numpy as np

from keras_transformer_runtime.search import DROP_FRACTION, check_beam_arguments, output_limits
from keras_transformer_runtime.spec import banned_ids, length_penalty_factor
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID, UNK_ID

__all__ = [
    "Constraints",
    "add_constraints_flag",
    "check_fits",
    "constrained_beam",
    "constrained_beam_loop",
    "encode_constraints",
    "read_constraints_file",
    "read_constraints_flag",
    "sentence_constraints",
]


class Constraints:
    """The phrases of one sentence (token-id sequences) and the progress rules over them.

    A hypothesis's progress is a tuple with, per phrase, the number of its
    tokens matched (its length once met).

    Args:
        phrases: a list of token-id sequences, each non-empty.
    """

    def __init__(self, phrases=()):
        self.phrases = [tuple(int(t) for t in phrase) for phrase in phrases]
        for phrase in self.phrases:
            if not phrase:
                raise ValueError("A constraint must have at least one token.")
            if set(phrase) & {PAD_ID, BOS_ID, EOS_ID}:
                raise ValueError(
                    f"A constraint cannot hold padding, BOS or EOS. Received: {list(phrase)}"
                )
        self.lengths = [len(phrase) for phrase in self.phrases]
        self.total = sum(self.lengths)
        # Knuth-Morris-Pratt failure tables: fallback[p] is the length of the
        # longest proper prefix of phrase[:p + 1] that is also its suffix.
        self._fallback = [_failure_table(phrase) for phrase in self.phrases]

    def __len__(self):
        return len(self.phrases)

    def start(self):
        """The progress of an empty output."""
        return (0,) * len(self.phrases)

    def advance(self, progress, token):
        """The progress after `token` is appended."""
        new = []
        for phrase, fallback, matched in zip(self.phrases, self._fallback, progress, strict=True):
            if matched < len(phrase):
                while matched and phrase[matched] != token:
                    matched = fallback[matched - 1]
                if phrase[matched] == token:
                    matched += 1
            new.append(matched)
        return tuple(new)

    def met_tokens(self, progress):
        """Tokens of met phrases, plus the longest partial match of the others (the bank)."""
        met = sum(m for m, n in zip(progress, self.lengths, strict=True) if m == n)
        partial = max((m for m, n in zip(progress, self.lengths, strict=True) if m < n), default=0)
        return met + partial

    def all_met(self, progress):
        return all(m == n for m, n in zip(progress, self.lengths, strict=True))

    def next_tokens(self, progress):
        """The tokens that advance an unmet phrase (each one's next token), in order."""
        tokens = []
        for phrase, matched in zip(self.phrases, progress, strict=True):
            if matched < len(phrase) and phrase[matched] not in tokens:
                tokens.append(phrase[matched])
        return tokens

    def found_in(self, tokens):
        """Whether every phrase occurs in `tokens` as consecutive tokens."""
        progress = self.start()
        for token in tokens:
            progress = self.advance(progress, token)
        return self.all_met(progress)


def _failure_table(phrase):
    table, k = [0] * len(phrase), 0
    for i in range(1, len(phrase)):
        while k and phrase[i] != phrase[k]:
            k = table[k - 1]
        if phrase[i] == phrase[k]:
            k += 1
        table[i] = k
    return table


def check_fits(constraints, limit, where="the sentence"):
    """Refuses phrases that cannot fit in an output of at most `limit` tokens (EOS included)."""
    if constraints.total and constraints.total > limit - 1:
        lengths = " + ".join(map(str, constraints.lengths))
        raise ValueError(
            f"The constraints of {where} need {constraints.total} tokens ({lengths}), more than "
            f"the {max(limit - 1, 0)} an output of at most {limit} tokens (EOS included) holds: "
            "shorten the constraints or raise max_length."
        )


def encode_constraints(phrases, encode, max_tokens=None, where="the sentence"):
    """Tokenizes one sentence's phrases into a `Constraints`, refusing what cannot be met.

    Args:
        phrases: a list of strings (target phrases).
        encode: the target tokenizer's `encode(text) -> ids`.
        max_tokens: the most tokens an output may hold before EOS; None: no check.
        where: how errors name the sentence ("line 3").

    Raises:
        ValueError: naming the phrase: not a string, empty, tokenized to
            nothing or to the unknown token, or longer than `max_tokens`.
    """
    if isinstance(phrases, str) or not isinstance(phrases, (list, tuple)):
        raise ValueError(
            f"The constraints of {where} must be a list of strings. Received: {phrases!r}"
        )
    encoded = []
    for phrase in phrases:
        if not isinstance(phrase, str):
            raise ValueError(f"A constraint of {where} is not a string: {phrase!r}")
        ids = encode(phrase) if phrase.strip() else []
        if not ids:
            raise ValueError(f"The constraint {phrase!r} of {where} tokenizes to nothing.")
        if UNK_ID in ids:
            raise ValueError(
                f"The constraint {phrase!r} of {where} holds text the target vocabulary does "
                "not know (it tokenizes to the unknown token), so no translation can hold it."
            )
        if max_tokens is not None and len(ids) > max_tokens:
            raise ValueError(
                f"The constraint {phrase!r} of {where} is {len(ids)} tokens, longer than the "
                f"{max_tokens} an output holds (max_length, EOS excluded)."
            )
        encoded.append(ids)
    constraints = Constraints(encoded)
    if max_tokens is not None:
        check_fits(constraints, max_tokens + 1, where)
    return constraints


def sentence_constraints(texts, phrases, encode, model_max_length, max_length=None):
    """Each text's `Constraints` from its phrases (a list of strings, or None for none).

    Checks every phrase against the output limit of its sentence (as
    `search.output_limits` sets it) before any search runs; errors name the
    sentence as "line N" (1-based). An empty text translates to an empty
    output, so its phrases are not searched for.
    """
    if len(phrases) != len(texts):
        raise ValueError(
            f"constraints has {len(phrases)} entries for {len(texts)} sentences (one each)."
        )
    lengths = [len(encode(text)) + 1 if text.strip() else 0 for text in texts]
    limits = output_limits(lengths, max_length, model_max_length)
    return [
        encode_constraints(entry, encode, max_tokens=limit - 1, where=f"line {i}")
        if entry and limit
        else Constraints()
        for i, (entry, limit) in enumerate(zip(phrases, limits, strict=True), 1)
    ]


def read_constraints_file(path, count=None):
    """The phrases of each input line from a constraints file: a list of lists of strings.

    Two formats, by extension: `.jsonl`, one JSON list of strings per line;
    anything else, tab-separated phrases per line. An empty line means no
    constraint for that sentence. Line N constrains input line N, so a
    `count` (the input's lines) other than the file's is refused.

    Raises:
        ValueError: naming the file and line of the first bad line.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line} is not UTF-8 text.") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    jsonl = os.fspath(path).endswith(".jsonl")
    rows = []
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\r")
        if not line.strip():
            rows.append([])
            continue
        if jsonl:
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number} is not JSON: {error}") from None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(
                    f"{path} line {number} must be a JSON list of strings. Received: {line[:80]}"
                )
            phrases = value
        else:
            phrases = line.split("\t")
        empty = [i for i, phrase in enumerate(phrases, 1) if not phrase.strip()]
        if empty:
            raise ValueError(
                f"{path} line {number}: phrase {empty[0]} is empty (phrases are separated by "
                "one tab; an empty line means no constraint)."
            )
        rows.append([phrase.strip() for phrase in phrases])
    if count is not None and len(rows) != count:
        raise ValueError(
            f"{path} has {len(rows)} lines, the input {count}: line N holds the constraints "
            "of input line N (an empty line for none)."
        )
    return rows


def add_constraints_flag(parser):
    """`--constraints FILE`, the same in both translate commands."""
    parser.add_argument(
        "--constraints",
        metavar="FILE",
        help="target phrases each translation must hold, line N for input line N: "
        "tab-separated phrases per line, or a JSON list of strings per line in a .jsonl "
        "file; an empty line for none (docs/constraints.md)",
    )


def read_constraints_flag(path, count):
    """The `--constraints` file's phrases for `count` input lines (None without the flag)."""
    if path is None:
        return None
    try:
        return read_constraints_file(path, count)
    except OSError as error:
        raise ValueError(f"Cannot read the constraints file {path}: {error}") from error


# --------------------------------------------------------------------------- the search rules


def top_tokens(log_probs, width):
    """Each row's `width` best tokens, best first (ties: the lower id): `(ids, scores)`."""
    width = min(width, log_probs.shape[-1])
    part = np.argpartition(-log_probs, width - 1, axis=-1)[..., :width]
    values = np.take_along_axis(log_probs, part, axis=-1)
    order = np.lexsort((part, -values), axis=-1)
    return np.take_along_axis(part, order, axis=-1), np.take_along_axis(values, order, axis=-1)


class _SentenceSearch:
    """The constrained beam search of one sentence, one step at a time.

    `alive` holds the live hypotheses `(tokens, summed log-probability,
    progress)`; `step` takes their next-token log-probabilities (one row
    each, in order) and returns the rows the new live hypotheses grow from.
    """

    def __init__(self, constraints, limit, beam_size, length_penalty):
        self.constraints = constraints
        self.limit = int(limit)
        self.beam_size = beam_size
        self.alpha = length_penalty
        self.alive = [([], 0.0, constraints.start())]
        self.finished = []  # (met tokens, normalized score, tokens)
        self.done = self.limit == 0

    def _penalty(self, length):
        return length_penalty_factor(length, self.alpha)

    def step(self, t, log_probs, top_ids, top_scores):
        """One step. `log_probs` is `(len(alive), vocab)`, float; `top_ids`/`top_scores`
        its rows' `2 * beam_size` best allowed tokens (`top_tokens`). Returns the
        origin row of each new live hypothesis (empty once done)."""
        k, rules = self.beam_size, self.constraints
        vocab = log_probs.shape[-1]
        candidates = {}  # beam * vocab + token -> summed log-probability
        for j, (_, score, progress) in enumerate(self.alive):
            ends = rules.all_met(progress)
            for token, value in zip(top_ids[j], top_scores[j], strict=True):
                if np.isfinite(value) and (token != EOS_ID or ends):
                    candidates[j * vocab + int(token)] = score + float(value)
            for token in rules.next_tokens(progress):
                value = float(log_probs[j, token])
                if np.isfinite(value):
                    candidates[j * vocab + token] = score + value
        ranked = sorted(candidates.items(), key=lambda item: (-item[1], item[0]))
        banks = {}  # met tokens -> [(key, score, progress)], best first
        for key, score in ranked:
            beam, token = divmod(key, vocab)
            progress = self.alive[beam][2]
            if token != EOS_ID:
                progress = rules.advance(progress, token)
            banks.setdefault(rules.met_tokens(progress), []).append((key, score, progress))
        # The stripes: the best of each bank from the most met tokens down, then
        # the second best of each, and so on. With one bank, the score order.
        order = sorted(banks, reverse=True)
        striped = [
            banks[met][stripe]
            for stripe in range(max(map(len, banks.values()), default=0))
            for met in order
            if stripe < len(banks[met])
        ]
        grown = []
        for position, (key, score, progress) in enumerate(striped):
            beam, token = divmod(key, vocab)
            if token == EOS_ID:
                if position < k:
                    met = rules.met_tokens(progress)
                    tokens = self.alive[beam][0]
                    self.finished.append((met, score / self._penalty(t + 1), tokens))
                continue
            grown.append((key, score, progress))
            if len(grown) == k:
                break
        # The new beams in score order (ties: the earlier beam, the lower id).
        grown.sort(key=lambda item: (-item[1], item[0]))
        new_alive, origins = [], []
        for key, score, progress in grown:
            beam, token = divmod(key, vocab)
            new_alive.append((self.alive[beam][0] + [token], score, progress))
            origins.append(beam)
        if t + 1 >= self.limit:  # out of room: live hypotheses end here, without EOS
            for tokens, score, progress in new_alive:
                self.finished.append(
                    (rules.met_tokens(progress), score / self._penalty(t + 1), tokens)
                )
            new_alive = []
        best = max((s for _, s, _ in self.finished), default=-np.inf)
        top = max((score for _, score, _ in new_alive), default=-np.inf)
        if (
            not new_alive
            or top / self._penalty(self.limit) <= best
            or (len(self.finished) >= k and top / self._penalty(t + 1) <= best)
        ):
            self.done = True
            return []
        self.alive = new_alive
        return origins

    def result(self):
        """`(tokens, score)` of the winner: the most met tokens, then the best score."""
        if not self.finished:
            return [], 0.0 if self.limit == 0 else -np.inf
        met, score, tokens = max(self.finished, key=lambda f: (f[0], f[1]))
        return tokens, score


def constrained_beam(log_probs, limit, beam_size, constraints, length_penalty=0.6):
    """Constrained beam search for one sentence: `(tokens, length-penalized score)`.

    The reference the batched search is tested against: the model is
    queried one hypothesis at a time.

    Args:
        log_probs: `log_probs(prefix) -> (vocabulary,)`, as for `spec.beam`.
        limit: the most tokens generated, EOS included; 0 for an empty source.
        beam_size: live hypotheses kept.
        constraints: a `Constraints` (or a list of token-id phrases).
        length_penalty: alpha of the length penalty; 0 disables it.
    """
    check_beam_arguments(beam_size, length_penalty)
    if not isinstance(constraints, Constraints):
        constraints = Constraints(constraints)
    if limit:
        check_fits(constraints, limit)
    search = _SentenceSearch(constraints, limit, beam_size, length_penalty)
    t = 0
    while not search.done:
        rows = np.stack(
            [np.asarray(log_probs(tokens), np.float64) for tokens, _, _ in search.alive]
        )
        rows[:, banned_ids()] = -np.inf
        ids, scores = top_tokens(rows, 2 * beam_size)
        search.step(t, rows, ids, scores)
        t += 1
    return search.result()


def constrained_beam_loop(
    step, reorder, limits, beam_size, constraints, length_penalty=0.6, drop_finished=True
):
    """Constrained beam search over a decoder step; row `p * beam_size + j` is beam j of sentence p.

    Args:
        step: `step(last, t) -> log_probs`: `last` is the int32 newest token
            of every row of the decoder state, `(sentences * beam_size,)`;
            the result is the whole `(sentences * beam_size, vocab)`
            log-probabilities (the phrases' tokens need theirs).
        reorder: `reorder(rows)`, called before every step after the first:
            row i of the decoder state becomes row `rows[i]` of the previous
            state. With `drop_finished`, finished sentences leave the state
            (once more than `search.DROP_FRACTION` of it is finished), so
            `rows` covers only the sentences still searched, in input order.
        limits: per-sentence maximum output length (EOS included); 0 = empty.
        beam_size: beams kept per sentence.
        constraints: per sentence, a `Constraints` (or a list of token-id
            phrases); an empty one is plain beam search.
        length_penalty: alpha of the length penalty; 0 disables it.
        drop_finished: shrink the decoder state as sentences finish (for a
            step that takes any batch size; the results are the same).

    Returns:
        `(tokens, scores)` as `search.beam_loop` returns them.
    """
    check_beam_arguments(beam_size, length_penalty)
    limits = np.asarray(limits)
    if len(constraints) != len(limits):
        raise ValueError(
            f"constraints has {len(constraints)} entries for {len(limits)} sentences (one each)."
        )
    k = beam_size
    searches = []
    for i, (c, limit) in enumerate(zip(constraints, limits, strict=True)):
        c = c if isinstance(c, Constraints) else Constraints(c)
        if limit:
            check_fits(c, limit, f"sentence {i}")
        searches.append(_SentenceSearch(c, limit, k, length_penalty))
    if all(s.done for s in searches):
        return [[] for _ in searches], np.zeros(len(searches), np.float64)
    active = np.arange(len(searches))  # the sentences the decoder state holds, in order
    last = np.full(len(active) * k, BOS_ID, np.int32)
    banned = banned_ids()
    t = 0
    while len(active):
        log_probs = np.array(step(last, t), dtype=np.float64)
        log_probs[:, banned] = -np.inf
        ids, scores = top_tokens(log_probs, 2 * k)
        # By default a row keeps its sentence's first row (a beam not alive, or a
        # sentence done but still in the state): its next step is not read.
        rows = np.repeat(np.arange(len(active)) * k, k)
        for p, b in enumerate(active):
            search = searches[b]
            if search.done:
                continue
            n = len(search.alive)
            rows_of = slice(p * k, p * k + n)
            origins = search.step(t, log_probs[rows_of], ids[rows_of], scores[rows_of])
            for j, origin in enumerate(origins):
                rows[p * k + j] = p * k + origin
                last[p * k + j] = search.alive[j][0][-1]
        t += 1
        done = np.array([searches[b].done for b in active])
        if done.all():
            break
        if drop_finished and done.sum() > DROP_FRACTION * len(active):
            keep = np.flatnonzero(~done)
            rows = rows.reshape(-1, k)[keep].reshape(-1)
            last = last.reshape(-1, k)[keep].reshape(-1)
            active = active[keep]
        reorder(rows.astype(np.int32))
    results = [s.result() for s in searches]
    return [r[0] for r in results], np.array([r[1] for r in results], np.float64)
