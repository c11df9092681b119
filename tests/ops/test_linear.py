import keras
import numpy as np
import pytest
from keras import ops

from keras_transformer.ops import gradients
from keras_transformer.ops.linear import (
    column_sum,
    linear,
    linear_with_gradient,
    transposed_copy,
)
from tests.helpers import to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax


def _value_and_gradients(fn, x, kernel, bias, upstream):
    """`fn(x, kernel, bias)` and the gradients of `sum(fn(...) * upstream)` wrt all three."""
    if keras.backend.backend() == "jax":
        import jax

        def objective(x, kernel, bias):
            return ops.sum(fn(x, kernel, bias) * upstream)

        grads = jax.grad(objective, argnums=(0, 1, 2))(x, kernel, bias)
        return to_numpy(fn(x, kernel, bias)), [np.asarray(g) for g in grads]
    import tensorflow as tf

    inputs = [tf.constant(v) for v in (x, kernel, bias)]
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        out = fn(*inputs)
        objective = tf.reduce_sum(out * upstream)
    return to_numpy(out), [g.numpy() for g in tape.gradient(objective, inputs)]


@pytest.mark.parametrize("fn", [linear, linear_with_gradient], ids=["linear", "hand-written"])
@pytest.mark.parametrize("rows", [1, 37])
def test_linear_matches_automatic_differentiation_and_the_closed_form(rows, fn):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 6)).astype("float32")
    kernel = rng.normal(size=(6, 5)).astype("float32")
    bias = rng.normal(size=(5,)).astype("float32")
    upstream = rng.normal(size=(rows, 5)).astype("float32")

    out, grads = _value_and_gradients(fn, x, kernel, bias, upstream)
    expected_out, expected_grads = _value_and_gradients(
        lambda x, k, b: ops.matmul(x, k) + b, x, kernel, bias, upstream
    )
    np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
    for name, got, expected in zip(("x", "kernel", "bias"), grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=name)
    # Closed form, independent of the backend's automatic differentiation.
    np.testing.assert_allclose(out, x @ kernel + bias, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[0], upstream @ kernel.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[1], x.T @ upstream, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[2], upstream.sum(0), rtol=1e-5, atol=1e-5)


def test_column_sum_values_and_dtype():
    x = np.arange(12, dtype="float32").reshape(4, 3) - 5.0
    np.testing.assert_allclose(to_numpy(column_sum(x)), x.sum(0))
    # Many rows: the product accumulates like a sum, not worse.
    tall = np.random.default_rng(1).normal(size=(20000, 4)).astype("float32")
    np.testing.assert_allclose(
        to_numpy(column_sum(tall)), tall.astype("float64").sum(0), rtol=1e-4, atol=1e-3
    )
    half = column_sum(ops.cast(x, "bfloat16"))
    assert keras.backend.standardize_dtype(half.dtype) == "bfloat16"
    np.testing.assert_allclose(to_numpy(ops.cast(half, "float32")), x.sum(0), rtol=1e-2)


def test_linear_keeps_a_mixed_precision_dtype():
    x = ops.cast(np.ones((4, 3)), "bfloat16")
    kernel = ops.cast(np.full((3, 2), 0.5), "bfloat16")
    bias = ops.cast(np.array([1.0, 2.0]), "bfloat16")
    out = linear(x, kernel, bias)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    np.testing.assert_allclose(to_numpy(ops.cast(out, "float32")), [[2.5, 3.5]] * 4)


def test_hand_written_gradients_where_they_were_measured():
    on_tensorflow = keras.backend.backend() == "tensorflow"
    assert gradients.hand_written_gradients("loss")
    assert gradients.hand_written_gradients("projections") == on_tensorflow
    assert gradients.hand_written_gradients("feed_forward") == on_tensorflow
    assert gradients.hand_written_gradients("layer_norm") == on_tensorflow
    with pytest.raises(ValueError, match="part must be one of"):
        gradients.hand_written_gradients("attention")


@pytest.mark.parametrize("hand_written", [True, False])
def test_linear_takes_the_path_the_switch_names(monkeypatch, hand_written):
    calls = []
    monkeypatch.setattr(
        gradients, "hand_written_gradients", lambda part: calls.append(part) or hand_written
    )
    x = np.ones((2, 3), "float32")
    out = linear(x, np.ones((3, 4), "float32"), np.arange(4, dtype="float32"))
    np.testing.assert_allclose(to_numpy(out), [[3.0, 4.0, 5.0, 6.0]] * 2)
    linear(x, np.ones((3, 4), "float32"), np.zeros(4, "float32"), part="feed_forward")
    assert calls == ["projections", "feed_forward"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transposed_copy_is_the_transpose(dtype):
    matrix = np.arange(15, dtype="float32").reshape(3, 5)
    copy = transposed_copy(ops.cast(matrix, dtype))
    assert tuple(copy.shape) == (5, 3)
    assert keras.backend.standardize_dtype(copy.dtype) == dtype
    np.testing.assert_array_equal(to_numpy(copy), matrix.T)
