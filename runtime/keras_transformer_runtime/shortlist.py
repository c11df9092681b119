"""Vocabulary shortlists: the output pieces a batch's search may produce.

A decoder step's output layer scores every piece of the vocabulary. A
shortlist restricts it to the pieces likely for the batch at hand: for each
source piece, the target pieces that most often appear with it in the
training pairs, plus the most frequent target pieces. The search graphs of
an export made with a shortlist (`keras-transformer export --shortlist-data`)
compute the logits of those rows alone and normalize over them, so a piece
off the list cannot be produced. The idea and its use on CPUs: Bergamot's
lexical shortlists and CTranslate2's vocabulary map (`vmap`).

Pieces are scored by the Dice coefficient of their sentence co-occurrence,
`2 * pairs(s, t) / (sentences(s) + sentences(t))`, which does not favour
frequent target pieces (those come in through the frequent list).
"""

from __future__ import annotations

import os

import numpy as np

from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID, UNK_ID

FILE = "shortlist.npz"
# Sentence pairs counted per chunk: bounds the co-occurrence keys held at once.
CHUNK_PAIRS = 50_000


class Shortlist:
    """A lexical table and a frequent list over a vocabulary of `vocabulary_size` pieces.

    Args:
        table: `(vocabulary_size, per_piece) int32`: row s lists the target
            pieces kept for source piece s, best first, -1 where it has fewer.
        frequent: `(n,) int32`, the pieces every batch's list holds.
    """

    def __init__(self, table, frequent):
        self.table = np.asarray(table, np.int32)
        self.frequent = np.asarray(frequent, np.int32).reshape(-1)
        if self.table.ndim != 2:
            raise ValueError(f"A shortlist table is 2-D. Got shape {self.table.shape}")
        self.vocabulary_size = self.table.shape[0]
        valid = self.table[self.table >= 0]
        if valid.size and valid.max() >= self.vocabulary_size:
            raise ValueError("A shortlist table lists ids outside its vocabulary.")
        if self.frequent.size and (
            self.frequent.min() < 0 or self.frequent.max() >= self.vocabulary_size
        ):
            raise ValueError("A shortlist's frequent pieces lie outside its vocabulary.")
        # EOS (and UNK, which the model may need) are always on the list.
        self._always = np.union1d(self.frequent, [EOS_ID, UNK_ID]).astype(np.int64)

    @property
    def per_piece(self):
        return self.table.shape[1]

    def ids(self, source_ids, at_least=0):
        """The ascending `(K,) int64` vocabulary ids of the batch `source_ids`
        (`(sentences, length)`, padded with 0): the frequent pieces, EOS, UNK and
        every real source piece's row. Where that makes fewer than `at_least`
        (a search selecting that many tokens a step), the lowest ids not on it
        (but padding and BOS) are added."""
        source = np.asarray(source_ids).reshape(-1)
        source = np.unique(source[(source != PAD_ID) & (source < self.vocabulary_size)])
        listed = self.table[source].reshape(-1)
        # Padding and BOS stay where the frequent list holds them (the whole
        # vocabulary's list must give the full search's normalization); the
        # step bans them either way.
        ids = np.union1d(self._always, listed[listed >= 0])
        if ids.size < at_least:
            missing = np.setdiff1d(np.arange(self.vocabulary_size), ids)
            missing = missing[(missing != PAD_ID) & (missing != BOS_ID)]
            ids = np.union1d(ids, missing[: at_least - ids.size])
        return ids.astype(np.int64)

    def save(self, path):
        """Writes the table and the frequent list to `path` (a .npz file), atomically."""
        partial = f"{path}.partial"
        with open(partial, "wb") as f:
            np.savez(f, table=self.table, frequent=self.frequent)
        os.replace(partial, path)

    @classmethod
    def load(cls, path):
        try:
            with np.load(path, allow_pickle=False) as data:
                return cls(data["table"], data["frequent"])
        except (OSError, KeyError, ValueError) as error:
            raise ValueError(f"{path} is not a shortlist file: {error}") from error

    @classmethod
    def whole_vocabulary(cls, vocabulary_size):
        """The list that holds every piece: the search it gives is the full one."""
        return cls(np.full((vocabulary_size, 0), -1, np.int32), np.arange(vocabulary_size))


def build_shortlist(pairs, vocabulary_size, per_piece=10, frequent=100):
    """Counts the sentence pairs `pairs` (an iterable of `(source ids, target ids)`)
    into a `Shortlist` of each source piece's `per_piece` best target pieces by
    Dice coefficient and the `frequent` most frequent target pieces.

    Special pieces (padding, BOS, EOS, UNK) are not counted.
    """
    if per_piece < 1 or frequent < 0:
        raise ValueError(f"per_piece must be >= 1 and frequent >= 0. Got {per_piece}, {frequent}")
    v = int(vocabulary_size)
    special = max(PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    source_sentences = np.zeros(v, np.int64)
    target_sentences = np.zeros(v, np.int64)
    target_tokens = np.zeros(v, np.int64)
    counted = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # (keys s * v + t, counts)
    keys, pairs_in_chunk = [], 0

    def merge(counted, keys):
        joined = np.concatenate([counted[0], *keys])
        weights = np.concatenate([counted[1], np.ones(sum(k.size for k in keys), np.int64)])
        unique, at = np.unique(joined, return_inverse=True)
        return unique, np.bincount(at, weights=weights).astype(np.int64)

    for source, target in pairs:
        source = np.asarray(source, np.int64)
        target = np.asarray(target, np.int64)
        if source.size and (source.min() < 0 or source.max() >= v):
            raise ValueError(f"A source id lies outside the vocabulary of {v}.")
        if target.size and (target.min() < 0 or target.max() >= v):
            raise ValueError(f"A target id lies outside the vocabulary of {v}.")
        s = np.unique(source[source > special])
        t = np.unique(target[target > special])
        np.add.at(target_tokens, target[target > special], 1)
        source_sentences[s] += 1
        target_sentences[t] += 1
        keys.append((s[:, None] * v + t[None, :]).reshape(-1))
        pairs_in_chunk += 1
        if pairs_in_chunk == CHUNK_PAIRS:
            counted, keys, pairs_in_chunk = merge(counted, keys), [], 0
    if keys:
        counted = merge(counted, keys)
    together, count = counted
    s, t = together // v, together % v
    dice = 2.0 * count / (source_sentences[s] + target_sentences[t])
    # Each source piece's pieces, best first (ties: the more frequent pair, then the lower id).
    order = np.lexsort((t, -count, -dice, s))
    s, t = s[order], t[order]
    starts = np.searchsorted(s, np.arange(v))
    rank = np.arange(s.size) - starts[s]
    kept = rank < per_piece
    table = np.full((v, per_piece), -1, np.int32)
    table[s[kept], rank[kept]] = t[kept]
    by_count = np.lexsort((np.arange(v), -target_tokens))
    top = by_count[: int(frequent)]
    return Shortlist(table, np.sort(top[target_tokens[top] > 0]))
