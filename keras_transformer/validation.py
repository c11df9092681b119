"""Argument checks with one message shape: "name must be ... Received: name=value"."""

from __future__ import annotations


def check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")


def check_rate(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1). Received: {name}={value!r}")
