"""`x @ kernel + bias` with a hand-written gradient, and the products it is made of."""

from __future__ import annotations

from keras import ops

from keras_transformer.ops import gradients


def column_sum(x):
    """Sum over the rows of a 2-D tensor `(rows, columns)` -> `(columns,)`.

    Computed as the product `ones(1, rows) @ x`: on a CPU, TensorFlow's
    reduction over the leading axis of a tall matrix is several times slower
    than this matrix-vector product, and bias and layer-norm gradients are
    such reductions (docs/performance.md, "Training step": the `gradients`
    ablation's "sum reductions" variant and the kernel-level finding).

    Example:

    >>> ops.convert_to_numpy(column_sum(np.array([[1.0, 2.0], [3.0, 4.0]], "float32")))
    array([4., 6.], dtype=float32)
    """
    ones = ops.ones((1, ops.shape(x)[0]), dtype=x.dtype)
    return ops.matmul(ones, x)[0]


def transposed_copy(matrix):
    """`matrix.T` for a 2-D `matrix` with static shape, written out as a new tensor.

    TensorFlow's graph optimizer folds a plain transpose feeding a product
    into the product's `transpose_b` flag, and oneDNN's products with a
    transposed right operand are slower on a CPU; a 3-D transpose is not
    folded (docs/performance.md, "Training step": the `gradients` ablation's
    "transpose_b products" variant and the kernel-level finding).

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

    With `gradients.hand_written_gradients(part)` (`"projections"` or
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
    if gradients.hand_written_gradients(part):
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
