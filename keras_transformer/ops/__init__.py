"""Backend-specific fast paths of the model, each behind one documented switch.

- attention: `keras.ops.dot_product_attention` or the plain expression
  (`set_fused_attention`);
- hand-written backward passes of the attention projections, the
  feed-forward products, layer normalization and the loss
  (`set_hand_written_gradients`), in `linear`, `layer_norm` and `loss`;
- dropout masks drawn 16 bits per element on TensorFlow (`dropout`).

The layers make one call into each; the figures behind every choice are in
docs/performance.md ("Training step").
"""

from keras_transformer.ops.attention import (
    dot_product_attention,
    fused_attention_enabled,
    set_fused_attention,
)
from keras_transformer.ops.gradients import (
    HAND_WRITTEN_PARTS,
    hand_written_gradients,
    set_hand_written_gradients,
)

__all__ = [
    "HAND_WRITTEN_PARTS",
    "dot_product_attention",
    "fused_attention_enabled",
    "hand_written_gradients",
    "set_fused_attention",
    "set_hand_written_gradients",
]
