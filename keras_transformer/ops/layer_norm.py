"""Layer normalization over the last axis with a hand-written gradient."""

from __future__ import annotations

from keras import ops

from keras_transformer.ops import linear as linear_ops


def normalize_last_axis(x, gamma, beta, epsilon):
    """`(x - mean) / sqrt(var + epsilon) * gamma + beta` over the last axis.

    The backward pass keeps only the normalized input and one reciprocal
    standard deviation per position, and computes

        dx = rstd * (g' - mean(g') - x_hat * mean(g' * x_hat)),  g' = g * gamma

    where automatic differentiation of the Keras formula keeps the input and
    several full-size intermediates. The `gamma` and `beta` gradients are
    `column_sum` products.

    Example:

    >>> x = np.array([[1.0, 2.0, 3.0]], "float32")
    >>> y = normalize_last_axis(x, np.ones(3, "float32"), np.zeros(3, "float32"), 1e-6)
    >>> np.round(ops.convert_to_numpy(y), 3)
    array([[-1.225,  0.   ,  1.225]], dtype=float32)
    """
    return _normalize(float(epsilon))(x, gamma, beta)


def _normalize(epsilon):
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
            dgamma = linear_ops.column_sum(ops.reshape(upstream * normalized, (-1, width)))
            dbeta = linear_ops.column_sum(ops.reshape(upstream, (-1, width)))
            return dx, dgamma, dbeta

        return normalized * gamma + beta, grad

    return normalize
