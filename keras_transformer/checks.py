"""Argument checks with one message shape: "name must be ... Received: name=value"."""

from __future__ import annotations

# One definition, shared with the TensorFlow-free runtime (which this package depends on).
from keras_transformer_runtime.sources import check_positive_int

__all__ = ["check_consistency", "check_positive_int", "check_rate"]


def check_rate(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1). Received: {name}={value!r}")


def check_consistency(alpha):
    """R-Drop's alpha: a finite number >= 0, or a clear error."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < 1e6:
        raise ValueError(f"consistency (R-Drop alpha) must be a number >= 0. Received: {alpha!r}")
