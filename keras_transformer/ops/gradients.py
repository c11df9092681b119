"""The switch for the hand-written backward passes of the training step."""

from __future__ import annotations

import keras

# The parts of the training step that have a hand-written backward pass:
# the attention projections, the feed-forward network's two products, layer
# normalization and the loss.
HAND_WRITTEN_PARTS = ("projections", "feed_forward", "layer_norm", "loss")

# None = automatic (see `hand_written_gradients`); else the set of parts forced on.
_forced = {"parts": None}


def set_hand_written_gradients(parts):
    """Chooses the parts with a hand-written backward pass; None = automatic.

    Automatic is the loss on every backend, and the projections, the
    feed-forward products and layer normalization on TensorFlow only: their
    passes were written for TensorFlow's CPU kernels and were slower under
    JAX on a GPU (the `gradients` ablation: docs/performance.md, "Training
    step").

    Example:

    >>> set_hand_written_gradients(())  # every part left to automatic differentiation
    >>> hand_written_gradients("loss")
    False
    >>> set_hand_written_gradients(None)  # back to the automatic choice
    """
    if parts is not None:
        parts = frozenset(parts)
        unknown = sorted(parts - set(HAND_WRITTEN_PARTS))
        if unknown:
            raise ValueError(f"parts must be among {HAND_WRITTEN_PARTS}. Received: {unknown}")
    _forced["parts"] = parts


def hand_written_gradients(part):
    """Whether `part` (one of `HAND_WRITTEN_PARTS`) uses its hand-written backward pass."""
    if part not in HAND_WRITTEN_PARTS:
        raise ValueError(f"part must be one of {HAND_WRITTEN_PARTS}. Received: {part!r}")
    if _forced["parts"] is not None:
        return part in _forced["parts"]
    return part == "loss" or keras.backend.backend() == "tensorflow"
