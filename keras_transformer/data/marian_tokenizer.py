"""Marian's tokenization on the training side: the runtime's `MarianVocabulary`
with saving and a tf.data tokenizer per side (the same ids as in Python)."""

from __future__ import annotations

from keras_transformer_runtime.marian_vocabulary import MarianVocabulary
from keras_transformer_runtime.specials import UNK_ID


class MarianTokenizer(MarianVocabulary):
    """`MarianVocabulary` (two SentencePiece models and `vocab.json`, in this
    project's ids) with `save` and `tf_tokenizer`.

    Example:

    >>> tokenizer = MarianTokenizer.load("runs/opus-mt-de-en")  # doctest: +SKIP
    >>> tokenizer.decode(tokenizer.encode_target("Ein Hund läuft."))  # doctest: +SKIP
    'Ein Hund läuft.'
    """

    @classmethod
    def load(cls, folder: str) -> MarianTokenizer:
        return cls.read(folder)

    def save(self, folder: str) -> list[str]:
        """Writes the tokenizer files into `folder` (an unfinished run or staging folder)."""
        return self.write(folder)

    def tf_tokenizer(self, nbest_size: int = 0, alpha: float = 1.0, side: str = "source"):
        """A tf.data tokenizer of one side: `tokenize(strings)` gives int32 ragged ids.

        SentencePiece splits inside TensorFlow (tensorflow-text) into pieces,
        and a lookup table maps them to ids, `<unk>` for pieces the vocabulary
        lacks, as `encode` and Marian's tokenizer do. A leading language token
        such as `>>fra<<` is looked up whole only by the Python `encode`.
        """
        if side not in ("source", "target"):
            raise ValueError(f"side must be 'source' or 'target'. Received: {side!r}")
        return _TfSide(self.source if side == "source" else self.target, nbest_size, alpha)


class _TfSide:
    def __init__(self, side, nbest_size, alpha):
        import tensorflow as tf
        import tensorflow_text

        from keras_transformer.startup import quiet_native_stderr

        with quiet_native_stderr():
            self._pieces = tensorflow_text.SentencepieceTokenizer(
                model=side.model_proto, out_type=tf.string, nbest_size=nbest_size, alpha=alpha
            )
        keys = list(side.ours)
        self._table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(keys, tf.string),
                tf.constant([side.ours[k] for k in keys], tf.int32),
            ),
            default_value=UNK_ID,
        )

    def tokenize(self, texts):
        import tensorflow as tf

        pieces = self._pieces.tokenize(texts)
        if isinstance(pieces, tf.RaggedTensor):
            return pieces.with_flat_values(self._table.lookup(pieces.flat_values))
        return self._table.lookup(pieces)
