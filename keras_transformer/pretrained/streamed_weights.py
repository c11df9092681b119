"""A model's weights saved and loaded one variable at a time, never all of them at once.

Keras builds a model with random values in every variable before any weight
is assigned or loaded, and keeps them all: an import or an export of a
pretrained model would then hold the whole model beside the checkpoint it
reads or writes. Here the model is built in a `keras.StatelessScope` that
leaves its variables without values (`unvalued`), and a scope of ours hands
each variable's value to Keras when Keras saves it (`ValuesOnSave`) or takes
each value as Keras loads it (`TakeOnLoad`). Keras's own file format and
layout are kept: only where the values come from or go to changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import keras
import numpy as np


@contextlib.contextmanager
def unvalued():
    """A scope in which Keras variables are made without values (shapes and paths only).

    Keras lists such variables to give them their initial values at the end
    of the next stateless scope; those made here are taken off that list on
    leaving, since their values only ever come from `ValuesOnSave`.
    """
    pending = _pending_variables()
    before = len(pending) if pending is not None else 0
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        pending = _pending_variables()
        if pending is not None:
            del pending[before:]


def _pending_variables():
    """Keras's list of variables still waiting for their initial values, or None."""
    try:  # not public: without it a later stateless scope initializes them once, randomly
        from keras.src.backend.common import global_state
    except ImportError:
        return None
    pending = global_state.get_global_attribute("uninitialized_variables")
    return pending if isinstance(pending, list) else None


class ValuesOnSave(keras.StatelessScope):
    """Inside it, `model.save` writes `values(variable)` for each variable of an
    `unvalued` model, asked for one at a time as Keras writes it."""

    def __init__(self, values: Callable[[object], np.ndarray]):
        super().__init__(initialize_variables=False)
        self.values = values

    def get_current_value(self, variable):
        value = np.asarray(self.values(variable), variable.dtype)
        if value.shape != tuple(variable.shape):
            raise ValueError(
                f"{variable.path}: a value of shape {value.shape}, not {variable.shape}"
            )
        return value


class TakeOnLoad(keras.StatelessScope):
    """Inside it, loading weights into an `unvalued` model calls `take(variable, array)`
    for each variable as Keras reads it, and keeps nothing."""

    def __init__(self, take: Callable[[object, np.ndarray], None]):
        super().__init__(initialize_variables=False)
        self.take = take

    def add_update(self, update):
        variable, value = update
        self.take(variable, np.asarray(value))
