"""One decoder block: causal self-attention, cross-attention and feed-forward."""

from __future__ import annotations

import keras

from keras_transformer.checks import check_activation
from keras_transformer.layers.feed_forward import FeedForward
from keras_transformer.layers.initializers import clone_initializer
from keras_transformer.layers.multi_head_attention import MultiHeadAttention
from keras_transformer.layers.residual import ResidualBlockMixin


@keras.saving.register_keras_serializable(package="keras_transformer")
class DecoderLayer(ResidualBlockMixin, keras.layers.Layer):
    """A Transformer decoder layer (section 3.1).

    Self-attention is always causal. For step-by-step decoding pass a
    self-attention cache with its update index, and a precomputed
    cross-attention cache (see `MultiHeadAttention.compute_key_value_cache`);
    the layer then returns the updated caches too.

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
        decoder_sequence: `(batch_size, target_len, hidden_dim)`.
        encoder_sequence: `(batch_size, source_len, hidden_dim)`. May be None
            when `cross_attention_cache` is given.
        decoder_padding_mask: bool/int `(batch_size, target_len)` (or the
            cache length when decoding with a cache); 1 = real token.
        encoder_padding_mask: bool/int `(batch_size, source_len)`; 1 = real token.
        self_attention_cache: `(batch_size, 2, max_len, num_heads, head_dim)`.
        self_attention_cache_update_index: int or scalar tensor, the absolute
            position of the first token of `decoder_sequence`.
        cross_attention_cache: `(batch_size, 2, source_len, num_heads, head_dim)`.
        training: bool. Whether dropout is active.
        return_attention_scores: bool. Also return the cross-attention weights
            `(batch_size, num_heads, target_len, source_len)`.

    Returns:
        `(batch_size, target_len, hidden_dim)`; with caches, the tuple
        `(output, self_attention_cache, cross_attention_cache)`; the
        cross-attention weights are appended when asked for.

    Example:

    >>> layer = DecoderLayer(hidden_dim=8, intermediate_dim=16, num_heads=2)
    >>> y, x = np.zeros((2, 4, 8), "float32"), np.zeros((2, 6, 8), "float32")
    >>> tuple(layer(y, x).shape)
    (2, 4, 8)
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

        def attention(name):
            return MultiHeadAttention(
                num_heads,
                hidden_dim,
                dropout=self._attention_rate(),
                kernel_initializer=clone_initializer(self.kernel_initializer),
                dtype=self.dtype_policy,
                name=name,
            )

        self.self_attention = attention("self_attention")
        self.self_attention_norm = self._norm("self_attention_norm")
        self.self_attention_dropout = self._dropout("self_attention_dropout")
        self.cross_attention = attention("cross_attention")
        self.cross_attention_norm = self._norm("cross_attention_norm")
        self.cross_attention_dropout = self._dropout("cross_attention_dropout")
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

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        if encoder_sequence_shape is None:
            encoder_sequence_shape = decoder_sequence_shape
        self.self_attention.build(decoder_sequence_shape)
        self.cross_attention.build(decoder_sequence_shape, encoder_sequence_shape)
        for norm in (self.self_attention_norm, self.cross_attention_norm, self.feed_forward_norm):
            norm.build(decoder_sequence_shape)
        self.feed_forward.build(decoder_sequence_shape)
        self.built = True

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        encoder_padding_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        training=None,
        return_attention_scores=False,
    ):
        use_cache = self_attention_cache is not None
        if encoder_sequence is None and cross_attention_cache is None:
            raise ValueError("DecoderLayer needs `encoder_sequence` or `cross_attention_cache`.")
        if use_cache and self_attention_cache_update_index is None:
            raise ValueError(
                "`self_attention_cache_update_index` is required with `self_attention_cache`."
            )
        state = {}

        def self_attend(x):
            result = self.self_attention(
                x,
                key_padding_mask=decoder_padding_mask,
                use_causal_mask=True,
                cache=self_attention_cache,
                cache_update_index=self_attention_cache_update_index,
                training=training,
            )
            if use_cache:
                result, state["self_cache"] = result
            return result

        def cross_attend(x):
            result = self.cross_attention(
                x,
                encoder_sequence,
                key_padding_mask=encoder_padding_mask,
                cache=cross_attention_cache,
                training=training,
                return_attention_scores=return_attention_scores,
            )
            if not isinstance(result, tuple):
                return result
            if return_attention_scores:
                state["scores"] = result[-1]
            return result[0]  # a read-only cross-attention cache comes back unchanged

        x = self._residual(
            decoder_sequence,
            self.self_attention_norm,
            self.self_attention_dropout,
            self_attend,
            training,
        )
        x = self._residual(
            x, self.cross_attention_norm, self.cross_attention_dropout, cross_attend, training
        )
        x = self._residual(
            x,
            self.feed_forward_norm,
            self.feed_forward_dropout,
            lambda y: self.feed_forward(y, training=training),
            training,
        )
        outputs = (x,)
        if use_cache:
            if cross_attention_cache is None:
                cross_attention_cache = self.cross_attention.compute_key_value_cache(
                    encoder_sequence
                )
            outputs += (state["self_cache"], cross_attention_cache)
        if return_attention_scores:
            outputs += (state["scores"],)
        return outputs[0] if len(outputs) == 1 else outputs

    def get_config(self):
        config = super().get_config()
        config.update(self._block_config())
        return config
