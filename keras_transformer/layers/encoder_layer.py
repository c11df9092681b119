"""One encoder block: self-attention and feed-forward, each with residual and LayerNorm."""

from __future__ import annotations

import keras

from keras_transformer.checks import check_activation
from keras_transformer.layers.feed_forward import FeedForward
from keras_transformer.layers.initializers import clone_initializer
from keras_transformer.layers.multi_head_attention import MultiHeadAttention
from keras_transformer.layers.residual import ResidualBlockMixin


@keras.saving.register_keras_serializable(package="keras_transformer")
class EncoderLayer(ResidualBlockMixin, keras.layers.Layer):
    """A Transformer encoder layer (section 3.1).

    Args:
        hidden_dim: int. Model width (d_model).
        intermediate_dim: int. Feed-forward inner width (d_ff).
        num_heads: int. Attention heads.
        dropout: float. Dropout on sublayer outputs and attention weights.
        attention_dropout: float or None. Dropout on the attention weights
            alone; None = `dropout`. With 0, training can use the fused
            attention kernel.
        normalize_first: bool. Pre-norm if True; post-norm (the paper) if False.
        layer_norm_epsilon: float. Epsilon of the LayerNorms.
        kernel_initializer: initializer of every kernel.

    Call arguments:
        inputs: `(batch_size, seq_len, hidden_dim)`.
        padding_mask: bool/int `(batch_size, seq_len)`; 1 = real token.
        attention_mask: bool/int `(batch_size, seq_len, seq_len)`; 1 = attend.
        training: bool. Whether dropout is active.

    Returns:
        `(batch_size, seq_len, hidden_dim)`.

    Example:

    >>> layer = EncoderLayer(hidden_dim=8, intermediate_dim=16, num_heads=2)
    >>> tuple(layer(np.zeros((2, 5, 8), "float32"), padding_mask=np.ones((2, 5))).shape)
    (2, 5, 8)
    """

    def __init__(
        self,
        hidden_dim,
        intermediate_dim,
        num_heads,
        dropout=0.0,
        attention_dropout=None,
        normalize_first=False,
        layer_norm_epsilon=1e-6,
        kernel_initializer="glorot_uniform",
        activation="relu",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self._validate(hidden_dim, intermediate_dim, num_heads, dropout, attention_dropout)
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.num_heads = num_heads
        self.dropout = float(dropout)
        self.attention_dropout = None if attention_dropout is None else float(attention_dropout)
        self.normalize_first = bool(normalize_first)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.activation = check_activation(activation)

        self.self_attention = MultiHeadAttention(
            num_heads,
            hidden_dim,
            dropout=self._attention_rate(),
            kernel_initializer=clone_initializer(self.kernel_initializer),
            dtype=self.dtype_policy,
            name="self_attention",
        )
        self.self_attention_norm = self._norm("self_attention_norm")
        self.self_attention_dropout = self._dropout("self_attention_dropout")
        self.feed_forward = FeedForward(
            hidden_dim,
            intermediate_dim,
            activation=self.activation,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            dtype=self.dtype_policy,
            name="feed_forward",
        )
        self.feed_forward_norm = self._norm("feed_forward_norm")
        self.feed_forward_dropout = self._dropout("feed_forward_dropout")

    def build(self, inputs_shape):
        self.self_attention.build(inputs_shape)
        self.self_attention_norm.build(inputs_shape)
        self.feed_forward.build(inputs_shape)
        self.feed_forward_norm.build(inputs_shape)
        self.built = True

    def call(self, inputs, padding_mask=None, attention_mask=None, training=None):
        def attend(x):
            return self.self_attention(
                x,
                key_padding_mask=padding_mask,
                attention_mask=attention_mask,
                training=training,
            )

        x = self._residual(
            inputs, self.self_attention_norm, self.self_attention_dropout, attend, training
        )
        return self._residual(
            x,
            self.feed_forward_norm,
            self.feed_forward_dropout,
            lambda y: self.feed_forward(y, training=training),
            training,
        )

    def compute_output_shape(self, inputs_shape):
        return inputs_shape

    def get_config(self):
        config = super().get_config()
        config.update(self._block_config())
        return config
