"""Matrix products with hand-written gradients for the layers' hot paths."""

from __future__ import annotations

import keras
from keras import ops

# The parts of the training step that have a hand-written backward pass:
# the attention projections, the feed-forward network's two products, layer
# normalization and the loss.
HAND_WRITTEN_PARTS = ("projections", "feed_forward", "layer_norm", "loss")


def hand_written_gradients(part):
    """Whether `part` (one of `HAND_WRITTEN_PARTS`) uses its hand-written backward pass.

    The loss: on every backend. The attention projections, the feed-forward
    products and layer normalization: on TensorFlow only. Their hand-written
    passes were written for TensorFlow's CPU kernels and sum their bias and
    layer-norm gradients with `column_sum` products, which on a GPU run as
    matrix-vector products. Under JAX on an H100 (paper-base, one
    25000-token batch, `KERAS_BACKEND=jax python -m benchmarks.ablations
    gradients --rows 25000 --layers 6 --rounds 9`), a float32 training step
    took 106.58 ms with every hand-written pass, 99.16 ms with their column
    sums as plain sums, 98.34 ms with the Keras layer normalization; under
    mixed_bfloat16, 75.90 ms with every hand-written pass, 74.04 ms with the
    Keras layer normalization, but 89.19 ms with the loss left to automatic
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


def transposed_copy(matrix):
    """`matrix.T` for a 2-D `matrix` with static shape, written out as a new tensor.

    `ops.transpose(kernel)` feeding a product is folded by TensorFlow's graph
    optimizer into the product's `transpose_b` flag, and oneDNN's products
    with a transposed right operand run slower on a CPU: on a 2-core AMD
    EPYC VM (AVX-512), `g @ kernel.T` for `g` (25000, 2048) and `kernel`
    (512, 2048) took 334.8 ms with `transpose_b`, 247.5 ms with the
    transpose written out (`python -m benchmarks.ablations transpose-b`).
    Going through a 3-D transpose keeps the optimizer from folding it; the
    copy of a weight matrix costs a few milliseconds at most.

    Example:

    >>> ops.convert_to_numpy(transposed_copy(np.array([[1.0, 2.0, 3.0]], "float32")))
    array([[1.],
           [2.],
           [3.]], dtype=float32)
    """
    rows, columns = matrix.shape
    cube = ops.transpose(ops.reshape(matrix, (rows, columns, 1)), (1, 0, 2))
    return ops.reshape(cube, (columns, rows))


def linear(x, kernel, bias, part="projections"):
    """`x @ kernel + bias` for 2-D `x` `(rows, in)`, `kernel` `(in, out)`, `bias` `(out,)`.

    With `hand_written_gradients(part)` (`"projections"` or
    `"feed_forward"`; the TensorFlow backend), `linear_with_gradient`;
    otherwise the plain expression.

    Example:

    >>> x = np.ones((3, 2), "float32")
    >>> y = linear(x, np.eye(2, dtype="float32"), np.array([1.0, -1.0], "float32"))
    >>> ops.convert_to_numpy(y)
    array([[2., 0.],
           [2., 0.],
           [2., 0.]], dtype=float32)
    """
    if hand_written_gradients(part):
        return linear_with_gradient(x, kernel, bias)
    return ops.matmul(x, kernel) + bias


@ops.custom_gradient
def linear_with_gradient(x, kernel, bias):
    """`x @ kernel + bias` (as `linear`), with a hand-written gradient.

    Same values and gradients as the expression differentiated
    automatically; the bias gradient is a `column_sum` of the incoming
    gradient instead of the backend's broadcast reduction, and the input
    gradient multiplies by a `transposed_copy` of the kernel.
    """
    outputs = ops.matmul(x, kernel) + bias

    def grad(*args, upstream=None):
        upstream = args[0] if upstream is None else upstream
        upstream = ops.cast(upstream, outputs.dtype)
        return (
            ops.matmul(upstream, transposed_copy(kernel)),
            ops.matmul(ops.transpose(x), upstream),
            column_sum(upstream),
        )

    return outputs, grad
