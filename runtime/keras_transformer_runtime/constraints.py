"""Terminology constraints: target phrases that must appear in a translation.

A user gives, per sentence, a list of target phrases ("this source term
must be translated as that target term"). Each phrase is tokenized with the
target tokenizer (`encode_constraints`, `sentence_constraints`, or a file:
`read_constraints_file`); the search then keeps only finished translations
that contain every phrase as a run of consecutive tokens. `Constraints` holds
one sentence's phrases and `PhraseTable` many sentences', with the progress
rules over them; the search that uses them is
`constrained_search.ConstrainedSearch`, whose docstring has the rules.

Needs numpy only.
"""

from __future__ import annotations

import json
import os

import numpy as np

from keras_transformer_runtime.marian_vocabulary import MarianVocabulary
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from keras_transformer_runtime.tokenizers import SentencePieceModel

__all__ = [
    "Constraints",
    "PhraseTable",
    "check_fits",
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
        if not isinstance(continuations, np.ndarray):
            continuations = np.fromiter(continuations, np.int64)
        continuations = continuations.astype(np.int64, copy=False)
        if np.any(continuations[1:] <= continuations[:-1]):  # not yet sorted and unique
            continuations = np.unique(continuations)
        self.continuations = continuations
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

    def table(self):
        """This sentence's `PhraseTable` (sentence 0 of it)."""
        if not hasattr(self, "_table"):
            self._table = PhraseTable([self])
        return self._table

    def advance(self, progress, token):
        """The progress after `token` is appended (`PhraseTable.advance` on one row)."""
        after = self.table().advance(
            np.zeros(1, np.int64), np.array([progress], np.int64), np.array([[token]])
        )
        return tuple(after[0, 0].tolist())

    def met_tokens(self, progress):
        """Tokens of met phrases, plus the longest partial match of the others (the bank)."""
        return int(self.table().met(np.zeros(1, np.int64), np.array([progress], np.int64))[0])

    def all_met(self, progress):
        return all(m == n for m, n in zip(progress, self.lengths, strict=True))

    def next_tokens(self, progress):
        """The tokens that advance an unmet phrase (each one's next token), in order."""
        found = self.table().next(np.zeros(1, np.int64), np.array([progress], np.int64))[0]
        return [t for i, t in enumerate(found.tolist()) if t >= 0 and t not in found[:i]]

    def found_in(self, tokens):
        """Whether every phrase occurs in `tokens` as consecutive tokens."""
        progress = self.start()
        for token in tokens:
            progress = self.advance(progress, token)
        return self.all_met(progress)


class PhraseTable:
    """The phrases of several sentences' `Constraints` as arrays, and the progress
    rules over them for many hypotheses at once.

    Sentence s's phrases are rows `s, :len(constraints)` of `phrases (sentences,
    most phrases, longest)` (padded with -1; a padding phrase has length 0 and
    counts as met, with no tokens). A hypothesis's progress is a row of
    `most phrases` matched-token counts; `sentence` arrays give each
    hypothesis's sentence.
    """

    def __init__(self, sentences):
        count = max((len(c) for c in sentences), default=0)
        longest = max((n for c in sentences for n in c.lengths), default=1)
        widest = max((len(c._continues) for c in sentences), default=1)
        self.phrases = np.full((len(sentences), count, longest), -1, np.int64)
        self.fallback = np.zeros((len(sentences), count, longest), np.int64)
        self.lengths = np.zeros((len(sentences), count), np.int64)
        # continues[s, i]: whether id i continues a word in sentence s (ids past
        # the table do not; its last column is always False).
        self.continues = np.zeros((len(sentences), widest + 1), bool)
        for s, c in enumerate(sentences):
            for i, (phrase, table) in enumerate(zip(c.phrases, c._fallback, strict=True)):
                self.phrases[s, i, : len(phrase)] = phrase
                self.fallback[s, i, : len(phrase)] = table
                self.lengths[s, i] = len(phrase)
            self.continues[s, : len(c._continues)] = c._continues

    @property
    def width(self):
        """Phrases per progress row."""
        return self.phrases.shape[1]

    def advance(self, sentence, progress, tokens):
        """The progress after each token: `sentence (rows,)`, `progress (rows,
        phrases)`, `tokens (rows, width)`; returns `(rows, width, phrases)`. A
        met phrase stays met; an unmet one extends its match, or falls back to
        the longest shorter prefix of it that the token extends (the
        Knuth-Morris-Pratt failure table), or to 0."""
        count, longest = self.phrases.shape[1:]
        matched = np.broadcast_to(progress[:, None, :], tokens.shape + (count,)).copy()
        token = tokens[..., None]
        # Each (row, phrase)'s first cell in the flattened tables: (rows, 1, phrases).
        first = ((sentence[:, None] * count + np.arange(count)) * longest)[:, None, :]
        open_ = matched < self.lengths[sentence][:, None, :]
        while True:  # fall back while the next phrase token is not `token`
            at = first + np.minimum(matched, longest - 1)
            falls = open_ & (matched > 0) & (self.phrases.flat[at] != token)
            if not falls.any():
                break
            back = self.fallback.flat[first + np.maximum(matched - 1, 0)]
            matched = np.where(falls, back, matched)
        at = first + np.minimum(matched, longest - 1)
        return matched + (open_ & (self.phrases.flat[at] == token))

    def met(self, sentence, progress):
        """The met tokens (the bank) of each progress row `(rows, ..., phrases)`:
        the lengths of its met phrases plus the longest partial match."""
        lengths = self.lengths[sentence].reshape(
            (len(sentence),) + (1,) * (progress.ndim - 2) + (self.width,)
        )
        met = np.where(progress == lengths, lengths, 0).sum(-1)
        return met + np.where(progress < lengths, progress, 0).max(-1, initial=0)

    def next(self, sentence, progress):
        """Each phrase's next token for `progress (rows, phrases)`; -1 where met."""
        lengths = self.lengths[sentence]
        at = np.minimum(progress, self.phrases.shape[2] - 1)
        tokens = self.phrases[sentence[:, None], np.arange(self.width), at]
        return np.where(progress < lengths, tokens, -1)

    def ends_phrase(self, sentence, before, after):
        """Whether the token that took `before` to `after` (rows of progress) met a phrase."""
        return ((after == self.lengths[sentence]) & (before < after)).any(-1)

    def continue_words(self, sentence, tokens):
        """Whether each of `tokens (rows, width)` (-1 for none) continues a word."""
        at = np.clip(tokens, -1, self.continues.shape[1] - 1)
        return self.continues[sentence[:, None], at]


def word_continuations(tokenizer):
    """The ids of a SentencePiece vocabulary's pieces that continue a word: those
    that do not start one ("▁") and begin with a letter or digit, as an int64
    array; none for a word vocabulary, whose every token is a word."""
    if not isinstance(tokenizer, (SentencePieceModel, MarianVocabulary)):
        return np.zeros(0, np.int64)
    pieces = tokenizer.pieces(range(len(tokenizer)))
    found = [
        i
        for i, piece in enumerate(pieces)
        if i > UNK_ID and not piece.startswith("\u2581") and piece[:1].isalnum()
    ]
    return np.array(found, np.int64)


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
