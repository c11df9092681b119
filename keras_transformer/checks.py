"""Argument checks with one message shape: "name must be ... Received: name=value"."""

from __future__ import annotations

# One definition, shared with the TensorFlow-free runtime (which this package depends on).
from keras_transformer_runtime.sources import check_positive_int

__all__ = [
    "ACTIVATIONS",
    "POSITIONAL_LAYOUTS",
    "check_activation",
    "check_consistency",
    "check_positional_layout",
    "check_positive_int",
    "check_rate",
]


def check_rate(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1). Received: {name}={value!r}")


def check_consistency(alpha):
    """R-Drop's alpha: a finite number >= 0, or a clear error."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < 1e6:
        raise ValueError(f"consistency (R-Drop alpha) must be a number >= 0. Received: {alpha!r}")


# The inner activations the layers, the export graphs and the importers know:
# the paper's ReLU, swish (SiLU, x * sigmoid(x): older OPUS-MT models) and GELU
# (the exact erf form, Keras' and transformers' default).
ACTIVATIONS = ("relu", "swish", "gelu")


def check_activation(activation: str) -> str:
    """`activation` if it is one of `ACTIVATIONS`, else a ValueError naming them."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {', '.join(ACTIVATIONS)}. Received: {activation!r}"
        )
    return activation


# How the sin and cos columns are laid out: "interleaved" is the paper's
# (sin, cos, sin, cos, ...); "concatenated" puts every sin first, then every
# cos (Marian's and tensor2tensor's layout, so OPUS-MT models import exactly).
POSITIONAL_LAYOUTS = ("interleaved", "concatenated")


def check_positional_layout(layout: str) -> str:
    if layout not in POSITIONAL_LAYOUTS:
        raise ValueError(
            f"positional_layout must be one of {', '.join(POSITIONAL_LAYOUTS)}. "
            f"Received: {layout!r}"
        )
    return layout
