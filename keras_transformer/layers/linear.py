"""Matrix products with hand-written gradients for the layers' hot paths."""

from __future__ import annotations

from keras import ops


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


@ops.custom_gradient
def linear(x, kernel, bias):
    """`x @ kernel + bias` for 2-D `x` `(rows, in)`, `kernel` `(in, out)`, `bias` `(out,)`.

    Same values and gradients as the expression differentiated
    automatically; the bias gradient is a `column_sum` of the incoming
    gradient instead of the backend's broadcast reduction.

    Example:

    >>> x = np.ones((3, 2), "float32")
    >>> y = linear(x, np.eye(2, dtype="float32"), np.array([1.0, -1.0], "float32"))
    >>> ops.convert_to_numpy(y)
    array([[2., 0.],
           [2., 0.],
           [2., 0.]], dtype=float32)
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
