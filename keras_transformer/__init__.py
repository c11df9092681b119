"""keras-transformer: the Transformer of "Attention Is All You Need" for Keras 3."""

import sys

from keras_transformer.startup import (
    prefer_onednn,
    quiet_tensorflow_start,
    relaunch_with_huge_pages,
)

if sys.platform.startswith("linux"):  # glibc: the command under JAX, before anything heavy loads
    relaunch_with_huge_pages()

with quiet_tensorflow_start():  # the command line only; importing keras imports TensorFlow
    prefer_onednn()  # before TensorFlow loads: it reads the variable once
    import keras  # noqa: F401

from keras_transformer.config import PRESETS, TransformerConfig
from keras_transformer.layers import (
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    MultiHeadAttention,
    PositionalEmbedding,
)
from keras_transformer.losses import LabelSmoothedCrossEntropy, MaskedAccuracy
from keras_transformer.model import TransformerParts, build_transformer, transformer_parts
from keras_transformer.pretrained.marian import from_marian
from keras_transformer.schedules import TransformerSchedule, transformer_optimizer

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "LabelSmoothedCrossEntropy",
    "MaskedAccuracy",
    "MultiHeadAttention",
    "PositionalEmbedding",
    "TransformerConfig",
    "TransformerParts",
    "TransformerSchedule",
    "build_transformer",
    "from_marian",
    "transformer_optimizer",
    "transformer_parts",
]
