"""Scaled dot-product attention: the backend's fused kernel or the plain expression.

The fused path is `keras.ops.dot_product_attention`, which reaches XLA's and
cuDNN's fused attention under JAX on a GPU. The plain path writes the same
product out with `einsum` and `softmax`, and is the only one that can drop
attention weights or return them. Which path runs is one switch,
`set_fused_attention`; the ablation command is `python -m benchmarks.ablations
attention`, and its figures are in `benchmarks/README.md`.
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

    Automatic is fused on every backend but TensorFlow. On TensorFlow,
    `keras.ops.dot_product_attention` is the same einsum-softmax-einsum graph
    with an extra full-size mask, and the plain path measured faster on the
    CPU (`python -m benchmarks.ablations attention`).

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
    return keras.backend.backend() != "tensorflow"


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
