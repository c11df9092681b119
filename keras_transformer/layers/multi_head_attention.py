"""Scaled dot-product multi-head attention with explicit masks and a key/value cache."""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_transformer.checks import check_positive_int, check_rate
from keras_transformer.layers.dropout import Dropout
from keras_transformer.layers.initializers import clone_initializer
from keras_transformer.layers.masks import merge_masks
from keras_transformer.ops.attention import dot_product_attention, padded_attention
from keras_transformer.ops.linear import linear


@keras.saving.register_keras_serializable(package="keras_transformer")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head scaled dot-product attention (section 3.2 of the paper).

    Self-attention when only `query` is given; cross-attention when `value`
    (and optionally `key`) come from another sequence, e.g. the encoder.
    Scores are soft-maxed in float32 and cast back to the compute dtype. A
    query whose every key is masked gets an all-zero output, not NaN. When
    no attention weight is dropped or returned, the product goes through
    `keras.ops.dot_product_attention` (fused kernels on a GPU) where
    `keras_transformer.ops.set_fused_attention` says so; under JAX on a GPU,
    a 16-bit product masked by key padding alone (plus the causal mask) goes
    to cuDNN's flash kernel with the key lengths (`ops.padded_attention`).

    Args:
        num_heads: int. Number of attention heads.
        hidden_dim: int. Width of the inputs and output; divisible by `num_heads`.
        dropout: float. Dropout rate on the attention weights.
        kernel_initializer: initializer of the projection kernels.
        bias_initializer: initializer of the projection biases.

    Call arguments:
        query: `(batch_size, query_len, hidden_dim)`.
        value: `(batch_size, key_len, hidden_dim)`; defaults to `query`.
        key: `(batch_size, key_len, hidden_dim)`; defaults to `value`.
        attention_mask: bool/int `(batch_size, query_len, key_len)` or
            `(query_len, key_len)`; 1 = attend.
        query_padding_mask: bool/int `(batch_size, query_len)`; 1 = real token.
            Padded queries attend to nothing and output zeros.
        key_padding_mask: bool/int `(batch_size, key_len)`; 1 = real token.
        use_causal_mask: bool. Query i may only attend to keys j <= i (offset
            by `cache_update_index` when decoding with a cache).
        cache: optional `(batch_size, 2, cache_len, num_heads, head_dim)`
            keys (index 0) and values (index 1) from earlier steps.
        cache_update_index: int or scalar tensor. Where the keys and values of
            this call are written into `cache`. With `cache` given and
            `cache_update_index=None`, the cache is read as is (precomputed
            cross-attention keys and values).
        training: bool. Whether dropout is active.
        return_attention_scores: bool. Also return the attention weights
            `(batch_size, num_heads, query_len, key_len)`.

    Returns:
        The output `(batch_size, query_len, hidden_dim)`; with a cache, the
        tuple `(output, cache)`; the weights are appended when
        `return_attention_scores=True`.

    Example:

    >>> mha = MultiHeadAttention(num_heads=2, hidden_dim=8)
    >>> x = np.random.rand(1, 5, 8).astype("float32")
    >>> tuple(mha(x, use_causal_mask=True).shape)
    (1, 5, 8)
    """

    def __init__(
        self,
        num_heads,
        hidden_dim,
        dropout=0.0,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive_int("num_heads", num_heads)
        check_positive_int("hidden_dim", hidden_dim)
        check_rate("dropout", dropout)
        if hidden_dim % num_heads:
            raise ValueError(
                "hidden_dim must be divisible by num_heads. Received: "
                f"hidden_dim={hidden_dim}, num_heads={num_heads}"
            )
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.head_dim = hidden_dim // num_heads
        self.dropout = float(dropout)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

        def projection(name, equation, output_shape, bias_axes):
            return keras.layers.EinsumDense(
                equation,
                output_shape=output_shape,
                bias_axes=bias_axes,
                kernel_initializer=clone_initializer(self.kernel_initializer),
                bias_initializer=clone_initializer(self.bias_initializer),
                dtype=self.dtype_policy,
                name=name,
            )

        heads = (None, num_heads, self.head_dim)
        self.query_dense = projection("query_dense", "btd,dnh->btnh", heads, "nh")
        self.key_dense = projection("key_dense", "btd,dnh->btnh", heads, "nh")
        self.value_dense = projection("value_dense", "btd,dnh->btnh", heads, "nh")
        self.output_dense = projection("output_dense", "btnh,nhd->btd", (None, hidden_dim), "d")
        self.dropout_layer = Dropout(self.dropout, dtype=self.dtype_policy, name="dropout_layer")

    def build(self, query_shape, value_shape=None, key_shape=None):
        value_shape = query_shape if value_shape is None else value_shape
        key_shape = value_shape if key_shape is None else key_shape
        self.query_dense.build(query_shape)
        self.key_dense.build(key_shape)
        self.value_dense.build(value_shape)
        self.output_dense.build(tuple(query_shape[:-1]) + (self.num_heads, self.head_dim))
        self.built = True

    def compute_key_value_cache(self, value, key=None):
        """Projects `value` (and `key`) once into a cache for cross-attention.

        Returns:
            `(batch_size, 2, key_len, num_heads, head_dim)`.
        """
        key = value if key is None else key
        return ops.stack(
            [self._project(self.key_dense, key), self._project(self.value_dense, value)], axis=1
        )

    def _project(self, dense, x):
        """`dense` applied as one 2-D matmul: `(B, T, D)` -> `(B, T, N, H)`, or back.

        The `EinsumDense` layers hold the weights (so checkpoints and the ONNX
        export read them as before), but calling them would make TensorFlow
        broadcast the kernel over the batch in a batched matmul, whose kernel
        gradient is a per-sentence product summed over the batch. Flattening
        the batch and time axes gives one plain matmul forward and backward
        (`linear`, whose bias gradient is a matrix-vector product).
        """
        kernel = ops.cast(dense.kernel, self.compute_dtype)
        bias = ops.cast(dense.bias, self.compute_dtype)
        batch_size, length = ops.shape(x)[0], ops.shape(x)[1]
        rows = ops.reshape(x, (-1, self.hidden_dim))
        y = linear(rows, ops.reshape(kernel, (self.hidden_dim, -1)), ops.reshape(bias, (-1,)))
        if dense is self.output_dense:
            return ops.reshape(y, (batch_size, length, self.hidden_dim))
        return ops.reshape(y, (batch_size, length, self.num_heads, self.head_dim))

    def call(
        self,
        query,
        value=None,
        key=None,
        attention_mask=None,
        query_padding_mask=None,
        key_padding_mask=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
        training=None,
        return_attention_scores=False,
    ):
        value = query if value is None else value
        key = value if key is None else key
        # Scale the queries, not the scores: smaller numbers in float16.
        q = self._project(self.query_dense, query)
        q = q * ops.cast(1.0 / math.sqrt(self.head_dim), self.compute_dtype)
        query_offset = 0
        if cache is not None:
            if cache_update_index is None:  # read-only (cross-attention)
                k, v = cache[:, 0], cache[:, 1]
            else:
                start = (0, cache_update_index, 0, 0)
                k = ops.slice_update(cache[:, 0], start, self._project(self.key_dense, key))
                v = ops.slice_update(cache[:, 1], start, self._project(self.value_dense, value))
                cache = ops.stack([k, v], axis=1)
                query_offset = cache_update_index
        else:
            k = self._project(self.key_dense, key)  # (B, S, N, H)
            v = self._project(self.value_dense, value)  # (B, S, N, H)

        attended, weights = None, None
        if cache is None and attention_mask is None and query_padding_mask is None:
            if key_padding_mask is not None and not return_attention_scores:
                attended = padded_attention(
                    q,
                    k,
                    v,
                    key_padding_mask,
                    causal=use_causal_mask,
                    dropout=self.dropout_layer,
                    training=training,
                )
        if attended is None:
            mask = merge_masks(
                ops.shape(q)[1],
                ops.shape(k)[1],
                attention_mask=attention_mask,
                query_padding_mask=query_padding_mask,
                key_padding_mask=key_padding_mask,
                use_causal_mask=use_causal_mask,
                query_offset=query_offset,
            )
            attended, weights = dot_product_attention(
                q,
                k,
                v,
                mask,
                dropout=self.dropout_layer,
                training=training,
                fused=False if return_attention_scores else None,
            )  # (B, T, N, H)
        output = self._project(self.output_dense, attended)  # (B, T, D)

        outputs = (output,) if cache is None else (output, cache)
        if return_attention_scores:
            outputs = outputs + (weights,)
        return outputs[0] if len(outputs) == 1 else outputs

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "hidden_dim": self.hidden_dim,
                "dropout": self.dropout,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            }
        )
        return config
