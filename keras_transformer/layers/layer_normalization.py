"""Layer normalization over the last axis, with a hand-written gradient."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer.layers import linear


@keras.saving.register_keras_serializable(package="keras_transformer")
class LayerNormalization(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization`, with a hand-written backward pass.

    Same arguments, weights (`gamma`, `beta`) and outputs as the Keras layer.
    When it normalizes the last axis with both `gamma` and `beta` (how the
    Transformer uses it), the backward pass keeps only the normalized input
    and one reciprocal standard deviation per position, and computes

        dx = rstd * (g' - mean(g') - x_hat * mean(g' * x_hat)),  g' = g * gamma

    Left to automatic differentiation, the Keras formula keeps the input and
    several full-size intermediates (it broadcasts `gamma` into a per-element
    scale) for every normalization of the model. Any other configuration
    (several axes, no `gamma` or `beta`, `rms_scaling`), and backends other
    than TensorFlow (`linear.hand_written_gradients`), run the Keras layer
    unchanged.

    Example:

    >>> norm = LayerNormalization(epsilon=1e-6)
    >>> y = norm(np.array([[1.0, 2.0, 3.0]], "float32"))
    >>> np.round(ops.convert_to_numpy(y), 3)
    array([[-1.225,  0.   ,  1.225]], dtype=float32)
    """

    def call(self, inputs):
        last = len(inputs.shape) - 1
        if (
            not linear.hand_written_gradients("layer_norm")
            or self.rms_scaling
            or self.gamma is None
            or self.beta is None
            or len(self.axis) != 1
            or self.axis[0] not in (-1, last)
        ):
            return super().call(inputs)
        # At least float32, as the Keras layer computes.
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        outputs = _normalize_last_axis(float(self.epsilon))(
            ops.cast(inputs, dtype), ops.cast(self.gamma, dtype), ops.cast(self.beta, dtype)
        )
        return ops.cast(outputs, self.compute_dtype)


def _normalize_last_axis(epsilon):
    """`(x, gamma, beta) -> x_hat * gamma + beta` over the last axis, hand-written gradient."""

    @ops.custom_gradient
    def normalize(x, gamma, beta):
        mean = ops.mean(x, axis=-1, keepdims=True)
        centered = x - mean
        variance = ops.mean(ops.square(centered), axis=-1, keepdims=True)
        rstd = ops.rsqrt(variance + epsilon)
        normalized = centered * rstd

        def grad(*args, upstream=None):
            upstream = args[0] if upstream is None else upstream
            upstream = ops.cast(upstream, normalized.dtype)
            scaled = upstream * gamma
            dx = rstd * (
                scaled
                - ops.mean(scaled, axis=-1, keepdims=True)
                - normalized * ops.mean(scaled * normalized, axis=-1, keepdims=True)
            )
            width = ops.shape(x)[-1]
            dgamma = linear.column_sum(ops.reshape(upstream * normalized, (-1, width)))
            dbeta = linear.column_sum(ops.reshape(upstream, (-1, width)))
            return dx, dgamma, dbeta

        return normalized * gamma + beta, grad

    return normalize
