"""Layer normalization over the last axis, the Keras layer with a hand-written gradient."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer.ops import gradients
from keras_transformer.ops.layer_norm import normalize_last_axis


@keras.saving.register_keras_serializable(package="keras_transformer")
class LayerNormalization(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization`, with a hand-written backward pass.

    Same arguments, weights (`gamma`, `beta`) and outputs as the Keras layer.
    When it normalizes the last axis with both `gamma` and `beta` (how the
    Transformer uses it) and `keras_transformer.ops.hand_written_gradients`
    says so, it calls `keras_transformer.ops.layer_norm.normalize_last_axis`,
    whose backward pass keeps far less; otherwise it runs the Keras layer.

    Example:

    >>> norm = LayerNormalization(epsilon=1e-6)
    >>> y = norm(np.array([[1.0, 2.0, 3.0]], "float32"))
    >>> np.round(ops.convert_to_numpy(y), 3)
    array([[-1.225,  0.   ,  1.225]], dtype=float32)
    """

    def call(self, inputs):
        last = len(inputs.shape) - 1
        if (
            not gradients.hand_written_gradients("layer_norm")
            or self.rms_scaling
            or self.gamma is None
            or self.beta is None
            or len(self.axis) != 1
            or self.axis[0] not in (-1, last)
        ):
            return super().call(inputs)
        # At least float32, as the Keras layer computes.
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        outputs = normalize_last_axis(
            ops.cast(inputs, dtype),
            ops.cast(self.gamma, dtype),
            ops.cast(self.beta, dtype),
            self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)
