"""The two tokenizers of an export: a SentencePiece model and the demo's word vocabulary.

Both keep the project's special ids (`keras_transformer_runtime.specials`)
and decode by its one rule: stop at EOS, skip padding and BOS. The training
side (`keras_transformer.data`) extends these classes with training, saving
and tf.data.
"""

from __future__ import annotations

import os

from keras_transformer_runtime.marian_vocabulary import VOCABULARY, MarianVocabulary
from keras_transformer_runtime.specials import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_PIECES,
    UNK_ID,
    visible_ids,
)


class SentencePieceModel:
    """A SentencePiece model held as bytes, checked to use the project's special ids.

    Args:
        model_proto: bytes. A serialized SentencePiece model (`spm.model`).

    Raises:
        ValueError: the bytes are not a SentencePiece model, or its special
            ids differ from pad 0, BOS 1, EOS 2, UNK 3.
    """

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, model_proto: bytes):
        import sentencepiece as spm

        self.model_proto = bytes(model_proto)
        try:
            self._processor = spm.SentencePieceProcessor(model_proto=self.model_proto)
        except (RuntimeError, OSError) as error:
            raise ValueError(f"not a SentencePiece model ({error})") from error
        expected = {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID, "unk": UNK_ID}
        actual = {
            "pad": self._processor.pad_id(),
            "bos": self._processor.bos_id(),
            "eos": self._processor.eos_id(),
            "unk": self._processor.unk_id(),
        }
        if actual != expected:
            raise ValueError(
                f"The SentencePiece model has special ids {actual}; this package needs "
                f"{expected}. Train it with `keras_transformer.data.train_sentencepiece`."
            )

    def __len__(self) -> int:
        return self._processor.get_piece_size()

    @property
    def vocabulary_size(self) -> int:
        return len(self)

    def encode(self, text: str) -> list[int]:
        """Piece ids of `text`, without BOS or EOS."""
        return self._processor.encode(text, out_type=int)

    def encode_batch(self, texts) -> list[list[int]]:
        return self._processor.encode(list(texts), out_type=int)

    def encode_target(self, text: str) -> list[int]:
        """Target-side ids: the same as `encode` (one joint model)."""
        return self.encode(text)

    def decode(self, ids) -> str:
        """Text of `ids`; stops at the first EOS and skips pad and BOS."""
        return self._processor.decode(visible_ids(ids))

    def id_to_piece(self, i: int) -> str:
        return self._processor.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self._processor.piece_to_id(piece)

    def pieces(self, ids) -> list[str]:
        return [self.id_to_piece(i) for i in ids]

    def source_pieces(self, ids) -> list[str]:
        """Pieces of source ids: one joint model, so `pieces`."""
        return self.pieces(ids)


class WordVocabulary:
    """A whitespace word vocabulary: `tokens[i]` is the word of id i.

    Args:
        tokens: every token in id order, starting with the four special pieces
            `<pad> <s> </s> <unk>` (the lines of a `vocab.txt`).
    """

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, tokens):
        self.tokens = list(tokens)
        if tuple(self.tokens[: len(SPECIAL_PIECES)]) != SPECIAL_PIECES:
            raise ValueError(
                f"not a vocabulary: it must start with {' '.join(SPECIAL_PIECES)}, one per line"
            )
        self.index = {token: i for i, token in enumerate(self.tokens)}

    @classmethod
    def read(cls, path: str):
        """Reads a `vocab.txt` (one token per line, ids are line numbers)."""
        with open(path, encoding="utf-8") as f:
            return cls([line.rstrip("\n") for line in f])

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        return [self.index.get(word, UNK_ID) for word in text.split()]

    def encode_target(self, text: str) -> list[int]:
        return self.encode(text)

    def pieces(self, ids) -> list[str]:
        unknown = SPECIAL_PIECES[UNK_ID]
        return [self.tokens[int(i)] if int(i) < len(self.tokens) else unknown for i in ids]

    def source_pieces(self, ids) -> list[str]:
        """Words of source ids: one vocabulary, so `pieces`."""
        return self.pieces(ids)

    def decode(self, ids) -> str:
        """Words of `ids` joined by spaces; stops at the first EOS and skips pad and BOS."""
        return " ".join(self.pieces(visible_ids(ids)))


def load_tokenizer(path: str):
    """The tokenizer in `path`: a SentencePiece `.model`, Marian's `vocab.json` (with
    `source.spm` and `target.spm` beside it), otherwise a `vocab.txt`.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a tokenizer file (the message says why).
    """
    if path.endswith(".model"):
        with open(path, "rb") as f:
            return SentencePieceModel(f.read())
    if os.path.basename(path) == VOCABULARY:
        return MarianVocabulary.read(os.path.dirname(path) or ".")
    try:
        return WordVocabulary.read(path)
    except UnicodeDecodeError as error:
        raise ValueError(f"not a UTF-8 vocabulary ({error})") from error
