"""Backend-specific fast paths, each behind one documented switch."""

from keras_transformer.ops.attention import (
    dot_product_attention,
    fused_attention_enabled,
    set_fused_attention,
)

__all__ = ["dot_product_attention", "fused_attention_enabled", "set_fused_attention"]
