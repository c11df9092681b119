"""Scaled dot-product attention: the backend's fused kernel or the plain expression.

The fused path is `keras.ops.dot_product_attention`, which reaches XLA's and
cuDNN's fused attention under JAX on a GPU; `padded_attention` gives cuDNN's flash kernel
the key lengths instead of a mask, where the keys are right-padded. The plain path writes the same
product out with `einsum` and `softmax`, and is the only one that can drop
attention weights or return them. Which path runs is one switch,
`set_fused_attention`; the figures of its ablation are in docs/performance.md
("Training step").
"""

from __future__ import annotations

import keras
from keras import ops

# Filled into masked scores before the softmax. The scores are float32 there,
# but the value is also finite in float16, so a mask never overflows whatever
# the compute dtype.
MASKED_SCORE = -65504.0

# None = automatic (see `fused_attention_enabled`); True / False force a path.
_fused = {"enabled": None}


def set_fused_attention(enabled):
    """Chooses the attention path: True = fused, False = plain, None = automatic.

    Automatic is fused on JAX's and torch's CPUs, and plain elsewhere. On
    TensorFlow, `keras.ops.dot_product_attention` is the same
    einsum-softmax-einsum graph with an extra full-size mask, and the plain
    path measured faster on the CPU. Under JAX on a GPU, the fused kernels
    take the mask as a full-size bias and measured 12% slower than the plain
    path in a training step; there the automatic choice is cuDNN's flash
    kernel with key lengths where the mask allows (`padded_attention`, as
    fast as the plain path at sentence lengths, in memory linear in the
    length), else the plain path. False turns `padded_attention` off too.
    Figures: docs/performance.md, "Training step" (the `attention` ablation).

    Example:

    >>> set_fused_attention(False)  # always the plain expression
    >>> set_fused_attention(None)  # back to the automatic choice
    """
    if enabled not in (None, True, False):
        raise ValueError(f"enabled must be True, False or None. Received: enabled={enabled!r}")
    _fused["enabled"] = enabled


def fused_attention_enabled():
    """Whether attention takes the fused path when nothing requires the plain one."""
    if _fused["enabled"] is not None:
        return _fused["enabled"]
    backend = keras.backend.backend()
    return backend != "tensorflow" and not (backend == "jax" and _on_gpu())


def _on_gpu():
    import jax

    return jax.devices()[0].platform == "gpu"


def dot_product_attention(query, key, value, mask=None, dropout=None, training=None, fused=None):
    """Softmax attention of pre-scaled queries over keys, in float32.

    Args:
        query: `(batch_size, query_len, num_heads, head_dim)`, already
            multiplied by `1 / sqrt(head_dim)`.
        key: `(batch_size, key_len, num_heads, head_dim)`.
        value: `(batch_size, key_len, num_heads, head_dim)`.
        mask: optional bool `(batch_size or 1, query_len, key_len)`; True =
            attend.
        dropout: optional dropout layer applied to the attention weights.
        training: bool. Whether `dropout` is active.
        fused: None = `fused_attention_enabled()`; False forces the plain path
            (needed to return the weights).

    Returns:
        `(attended, weights)`: the attended values `(batch_size, query_len,
        num_heads, head_dim)` in the compute dtype, and the weights
        `(batch_size, num_heads, query_len, key_len)` from the plain path, or
        None from the fused one. Scores are soft-maxed in float32 on both
        paths. Queries with no key to attend to get zeros (and zero weights),
        not the uniform average.
    """
    fused = fused_attention_enabled() if fused is None else fused
    weights_dropped = dropout is not None and dropout.rate > 0 and bool(training)
    if mask is not None:
        mask = ops.expand_dims(mask, 1)  # (B, 1, T, S)
    if fused and not weights_dropped:
        attended = ops.dot_product_attention(query, key, value, mask=mask, scale=1.0)
        weights = None
    else:
        scores = ops.cast(ops.einsum("btnh,bsnh->bnts", query, key), "float32")  # (B, N, T, S)
        if mask is not None:
            scores = ops.where(mask, scores, MASKED_SCORE)
        if scores.shape[-1] == 1:
            # One key: every weight is 1 (ops.softmax would warn here, at the
            # first step of uncached decoding).
            weights = ops.ones_like(scores)
        else:
            # The backend's fused softmax: its gradient needs only its output.
            weights = ops.softmax(scores, axis=-1)
        weights = ops.cast(weights, query.dtype)
        dropped = weights if dropout is None else dropout(weights, training=training)
        attended = ops.einsum("bnts,bsnh->btnh", dropped, value)  # (B, T, N, H)
    if mask is not None:
        # A query whose every key is masked got uniform weights: zero it here,
        # on (B, T, N, H) rather than on the larger weights. `where`, not a
        # product, so that a kernel's NaN for an empty row cannot leak through.
        has_key = ops.any(mask, axis=-1)  # (B, 1, T)
        row_has_key = ops.expand_dims(ops.transpose(has_key, (0, 2, 1)), -1)  # (B, T, 1, 1)
        attended = ops.where(row_has_key, attended, ops.zeros((), attended.dtype))
        if weights is not None:
            weights = weights * ops.cast(ops.expand_dims(has_key, -1), weights.dtype)
    return attended, weights


def padded_attention(
    query, key, value, key_padding_mask, causal=False, dropout=None, training=None
):
    """cuDNN's flash attention for right-padded keys, under JAX on a GPU; else None.

    The general kernels take the mask as a full `(B, 1, T, S)` bias. For
    the masks the Transformer uses (key padding, optionally causal), cuDNN
    only needs each sentence's key length, which its flash kernel skips
    over. That holds when every key padding mask is a run of real tokens
    followed by padding: checked in the graph, and where it fails the batch
    takes the general path (`lax.cond`: only one branch runs).

    Returns the attended values `(B, T, N, H)`, or None where this path does
    not apply: another backend or device, float32 (the kernel is 16-bit),
    `set_fused_attention(False)`, dropout on the attention weights in
    training, or a cuDNN that refuses the shapes. The caller then takes
    `dot_product_attention`.
    """
    if keras.backend.backend() != "jax" or _fused["enabled"] is False:
        return None
    if dropout is not None and dropout.rate > 0 and bool(training):
        return None
    if str(query.dtype) not in ("bfloat16", "float16"):
        return None
    if not _on_gpu():
        return None
    import jax
    import jax.numpy as jnp

    keep = jnp.asarray(key_padding_mask).astype(bool)  # (B, S)
    lengths = jnp.sum(keep, axis=-1, dtype=jnp.int32)
    right_padded = jnp.all(keep == (jnp.arange(keep.shape[-1])[None, :] < lengths[:, None]))

    def flash(q, k, v):
        # A sentence of no real key attends to its first key, then is zeroed
        # below, as the general path zeroes it (cuDNN is not asked for length 0).
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            scale=1.0,
            is_causal=causal,
            key_value_seq_lengths=jnp.maximum(lengths, 1),
            implementation="cudnn",
        )

    def general(q, k, v):
        from keras_transformer.layers.masks import merge_masks

        mask = merge_masks(q.shape[1], k.shape[1], key_padding_mask=keep, use_causal_mask=causal)
        return dot_product_attention(q, k, v, mask, fused=True)[0]

    try:
        attended = jax.lax.cond(right_padded, flash, general, query, key, value)
    except Exception:  # cuDNN (or this JAX) refuses the shapes: the general path
        return None
    # Causal or not, a query sees no key exactly when its sentence has none.
    has_key = (lengths > 0)[:, None, None, None]
    return jnp.where(has_key, attended, jnp.zeros((), attended.dtype))
