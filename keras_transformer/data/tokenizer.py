"""A joint SentencePiece vocabulary: training, Python encoding, and tf.data tokenization.

One model covers source and target text, so that the shared embedding of the
paper (section 3.4) sees the same piece ids on both sides. The special ids are
fixed for training, decoding and export: pad 0, BOS 1, EOS 2, UNK 3.

The model uses the identity normalization, keeps every space as written and
falls back to UTF-8 bytes for characters it has never seen, so that
`decode(encode(text)) == text` for any text, emoji and CJK included.
"""

from __future__ import annotations

import io
import os

import sentencepiece as spm
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from keras_transformer_runtime.tokenizers import SentencePieceModel

from keras_transformer.checks import check_positive_int
from keras_transformer.io_utils import atomic_path

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID", "SentencePieceTokenizer", "train_sentencepiece"]
# Byte pieces (256) + the four specials; below this the byte fallback cannot fit.
MIN_VOCABULARY_SIZE = 300
DEFAULT_VOCABULARY_SIZE = 8000


def train_sentencepiece(
    texts,
    vocabulary_size: int = DEFAULT_VOCABULARY_SIZE,
    model_type: str = "unigram",
    max_sentences: int = 2_000_000,
    seed: int = 0,
) -> SentencePieceTokenizer:
    """Trains a SentencePiece model on an iterable of sentences.

    Pass the source and the target sentences together (e.g. `src + tgt`) to
    get one joint vocabulary.

    Args:
        texts: iterable of str. Training sentences; empty ones are skipped.
        vocabulary_size: int. Number of pieces, the four specials and the
            256 byte pieces included. An upper bound: text too small to
            support it gives a smaller vocabulary.
        model_type: str. `"unigram"` (SentencePiece's default) or `"bpe"`.
        max_sentences: int. Sentences sampled for training when there are more.
        seed: int. Seeds SentencePiece's sampling of `max_sentences`.

    Returns:
        A `SentencePieceTokenizer`.
    """
    check_positive_int("vocabulary_size", vocabulary_size)
    if vocabulary_size < MIN_VOCABULARY_SIZE:
        raise ValueError(
            f"vocabulary_size must be at least {MIN_VOCABULARY_SIZE} (256 byte pieces and "
            f"the special tokens). Received: vocabulary_size={vocabulary_size}"
        )
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"model_type must be 'unigram' or 'bpe'. Received: {model_type!r}")
    sentences = [t for t in texts if t.strip()]
    if not sentences:
        raise ValueError("Cannot train a SentencePiece model: no non-empty sentences given.")
    spm.set_random_generator_seed(seed)
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=buffer,
            vocab_size=vocabulary_size,
            # A small corpus may not support the size asked for; it then gets
            # fewer pieces (check `vocabulary_size`) instead of an error.
            hard_vocab_limit=False,
            model_type=model_type,
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            pad_id=PAD_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as error:
        # SentencePiece refuses a vocabulary larger than the text supports.
        raise ValueError(
            f"SentencePiece training failed with vocabulary_size={vocabulary_size} on "
            f"{len(sentences)} sentences: {error}"
        ) from error
    return SentencePieceTokenizer(buffer.getvalue())


class SentencePieceTokenizer(SentencePieceModel):
    """A SentencePiece model held as bytes, usable from Python and inside tf.data.

    The runtime's `SentencePieceModel` (encoding, decoding, the special-id
    check) with loading, saving and a tf.data tokenizer.

    Args:
        model_proto: bytes. A serialized SentencePiece model (`spm.model`).

    Example:

    >>> tokenizer = SentencePieceTokenizer.load("runs/de-en/spm.model")  # doctest: +SKIP
    >>> tokenizer.decode(tokenizer.encode("Ein Hund läuft."))  # doctest: +SKIP
    'Ein Hund läuft.'
    """

    @classmethod
    def load(cls, path: str) -> SentencePieceTokenizer:
        """Reads a `.model` file; a missing or corrupt file raises a clear error."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"SentencePiece model not found: {path}")
        with open(path, "rb") as f:
            data = f.read()
        try:
            return cls(data)
        except ValueError as error:
            raise ValueError(f"{path} is not a valid SentencePiece model: {error}") from error

    def save(self, path: str) -> None:
        """Writes the model bytes to `path` atomically."""
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(self.model_proto)

    def tf_tokenizer(self, nbest_size: int = 0, alpha: float = 1.0, side: str = "source"):
        """A new `tensorflow_text.SentencepieceTokenizer` on the same model bytes (int32 ids).

        A new one per call: its TensorFlow resource belongs to the context it
        was made in, and a cached one can outlive that context. The default
        gives the one best segmentation; `nbest_size` (-1 or at least 2) and
        `alpha` make it sample one (`keras_transformer.data.pipeline.SubwordSampling`).
        `side` is for tokenizers with one model per side (Marian's); one joint
        model serves both.
        """
        import tensorflow as tf
        import tensorflow_text

        from keras_transformer.startup import quiet_native_stderr

        with quiet_native_stderr():
            return tensorflow_text.SentencepieceTokenizer(
                model=self.model_proto, out_type=tf.int32, nbest_size=nbest_size, alpha=alpha
            )
