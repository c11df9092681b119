"""Marian's tokenization (OPUS-MT models): two SentencePiece models and `vocab.json`.

A Marian model splits source text with `source.spm` and target text with
`target.spm`, and looks the pieces up in `vocab.json` (one vocabulary for both
sides) or, for models with separate vocabularies, `vocab.json` for the source
and `target_vocab.json` for the target. A piece the vocabulary lacks, such as a
character the SentencePiece model never saw, is `<unk>`; a source may start
with a target-language token such as `>>fra<<`, looked up whole.

Marian's special ids (`</s>` 0, `<unk>` 1, `<pad>` last, and decoding starts
from `<pad>`) are not this project's (pad 0, BOS 1, EOS 2, UNK 3, with every
mask computed as `id != 0`). An imported model therefore keeps one fixed
renumbering of each vocabulary, `marian_order`: our id 0 is a new padding row
that no input attends to, our BOS is Marian's decoder start (`<pad>`, whose
embedding it keeps), EOS and UNK are `</s>` and `<unk>`, and every other piece
follows in Marian's order. Nothing else changes: the model, the export and
the search see an ordinary vocabulary one row larger than Marian's, and
`to_marian` maps ids back (`export --format marian-hf`).
"""

from __future__ import annotations

import json
import os

from keras_transformer_runtime.specials import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_PIECES,
    UNK_ID,
    visible_ids,
)

SOURCE_SPM, TARGET_SPM = "source.spm", "target.spm"
VOCABULARY, TARGET_VOCABULARY = "vocab.json", "target_vocab.json"
# Marian's special pieces, as its tokenizer names them.
MARIAN_EOS, MARIAN_UNK, MARIAN_PAD = "</s>", "<unk>", "<pad>"


def marian_order(vocabulary: dict, start_piece: str = MARIAN_PAD) -> list[int]:
    """Marian's ids in our id order from our id 1 on: the decoder start piece (our
    BOS), `</s>` (EOS), `<unk>` (UNK), then every other id ascending.

    Raises:
        ValueError: the vocabulary is not a piece -> id map over 0..n-1, or lacks
            one of the three special pieces.
    """
    ids = sorted(vocabulary.values()) if isinstance(vocabulary, dict) else None
    if not ids or ids != list(range(len(ids))):
        raise ValueError("a Marian vocabulary maps each piece to one id of 0 .. n-1")
    missing = [p for p in (start_piece, MARIAN_EOS, MARIAN_UNK) if p not in vocabulary]
    if missing:
        raise ValueError(f"the vocabulary has no {', '.join(missing)} piece")
    specials = [vocabulary[start_piece], vocabulary[MARIAN_EOS], vocabulary[MARIAN_UNK]]
    if len(set(specials)) != 3:
        raise ValueError(f"{start_piece}, {MARIAN_EOS} and {MARIAN_UNK} must be three ids")
    taken = set(specials)
    return specials + [i for i in range(len(ids)) if i not in taken]


class _Side:
    """One side's SentencePiece model and vocabulary, in our ids."""

    def __init__(self, model_proto: bytes, vocabulary: dict, name: str):
        import sentencepiece as spm

        try:
            self.processor = spm.SentencePieceProcessor(model_proto=bytes(model_proto))
        except (RuntimeError, OSError) as error:
            raise ValueError(f"{name} is not a SentencePiece model ({error})") from error
        self.model_proto = bytes(model_proto)
        self.vocabulary = dict(vocabulary)
        order = marian_order(self.vocabulary)
        self.to_marian = [-1] + order  # our id -> Marian id (our padding has none)
        by_marian = {m: p for p, m in self.vocabulary.items()}
        self.ours = {by_marian[m]: ours for ours, m in enumerate(self.to_marian) if m >= 0}
        self.pieces = list(SPECIAL_PIECES) + [by_marian[m] for m in order[3:]]

    def encode(self, text: str) -> list[int]:
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [self.ours.get(text[: end + 2], UNK_ID)], text[end + 2 :]
        pieces = self.processor.encode(text, out_type=str)
        return code + [self.ours.get(piece, UNK_ID) for piece in pieces]


