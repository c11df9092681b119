"""Terminology constraints: target phrases that must appear in a translation.

A user gives, per sentence, a list of target phrases ("this source term
must be translated as that target term"). Each phrase is tokenized with the
target tokenizer; the search then keeps only finished translations that
contain every phrase as a run of consecutive tokens.

The search is the beam search of `spec.SentenceSearch` with constraints as
one more per-hypothesis state (Post and Vilar 2018, "Fast Lexically
Constrained Decoding with Dynamic Beam Allocation"; Hu et al. 2019,
"Improved Lexically Constrained Decoding"): `ConstrainedSearch`, which
`search.search_loop` runs for every sentence of a batch (for the Keras
decoder and the ONNX Runtime translator) and `constrained_beam` for one
sentence (the reference of the tests). The rules:

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

import json
import os

import numpy as np

from keras_transformer_runtime.marian_vocabulary import MarianVocabulary
from keras_transformer_runtime.options import SearchOptions
from keras_transformer_runtime.spec import SentenceSearch, banned_ids, step_scores
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from keras_transformer_runtime.tokenizers import SentencePieceModel

__all__ = [
    "ConstrainedSearch",
    "Constraints",
    "check_fits",
    "constrained_beam",
    "encode_constraints",
    "read_constraints_file",
    "sentence_constraints",
    "word_continuations",
]


class Constraints:
    """The phrases of one sentence (token-id sequences) and the progress rules over them.

    A hypothesis's progress is a tuple with, per phrase, the number of its
    tokens matched (its length once met).

    Args:
        phrases: a list of token-id sequences, each non-empty.
        continuations: ids of tokens that continue the word before them
            (`word_continuations`): none may follow a phrase's last token,
            so that a phrase stands as whole words ("couch", not "couches").
    """

    def __init__(self, phrases=(), continuations=()):
        self.continuations = np.array(sorted({int(i) for i in continuations}), np.int64)
        # continues[i]: whether id i continues a word (ids past the table do not).
        self._continues = np.zeros(int(self.continuations.max(initial=-1)) + 2, bool)
        self._continues[self.continuations] = True
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
        """The progress after `token` is appended (one hypothesis: `advance_many`)."""
        after = self.advance_many(np.array([progress], np.int64), np.array([[token]]))
        return tuple(after[0, 0].tolist())

    def met_tokens(self, progress):
        """Tokens of met phrases, plus the longest partial match of the others (the bank)."""
        return int(self.met_many(np.asarray(progress, np.int64)))

    def all_met(self, progress):
        return all(m == n for m, n in zip(progress, self.lengths, strict=True))

    def next_tokens(self, progress):
        """The tokens that advance an unmet phrase (each one's next token), in order."""
        found = self.next_many(np.array([progress], np.int64))[0]
        return [t for i, t in enumerate(found.tolist()) if t >= 0 and t not in found[:i]]

    def arrays(self):
        """The phrases as arrays for the batched rules: `(phrases, lengths,
        fallback)`, the first and last `(count, longest)`, padded."""
        if not hasattr(self, "_arrays"):
            width = max(self.lengths, default=1)
            phrases = np.full((len(self), width), -1, np.int64)
            fallback = np.zeros((len(self), width), np.int64)
            for i, (phrase, table) in enumerate(zip(self.phrases, self._fallback, strict=True)):
                phrases[i, : len(phrase)] = phrase
                fallback[i, : len(phrase)] = table
            self._arrays = (phrases, np.array(self.lengths, np.int64), fallback)
        return self._arrays

    def advance_many(self, progress, tokens):
        """The progress after each token: `progress (rows, phrases)` int, `tokens
        (rows, width)`; returns `(rows, width, phrases)`. A met phrase stays met;
        an unmet one extends its match, or falls back to the longest shorter
        prefix of it that `token` extends (the failure table), or to 0."""
        phrases, lengths, fallback = self.arrays()
        width = phrases.shape[1]
        count = len(self)
        matched = np.broadcast_to(progress[:, None, :], tokens.shape + (count,)).copy()
        token = tokens[..., None]
        which = np.arange(count) * width  # each phrase's first cell, flattened
        open_ = matched < lengths
        while True:  # fall back while the next phrase token is not `token`
            at = which + np.minimum(matched, width - 1)
            falls = open_ & (matched > 0) & (phrases.flat[at] != token)
            if not falls.any():
                break
            matched = np.where(falls, fallback.flat[which + np.maximum(matched - 1, 0)], matched)
        at = which + np.minimum(matched, width - 1)
        return matched + (open_ & (phrases.flat[at] == token))

    def met_many(self, progress):
        """`met_tokens` over the last axis of `progress`."""
        lengths = self.arrays()[1]
        met = np.where(progress == lengths, lengths, 0).sum(-1)
        return met + np.where(progress < lengths, progress, 0).max(-1, initial=0)

    def continue_words(self, tokens):
        """Whether each of `tokens` (an int array; -1 for none) continues a word."""
        return self._continues[np.clip(tokens, -1, len(self._continues) - 1)]

    def next_many(self, progress):
        """Each phrase's next token for `progress (rows, phrases)`; -1 where met."""
        phrases, lengths, _ = self.arrays()
        at = np.minimum(progress, phrases.shape[1] - 1)
        return np.where(progress < lengths, phrases[np.arange(len(self)), at], -1)

    def found_in(self, tokens):
        """Whether every phrase occurs in `tokens` as consecutive tokens."""
        progress = self.start()
        for token in tokens:
            progress = self.advance(progress, token)
        return self.all_met(progress)


def word_continuations(tokenizer):
    """The ids of a SentencePiece vocabulary's pieces that continue a word: those
    that do not start one ("▁") and begin with a letter or digit. None for a
    word vocabulary, whose every token is a word."""
    if not isinstance(tokenizer, (SentencePieceModel, MarianVocabulary)):
        return ()
    pieces = tokenizer.pieces(range(len(tokenizer)))
    return [
        i
        for i, piece in enumerate(pieces)
        if i > UNK_ID and not piece.startswith("\u2581") and piece[:1].isalnum()
    ]


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


def encode_constraints(phrases, encode, max_tokens=None, where="the sentence", continuations=()):
    """Tokenizes one sentence's phrases into a `Constraints`, refusing what cannot be met.

    Args:
        phrases: a list of strings (target phrases).
        encode: the target tokenizer's `encode(text) -> ids`.
        max_tokens: the most tokens an output may hold before EOS; None: no check.
        where: how errors name the sentence ("line 3").
        continuations: as for `Constraints`.

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
    constraints = Constraints(encoded, continuations)
    if max_tokens is not None:
        check_fits(constraints, max_tokens + 1, where)
    return constraints


def sentence_constraints(
    texts,
    phrases,
    encode,
    model_max_length,
    max_length=None,
    lengths=None,
    continuations=(),
    encode_target=None,
):
    """Each text's `Constraints` from its phrases (a list of strings, or None for none).

    Checks every phrase against the output limit of its sentence (as
    `search.output_limits` sets it) before any search runs; errors name the
    sentence as "line N" (1-based). An empty text translates to an empty
    output, so its phrases are not searched for. `lengths` are the sources'
    token counts (EOS included) where they are known already (truncated, say).
    `continuations`: the target tokenizer's `word_continuations`, so that
    phrases stand as whole words. `encode` gives source ids, `encode_target`
    the phrases' target ids (None: `encode`, one vocabulary for both).
    """
    if len(phrases) != len(texts):
        raise ValueError(
            f"constraints has {len(phrases)} entries for {len(texts)} sentences (one each)."
        )
    from keras_transformer_runtime.sources import output_limits

    if lengths is None:
        lengths = [len(encode(text)) + 1 if text.strip() else 0 for text in texts]
    limits = output_limits(lengths, max_length, model_max_length)
    return [
        encode_constraints(entry, encode_target or encode, limit - 1, f"line {i}", continuations)
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


# --------------------------------------------------------------------------- the search rules


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
        # Per live hypothesis: its progress, and whether its last token ended a phrase.
        self.progress = np.zeros((len(self.live), len(constraints)), np.int64)
        self.ended_phrase = np.zeros(len(self.live), bool)
        self.met = []  # the met tokens of each finished hypothesis

    def _finish(self, t, tokens, total, steps, met):
        self.finished.append((total / self._penalty(t + 1), tokens, total, steps))
        self.met.append(int(met))

    def _candidates(self, rows, top):
        """Each live hypothesis's candidate tokens `(live, width)` (-1: none) and their
        step scores: its `2 * beam_size` best tokens (EOS only once every phrase
        is met), then its phrases' next tokens not among them."""
        k, rules = self.options.beam_size, self.constraints
        if top is None or self.rescored():
            scored = np.stack(
                [
                    step_scores(row, tokens, self.options, self.prefix)
                    for row, (tokens, _, _) in zip(rows, self.live, strict=True)
                ]
            )
            ids = None
        else:  # the decoder's selection holds each row's best tokens
            scored = np.asarray(rows)
            selected = np.asarray(top[1], np.int64)
            ids = selected[:, : 2 * k].copy()
        ended = np.flatnonzero(self.ended_phrase) if len(rules.continuations) else []
        if len(ended):
            # A phrase stands as whole words: no piece continues its last word.
            if ids is None:
                scored[np.ix_(ended, rules.continuations)] = -np.inf
            else:
                ids = self._select_words(scored, selected, ended, ids)
        if ids is None:
            ids = top_tokens(scored, 2 * k)[0]
        nexts = rules.next_many(self.progress)  # (live, phrases)
        ids = np.where((ids == EOS_ID) & (nexts >= 0).any(1, keepdims=True), -1, ids)
        # A next token is new if no selected token and no earlier next token is it.
        seen = (nexts[:, :, None] == ids[:, None, :]).any(-1)
        seen |= np.tril(nexts[:, :, None] == nexts[:, None, :], -1).any(-1)
        tokens = np.concatenate([ids, np.where(seen, -1, nexts)], axis=1)
        values = np.take_along_axis(scored, np.maximum(tokens, 0), axis=1).astype(np.float64)
        return tokens, values

    def _select_words(self, scored, selected, ended, ids):
        """`ids` with the rows `ended` (whose last token ended a phrase) holding their
        best tokens that continue no word: from the decoder's wider selection
        `selected` when it holds enough of them (or every allowed token), else
        from the whole row."""
        rules, width = self.constraints, ids.shape[1]
        whole = selected.shape[1] >= scored.shape[-1] - len(banned_ids())
        for row in ended:
            words = selected[row][~rules.continue_words(selected[row])][:width]
            if len(words) < width and not whole:
                banned = np.array(scored[row], np.float64)
                banned[banned_ids()] = -np.inf
                banned[rules.continuations] = -np.inf
                words = top_tokens(banned[None], width)[0][0]
                words = words[np.isfinite(banned[words])]
            ids[row] = -1
            ids[row, : len(words)] = words
        return ids

    def advance(self, rows, top=None):
        """One step: `rows[j]` are the log-probabilities after `live[j]`, `top`
        optionally the decoder's selection (as for `SentenceSearch.advance`);
        returns the index of the live hypothesis each new one extends."""
        t, k, rules = self.step, self.options.beam_size, self.constraints
        tokens, values = self._candidates(rows, top)
        self.step += 1
        if len(rules.continuations) and self.ended_phrase.any():
            ended = self.ended_phrase[:, None] & rules.continue_words(tokens)
            values = np.where(ended, -np.inf, values)
        valid = (tokens >= 0) & np.isfinite(values)
        beams, places = np.nonzero(valid)
        token = tokens[beams, places]
        totals = np.array([total for _, total, _ in self.live])[beams] + values[beams, places]
        vocab = np.asarray(rows[0]).shape[-1]
        keys = beams * vocab + token
        after = rules.advance_many(self.progress[beams], token[:, None])[:, 0]
        eos = token == EOS_ID
        after[eos] = self.progress[beams[eos]]
        banks = rules.met_many(after)
        # Within a bank, by summed score (ties: the lower key); a candidate's
        # stripe is its rank in its bank. The stripes in order, each from the
        # most met tokens down; with one bank, the score order.
        order = np.lexsort((keys, -totals, -banks))
        first = np.searchsorted(-banks[order], -banks[order], side="left")
        stripe = np.empty(len(order), np.int64)
        stripe[order] = np.arange(len(order)) - first
        striped = np.lexsort((-banks, stripe))
        position = np.arange(len(striped))
        eos_at = eos[striped]
        finishing = striped[eos_at & (position < k)]
        growing = striped[~eos_at][:k]
        for c in finishing:  # in stripe order
            tokens_, _, steps = self.live[beams[c]]
            self._finish(
                t, tokens_, float(totals[c]), steps + [float(values[beams[c], places[c]])], banks[c]
            )
        growing = growing[np.lexsort((keys[growing], -totals[growing]))]  # as plain beams
        live, parents = [], beams[growing].tolist()
        for c in growing:
            tokens_, _, steps = self.live[beams[c]]
            live.append(
                (
                    tokens_ + [int(token[c])],
                    float(totals[c]),
                    steps + [float(values[beams[c], places[c]])],
                )
            )
        progress = after[growing]
        before = self.progress[beams[growing]]
        ended = ((progress == rules.arrays()[1]) & (before < progress)).any(1)
        if t + 1 >= self.limit:  # out of room: live hypotheses end here, without EOS
            for (tokens_, total, steps), met in zip(live, banks[growing], strict=True):
                self._finish(t, tokens_, total, steps, met)
            live = []
        if self._ends(live, t):
            self.done, self.live = True, []
            self.progress, self.ended_phrase = self.progress[:0], self.ended_phrase[:0]
            return []
        self.live, self.progress, self.ended_phrase = live, progress, ended
        return parents

    def results(self):
        """The `n_best` finished hypotheses with the most met tokens, then the best
        scores (the first found of equal ones), best first."""
        if not self.limit or not self.finished:
            return super().results()
        order = sorted(
            range(len(self.finished)), key=lambda i: (-self.met[i], -self.finished[i][0])
        )
        return self._hypotheses([self.finished[i] for i in order[: self.options.n_best]])


def constrained_beam(log_probs, limit, beam_size, constraints, length_penalty=0.6):
    """Constrained beam search for one sentence: `(tokens, length-penalized score)`.

    The reference the batched searches are tested against, shaped as
    `spec.beam`: the model is queried one hypothesis at a time.
    """
    options = SearchOptions(beam_size=beam_size, length_penalty=length_penalty)
    best = ConstrainedSearch(limit, options, constraints).run(log_probs)[0]
    return best.tokens, best.score
