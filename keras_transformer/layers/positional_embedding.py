"""Token embedding plus the fixed sinusoidal position table of the paper."""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops
from keras_transformer_runtime.specials import BOS_ID

from keras_transformer.checks import check_positional_layout, check_positive_int, check_rate
from keras_transformer.layers.dropout import Dropout


def sinusoid_table(max_length: int, hidden_dim: int, layout: str = "interleaved") -> np.ndarray:
    """Returns the `(max_length, hidden_dim)` float32 table of section 3.5.

    PE[pos, 2i] = sin(pos / 10000^(2i / d)) and PE[pos, 2i + 1] = cos(pos / 10000^(2i / d)).
    With `layout="concatenated"` the same values sit as `[sin(...) for each i,
    cos(...) for each i]`: the first ceil(d / 2) columns are the sines.
    """
    check_positional_layout(layout)
    positions = np.arange(max_length, dtype=np.float64)[:, None]
    even = np.arange(0, hidden_dim, 2, dtype=np.float64)
    angles = positions / np.power(10000.0, even / hidden_dim)  # (L, ceil(d / 2))
    if layout == "concatenated":
        table = np.concatenate([np.sin(angles), np.cos(angles[:, : hidden_dim // 2])], axis=1)
        return table.astype(np.float32)
    table = np.zeros((max_length, hidden_dim), dtype=np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : hidden_dim // 2])
    return table.astype(np.float32)


def sinusoid_frequencies(hidden_dim: int) -> np.ndarray:
    """The float32 `1 / 10000^(2i / d)` of each sin/cos pair of section 3.5, `(ceil(d / 2),)`."""
    even = np.arange(0, hidden_dim, 2, dtype=np.float64)
    return (1.0 / np.power(10000.0, even / hidden_dim)).astype(np.float32)


def positional_encoding(positions, table, frequencies, layout="interleaved"):
    """Sinusoids of int `positions` `(T,)`, any of them, as float32 `(T, hidden_dim)`.

    Positions inside `table` are read from it (computed in float64, so exact);
    later ones are computed in float32 from `frequencies`, which is what lets
    the model take sequences longer than the table, as the paper intends
    (section 3.5: sinusoids "may allow the model to extrapolate").
    """
    length, hidden_dim = table.shape
    positions = ops.cast(positions, "int32")
    from_table = ops.take(table, ops.minimum(positions, length - 1), axis=0)
    angles = ops.cast(positions, "float32")[:, None] * frequencies[None, :]  # (T, ceil(d/2))
    if layout == "concatenated":
        both = ops.concatenate([ops.sin(angles), ops.cos(angles)], axis=-1)
    else:
        pairs = ops.stack([ops.sin(angles), ops.cos(angles)], axis=-1)  # (T, ceil(d/2), 2)
        both = ops.reshape(pairs, (-1, 2 * frequencies.shape[0]))
    computed = both[:, :hidden_dim]
    return ops.where(ops.less(positions, length)[:, None], from_table, computed)


@keras.saving.register_keras_serializable(package="keras_transformer")
class ZeroStartRow(keras.constraints.Constraint):
    """Keeps the decoder's start row (BOS) of an embedding at zero through training.

    Marian starts decoding from a zero vector, and so does CTranslate2 for its
    models; a model imported from one keeps that row zero while it is
    fine-tuned (PyTorch's `padding_idx` does the same for transformers).
    """

    def __call__(self, w):
        rows = ops.arange(ops.shape(w)[0])[:, None]
        return ops.where(ops.equal(rows, BOS_ID), ops.zeros_like(w), w)

    def get_config(self):
        return {}


@keras.saving.register_keras_serializable(package="keras_transformer")
class PositionalEmbedding(keras.layers.Layer):
    """Scaled token embedding plus sinusoidal positions, then dropout.

    The embedding matrix is scaled by `sqrt(hidden_dim)` on the way in
    (section 3.4) and can be reused as the output projection with
    `reverse=True`, which gives the tied softmax weights of the paper.

    Args:
        vocabulary_size: int. Number of token ids; id 0 is padding.
        hidden_dim: int. Width of the embedding (d_model).
        max_length: int. Positions the exact float64 table covers (the
            longest training sequence); later positions are computed in
            float32, so any length is accepted.
        dropout: float. Dropout rate applied to the summed embedding.
        embeddings_initializer: initializer of the embedding matrix.
        positional_layout: `"interleaved"` (the paper's sin/cos pairs) or
            `"concatenated"` (all sines, then all cosines: Marian's).
        embedding_scale: float or None. Factor on the embeddings on the way
            in; None is the paper's `sqrt(hidden_dim)`.
        output_bias: bool. Whether the reverse (output) projection adds a
            learned `(vocabulary_size,)` bias, as Marian's `final_logits_bias`.
        zero_start: bool. The start token's row (BOS) stays zero in training
            (`ZeroStartRow`), as the decoder start of Marian models.

    Call arguments:
        inputs: int tensor `(batch_size, seq_len)` of token ids, or, with
            `reverse=True`, a float tensor `(batch_size, seq_len, hidden_dim)`.
        start_index: int or scalar tensor. Absolute position of the first
            token, used when decoding one step at a time. Defaults to 0.
        reverse: bool. If True, project hidden states onto the vocabulary with
            the transposed embedding matrix and return float32 logits.
        training: bool. Whether dropout is active.

    Returns:
        `(batch_size, seq_len, hidden_dim)` in the compute dtype, or float32
        logits `(batch_size, seq_len, vocabulary_size)` with `reverse=True`.

    Example:

    >>> layer = PositionalEmbedding(vocabulary_size=100, hidden_dim=16, max_length=32)
    >>> tuple(layer(np.array([[5, 7, 0]])).shape)
    (1, 3, 16)
    """

    def __init__(
        self,
        vocabulary_size,
        hidden_dim,
        max_length,
        dropout=0.0,
        embeddings_initializer="glorot_uniform",
        positional_layout="interleaved",
        embedding_scale=None,
        output_bias=False,
        zero_start=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("vocabulary_size", vocabulary_size)
        check_positive_int("hidden_dim", hidden_dim)
        check_positive_int("max_length", max_length)
        check_rate("dropout", dropout)
        self.vocabulary_size = vocabulary_size
        self.hidden_dim = hidden_dim
        self.max_length = max_length
        self.dropout = float(dropout)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.positional_layout = check_positional_layout(positional_layout)
        self.embedding_scale = None if embedding_scale is None else float(embedding_scale)
        self.output_bias = bool(output_bias)
        self.zero_start = bool(zero_start)
        self._table = sinusoid_table(max_length, hidden_dim, positional_layout)
        self._frequencies = sinusoid_frequencies(hidden_dim)
        self._scale = math.sqrt(hidden_dim) if embedding_scale is None else float(embedding_scale)
        self.dropout_layer = Dropout(self.dropout, dtype=self.dtype_policy, name="dropout_layer")

    def build(self, input_shape=None):
        self._embeddings = self.add_weight(
            shape=(self.vocabulary_size, self.hidden_dim),
            initializer=self.embeddings_initializer,
            constraint=ZeroStartRow() if self.zero_start else None,
            name="embeddings",
        )
        self._output_bias = None
        if self.output_bias:
            self._output_bias = self.add_weight(
                shape=(self.vocabulary_size,), initializer="zeros", name="output_bias"
            )
        self.built = True

    @property
    def embeddings(self):
        """The `(vocabulary_size, hidden_dim)` embedding matrix (a variable)."""
        return self._embeddings

    @property
    def logits_bias(self):
        """The `(vocabulary_size,)` output bias variable, or None without one."""
        return self._output_bias

    def call(self, inputs, start_index=0, reverse=False, training=None):
        if reverse:
            kernel = ops.cast(ops.transpose(self._embeddings), self.compute_dtype)
            x = ops.cast(inputs, self.compute_dtype)
            if keras.backend.backend() == "jax":
                # On rows: XLA's CPU code for the kernel's gradient of the 3-D
                # product first writes out the logits' gradient transposed,
                # 2.3x the time of the projection and loss on rows
                # (docs/performance.md, "JAX on a CPU").
                rows = ops.matmul(ops.reshape(x, (-1, ops.shape(x)[-1])), kernel)
                logits = ops.reshape(rows, (*ops.shape(x)[:-1], ops.shape(kernel)[-1]))
            else:
                logits = ops.matmul(x, kernel)
            logits = ops.cast(logits, "float32")
            if self._output_bias is not None:
                logits = logits + ops.cast(self._output_bias, "float32")
            return logits
        x = ops.take(self._embeddings, ops.cast(inputs, "int32"), axis=0)  # (B, T, D)
        x = ops.cast(x, self.compute_dtype) * ops.cast(self._scale, self.compute_dtype)
        positions = ops.arange(ops.shape(inputs)[1], dtype="int32") + start_index  # (T,)
        encoding = positional_encoding(
            positions,
            ops.convert_to_tensor(self._table),
            ops.convert_to_tensor(self._frequencies),
            self.positional_layout,
        )
        x = x + ops.cast(encoding, self.compute_dtype)[None]
        return self.dropout_layer(x, training=training)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "hidden_dim": self.hidden_dim,
                "max_length": self.max_length,
                "dropout": self.dropout,
                "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
                "positional_layout": self.positional_layout,
                "embedding_scale": self.embedding_scale,
                "output_bias": self.output_bias,
                "zero_start": self.zero_start,
            }
        )
        return config
