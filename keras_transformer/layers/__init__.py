"""The public layers of keras-transformer."""

from keras_transformer.layers.decoder_layer import DecoderLayer
from keras_transformer.layers.encoder_layer import EncoderLayer
from keras_transformer.layers.feed_forward import FeedForward
from keras_transformer.layers.masks import PaddingMask
from keras_transformer.layers.multi_head_attention import MultiHeadAttention
from keras_transformer.layers.positional_embedding import PositionalEmbedding

__all__ = [
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "MultiHeadAttention",
    "PaddingMask",
    "PositionalEmbedding",
]