class MarianVocabulary:
    """Marian's source and target SentencePiece models with their vocabularies,
    in this project's ids (module docstring).

    Args:
        source_spm, target_spm: bytes of the two SentencePiece models.
        vocabulary: dict piece -> Marian id (`vocab.json`).
        target_vocabulary: dict or None. The target's own `target_vocab.json`;
            None when both sides share `vocabulary`.
    """

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, source_spm, target_spm, vocabulary, target_vocabulary=None):
        self.source = _Side(source_spm, vocabulary, SOURCE_SPM)
        self.target = _Side(target_spm, target_vocabulary or vocabulary, TARGET_SPM)
        self.separate_vocabularies = target_vocabulary is not None

    @classmethod
    def read(cls, folder: str, vocabulary: dict | None = None) -> MarianVocabulary:
        """Reads `source.spm`, `target.spm`, `vocab.json` (and `target_vocab.json`
        when present) from `folder`; a `vocabulary` given (Marian's own YAML one,
        read by the caller) stands for both JSON files.

        Raises:
            FileNotFoundError: a file is missing (the message names it).
            ValueError: a file is not what it should be (the message says why).
        """

        def read_bytes(name):
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Marian tokenizer file missing: {path}")
            with open(path, "rb") as f:
                return f.read()

        def read_json(name):
            try:
                return json.loads(read_bytes(name).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ValueError(f"{os.path.join(folder, name)} is not JSON ({error})") from error

        target = None
        if vocabulary is None and os.path.isfile(os.path.join(folder, TARGET_VOCABULARY)):
            target = read_json(TARGET_VOCABULARY)
        if vocabulary is None:
            vocabulary = read_json(VOCABULARY)
        try:
            return cls(read_bytes(SOURCE_SPM), read_bytes(TARGET_SPM), vocabulary, target)
        except ValueError as error:
            raise ValueError(f"{folder}: {error}") from error

    def write(self, folder: str) -> list[str]:
        """Writes the tokenizer's files into `folder`; returns their names."""
        files = {
            SOURCE_SPM: self.source.model_proto,
            TARGET_SPM: self.target.model_proto,
            VOCABULARY: json.dumps(self.source.vocabulary, ensure_ascii=False).encode(),
        }
        if self.separate_vocabularies:
            files[TARGET_VOCABULARY] = json.dumps(
                self.target.vocabulary, ensure_ascii=False
            ).encode()
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        return list(files)

    @property
    def model_proto(self) -> bytes:
        """Both SentencePiece models' bytes, source first: what identity checks hash."""
        return self.source.model_proto + self.target.model_proto

    def __len__(self) -> int:
        """The target vocabulary's size in our ids (Marian's plus our padding row)."""
        return len(self.target.to_marian)

    @property
    def vocabulary_size(self) -> int:
        return len(self)

    @property
    def source_vocabulary_size(self) -> int:
        return len(self.source.to_marian)

    def encode(self, text: str) -> list[int]:
        """Source ids of `text`, without EOS, as Marian's tokenizer gives them."""
        return self.source.encode(text)

    def encode_batch(self, texts) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_target(self, text: str) -> list[int]:
        """Target ids of `text` (target SentencePiece model and vocabulary), without EOS."""
        return self.target.encode(text)

    def pieces(self, ids) -> list[str]:
        """Target pieces of `ids`; our specials by their own names."""
        return self._side_pieces(self.target, ids)

    def source_pieces(self, ids) -> list[str]:
        """Source pieces of `ids` (the source side's numbering)."""
        return self._side_pieces(self.source, ids)

    @staticmethod
    def _side_pieces(side, ids):
        pieces = side.pieces
        return [
            pieces[int(i)] if 0 <= int(i) < len(pieces) else SPECIAL_PIECES[UNK_ID] for i in ids
        ]

    def id_to_piece(self, i: int) -> str:
        return self.pieces([i])[0]

    def piece_to_id(self, piece: str) -> int:
        return self.target.ours.get(piece, UNK_ID)

    def decode(self, ids) -> str:
        """Target text of `ids`: stops at EOS, skips padding, BOS and `<unk>` (as
        Marian's tokenizer does with `skip_special_tokens=True`)."""
        pieces = [self.target.pieces[i] for i in visible_ids(ids) if i != UNK_ID]
        return self.target.processor.decode_pieces(pieces).replace("\u2581", " ").strip()

    def to_marian(self, ids, side: str = "target") -> list[int]:
        """Our ids as Marian's (padding, which Marian lacks, as its `<pad>`)."""
        table = (self.target if side == "target" else self.source).to_marian
        return [table[int(i)] if int(i) else table[BOS_ID] for i in ids]
