"""The built-in parallel corpus: a seeded toy language pair that needs attention.

Source sentences are strings of lower-case words. The target reverses the word
order and rewrites every word through a fixed dictionary; some source words
become two target words. A model must therefore attend to a moving,
length-shifted position of the source at each step: a copy or a word-by-word
lookup cannot solve it.

    source: "ko mina tel"      target: "TEL BAR MINA KO"   (if mina -> "BAR MINA")
"""

from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
from keras_transformer_runtime import tokenizers
from keras_transformer_runtime.specials import SPECIAL_PIECES

from keras_transformer.io_utils import atomic_write_text

SOURCE_WORDS = (
    "ka ko ku li lo mina nor pel ris sa ti tel vu wen yor zam bel dun fap gor hik jul"
).split()
# Words whose translation is two target words.
COMPOUND_EVERY = 4

SPECIALS = SPECIAL_PIECES  # ids 0, 1, 2, 3 everywhere in the project


def _translation_table(seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    targets = [w.upper() for w in SOURCE_WORDS]
    rng.shuffle(targets)
    table = {}
    for i, (src, tgt) in enumerate(zip(SOURCE_WORDS, targets, strict=True)):
        table[src] = [tgt]
        if i % COMPOUND_EVERY == 0:  # rewrite into two words
            table[src] = [tgt, targets[(i + 1) % len(targets)] + "X"]
    return table


@dataclasses.dataclass
class ToyCorpus:
    """Train/valid/test sentence pairs of the toy language pair."""

    train: list[tuple[str, str]]
    valid: list[tuple[str, str]]
    test: list[tuple[str, str]]
    table: dict[str, list[str]]

    def translate(self, source: str) -> str:
        """The reference translation of any source sentence."""
        return translate(source, self.table)

    def write(self, directory: str) -> dict[str, str]:
        """Writes `{split}.src` / `{split}.tgt` files; returns their paths."""
        os.makedirs(directory, exist_ok=True)
        paths = {}
        for split in ("train", "valid", "test"):
            pairs = getattr(self, split)
            for side, index in (("src", 0), ("tgt", 1)):
                path = os.path.join(directory, f"{split}.{side}")
                atomic_write_text(path, "".join(pair[index] + "\n" for pair in pairs))
                paths[f"{split}.{side}"] = path
        return paths


def translate(source: str, table: dict[str, list[str]]) -> str:
    words = []
    for word in reversed(source.split()):
        words.extend(table[word])
    return " ".join(words)


def generate_toy_corpus(
    num_train: int = 20000,
    num_valid: int = 500,
    num_test: int = 500,
    min_words: int = 3,
    max_words: int = 10,
    seed: int = 0,
) -> ToyCorpus:
    """Generates the corpus deterministically from `seed`.

    Valid and test sources never occur in train, so the held-out scores
    measure generalisation, not recall.
    """
    if min_words < 1 or max_words < min_words:
        raise ValueError(
            "Need 1 <= min_words <= max_words. Received: "
            f"min_words={min_words}, max_words={max_words}"
        )
    table = _translation_table(seed)
    rng = random.Random(seed + 1)
    seen: set[str] = set()
    splits: dict[str, list[tuple[str, str]]] = {}
    for split, count in (("test", num_test), ("valid", num_valid), ("train", num_train)):
        pairs = []
        attempts = 0
        while len(pairs) < count:
            attempts += 1
            if attempts > 50 * count + 1000:
                raise ValueError(
                    f"Cannot draw {count} distinct {split} sentences of {min_words}.."
                    f"{max_words} words; ask for fewer or allow longer sentences."
                )
            length = rng.randint(min_words, max_words)
            source = " ".join(rng.choice(SOURCE_WORDS) for _ in range(length))
            if source in seen:
                continue
            seen.add(source)
            pairs.append((source, translate(source, table)))
        splits[split] = pairs
    return ToyCorpus(table=table, **splits)


class WordVocabulary(tokenizers.WordVocabulary):
    """Whitespace word vocabulary of `words` after the project's four special pieces.

    The demo uses it on the toy corpus; real text uses SentencePiece. The
    runtime's `WordVocabulary` (encoding, decoding) with saving and building
    from a corpus.
    """

    def __init__(self, words):
        super().__init__(list(SPECIALS) + sorted(set(words) - set(SPECIALS)))

    def save(self, path: str) -> None:
        """Writes one token per line (ids are line numbers), atomically."""
        atomic_write_text(path, "".join(token + "\n" for token in self.tokens))

    @classmethod
    def load(cls, path: str) -> WordVocabulary:
        with open(path, encoding="utf-8") as f:
            tokens = [line.rstrip("\n") for line in f]
        if tuple(tokens[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(
                f"{path} is not a vocabulary file: it must start with {', '.join(SPECIALS)}."
            )
        return cls(tokens[len(SPECIALS) :])

    @classmethod
    def from_corpus(cls, corpus: ToyCorpus) -> WordVocabulary:
        words = set()
        for source, target in corpus.train:
            words.update(source.split())
            words.update(target.split())
        return cls(words)


def encode_pairs(pairs, vocabulary, max_length: int):
    """Pads a list of sentence pairs into model inputs and labels.

    Returns `({"source_ids", "target_ids"}, labels)` as int32 numpy arrays:
    source = tokens + EOS; decoder input = BOS + target; labels = target + EOS.
    """
    sources = [vocabulary.encode(s) + [vocabulary.eos_id] for s, _ in pairs]
    targets = [vocabulary.encode(t) for _, t in pairs]
    longest = max(max(map(len, sources)), max(len(t) + 1 for t in targets))
    if longest > max_length:
        raise ValueError(
            f"A sentence pair needs {longest} positions but max_length={max_length}; "
            "raise max_length or generate shorter sentences."
        )
    src = np.zeros((len(pairs), max(map(len, sources))), np.int32)
    dec = np.zeros((len(pairs), max(len(t) + 1 for t in targets)), np.int32)
    lab = np.zeros_like(dec)
    for i, (s, t) in enumerate(zip(sources, targets, strict=True)):
        src[i, : len(s)] = s
        dec[i, : len(t) + 1] = [vocabulary.bos_id] + t
        lab[i, : len(t) + 1] = t + [vocabulary.eos_id]
    return {"source_ids": src, "target_ids": dec}, lab
