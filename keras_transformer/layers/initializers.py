"""The one initializer helper the layers share."""

from __future__ import annotations

import keras


def clone_initializer(initializer):
    """A fresh initializer with the same config, so sublayers do not share seeds."""
    return keras.initializers.get(keras.initializers.serialize(initializer))
