"""Matrix products with hand-written gradients for the layers' hot paths."""

from __future__ import annotations

import keras
from keras import ops

# The parts of the training step that have a hand-written backward pass.
HAND_WRITTEN_PARTS = ("projections", "layer_norm", "loss")


def hand_written_gradients(part):
    """Whether `part` (one of `HAND_WRITTEN_PARTS`) uses its hand-written backward pass.

    The loss: on every backend. The attention projections and layer
    normalization: on TensorFlow only. Their hand-written passes were written
    for TensorFlow's CPU kernels and sum their bias and layer-norm gradients
    with `column_sum` products, which on a GPU run as matrix-vector
    products. Under JAX on an H100 (paper-base, one 25000-token batch,
    `KERAS_BACKEND=jax python -m benchmarks.ablations gradients --rows 25000
    --layers 6 --rounds 9`), a float32 training step took 106.58 ms with
    every hand-written pass, 99.16 ms with their column sums as plain sums,
    98.34 ms with the Keras layer normalization; under mixed_bfloat16,
    75.90 ms with every hand-written pass, 74.04 ms with the Keras layer
    normalization, but 89.19 ms with the loss left to automatic
    differentiation.
    """
    if part not in HAND_WRITTEN_PARTS:
        raise ValueError(f"part must be one of {HAND_WRITTEN_PARTS}. Received: {part!r}")
    return part == "loss" or keras.backend.backend() == "tensorflow"


def column_sum(x):
    """Sum over the rows of a 2-D tensor `(rows, columns)` -> `(columns,)`.

    Computed as the product `ones(1, rows) @ x`. On a CPU, TensorFlow's
    reduction over the leading axis of a tall matrix is several times slower
    than this matrix-vector product (17.4 ms against 4.0 ms for a 25000 x 512
    float32 matrix on a 2-core Sapphire Rapids VM, `python -m
    benchmarks.ablations column-sum`); bias and layer-norm gradients are
    such reductions.

    Example:

    >>> ops.convert_to_numpy(column_sum(np.array([[1.0, 2.0], [3.0, 4.0]], "float32")))
    array([4., 6.], dtype=float32)
    """
    ones = ops.ones((1, ops.shape(x)[0]), dtype=x.dtype)
    return ops.matmul(ones, x)[0]


def linear(x, kernel, bias):
    """`x @ kernel + bias` for 2-D `x` `(rows, in)`, `kernel` `(in, out)`, `bias` `(out,)`.

    With `hand_written_gradients("projections")` (the TensorFlow backend),
    `linear_with_gradient`; otherwise the plain expression.

    Example:

    >>> x = np.ones((3, 2), "float32")
    >>> y = linear(x, np.eye(2, dtype="float32"), np.array([1.0, -1.0], "float32"))
    >>> ops.convert_to_numpy(y)
    array([[2., 0.],
           [2., 0.],
           [2., 0.]], dtype=float32)
    """
    if hand_written_gradients("projections"):
        return linear_with_gradient(x, kernel, bias)
    return ops.matmul(x, kernel) + bias


@ops.custom_gradient
def linear_with_gradient(x, kernel, bias):
    """`x @ kernel + bias` (as `linear`), with a hand-written gradient.

    Same values and gradients as the expression differentiated
    automatically; the bias gradient is a `column_sum` of the incoming
    gradient instead of the backend's broadcast reduction.
    """
    outputs = ops.matmul(x, kernel) + bias

    def grad(*args, upstream=None):
        upstream = args[0] if upstream is None else upstream
        upstream = ops.cast(upstream, outputs.dtype)
        return (
            ops.matmul(upstream, ops.transpose(kernel)),
            ops.matmul(ops.transpose(x), upstream),
            column_sum(upstream),
        )

    return outputs, grad
