"""Mask helpers shared by the attention layers.

Every mask here has one meaning: True (or 1) = attend / real token.
"""

from __future__ import annotations

import keras
from keras import ops
from keras_transformer_runtime.specials import PAD_ID


def padding_mask_from_ids(token_ids, pad_id: int = PAD_ID):
    """Returns a boolean `(batch_size, seq_len)` mask, True on real tokens."""
    return ops.not_equal(token_ids, pad_id)


def causal_mask(query_len, key_len, query_offset=0):
    """Boolean `(1, query_len, key_len)` mask: query i sees keys j <= i + query_offset.

    `query_offset` is the absolute position of the first query, which is
    non-zero when decoding one token at a time against a key/value cache.
    """
    rows = ops.expand_dims(ops.arange(query_len, dtype="int32") + query_offset, 1)
    cols = ops.expand_dims(ops.arange(key_len, dtype="int32"), 0)
    return ops.expand_dims(ops.greater_equal(rows, cols), 0)


def merge_masks(
    query_len,
    key_len,
    attention_mask=None,
    query_padding_mask=None,
    key_padding_mask=None,
    use_causal_mask=False,
    query_offset=0,
):
    """Combines every given mask into one boolean `(batch_size, query_len, key_len)` mask.

    Returns None when no mask applies. The batch axis may be 1 (broadcast).
    """
    mask = None

    def _and(a, b):
        return b if a is None else ops.logical_and(a, b)

    if attention_mask is not None:
        attention_mask = ops.cast(attention_mask, "bool")
        if len(attention_mask.shape) == 2:  # (Tq, Tk) shared by the batch
            attention_mask = ops.expand_dims(attention_mask, 0)
        mask = _and(mask, attention_mask)
    if key_padding_mask is not None:
        mask = _and(mask, ops.expand_dims(ops.cast(key_padding_mask, "bool"), 1))
    if query_padding_mask is not None:
        mask = _and(mask, ops.expand_dims(ops.cast(query_padding_mask, "bool"), 2))
    if use_causal_mask:
        mask = _and(mask, causal_mask(query_len, key_len, query_offset))
    return mask


@keras.saving.register_keras_serializable(package="keras_transformer")
class PaddingMask(keras.layers.Layer):
    """Turns token ids into a boolean padding mask (True = real token).

    A layer rather than a bare op so that the functional model serializes it
    by name.
    """

    def __init__(self, pad_id: int = PAD_ID, **kwargs):
        super().__init__(**kwargs)
        self.pad_id = int(pad_id)

    def call(self, token_ids):
        return padding_mask_from_ids(token_ids, self.pad_id)

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, token_ids):
        return keras.KerasTensor(token_ids.shape, dtype="bool")

    def get_config(self):
        config = super().get_config()
        config.update({"pad_id": self.pad_id})
        return config
