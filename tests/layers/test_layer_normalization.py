import keras
import numpy as np
import pytest
from keras import ops

from keras_transformer.layers.layer_normalization import LayerNormalization
from keras_transformer.ops import gradients
from tests.helpers import run_layer_test, to_numpy, value_and_gradients

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax


def test_layer_contract():
    run_layer_test(
        LayerNormalization,
        dict(epsilon=1e-6),
        dict(inputs=np.random.default_rng(0).normal(size=(2, 3, 8)).astype("float32")),
        expected_output_shape=(2, 3, 8),
    )


@pytest.mark.parametrize("hand_written", [True, False], ids=["hand-written", "automatic"])
@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 16)])
def test_values_and_gradients_match_the_keras_layer(shape, hand_written, monkeypatch):
    # Both backward passes on every backend, whichever one the backend uses.
    monkeypatch.setattr(gradients, "hand_written_gradients", lambda part: hand_written)
    rng = np.random.default_rng(1)
    x = (3.0 * rng.normal(size=shape) + 1.5).astype("float32")
    upstream = rng.normal(size=shape).astype("float32")
    ours, reference = (
        LayerNormalization(epsilon=1e-6),
        keras.layers.LayerNormalization(epsilon=1e-6),
    )
    for layer in (ours, reference):
        layer.build(shape)
    gamma = rng.normal(size=shape[-1:]).astype("float32")
    beta = rng.normal(size=shape[-1:]).astype("float32")
    for layer in (ours, reference):
        layer.gamma.assign(gamma)
        layer.beta.assign(beta)
    out, grads = value_and_gradients(ours, x, upstream)
    expected_out, expected_grads = value_and_gradients(reference, x, upstream)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    for name, got, expected in zip(("x", "gamma", "beta"), grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=name)
    # And against the closed form, independent of either implementation.
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    normalized = (x - mean) * rstd
    np.testing.assert_allclose(out, normalized * gamma + beta, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        grads[1], (upstream * normalized).reshape(-1, shape[-1]).sum(0), rtol=1e-4, atol=1e-4
    )


def test_mixed_precision_output_dtype_and_float32_statistics():
    layer = LayerNormalization(epsilon=1e-6, dtype="mixed_bfloat16")
    # A large offset next to a small spread: statistics taken in bfloat16
    # (8 significant bits, steps of 4 near 1000) would be off by a good part
    # of a standard deviation.
    x = ops.cast(np.random.default_rng(2).normal(size=(2, 3, 64)) * 10 + 1000, "bfloat16")
    out = layer(x)
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"
    assert layer.gamma.dtype == "float32"
    exact = to_numpy(x)  # the bfloat16 inputs, in float32
    exact = (exact - exact.mean(-1, keepdims=True)) / np.sqrt(exact.var(-1, keepdims=True) + 1e-6)
    # Only the bfloat16 rounding of the outputs (|values| < 4: steps <= 1/64) remains.
    np.testing.assert_allclose(to_numpy(out), exact, atol=1 / 64)


def test_other_configurations_run_the_keras_layer():
    x = np.random.default_rng(3).normal(size=(2, 3, 4)).astype("float32")
    for kwargs in (dict(axis=[1, 2]), dict(center=False), dict(scale=False)):
        ours, reference = LayerNormalization(**kwargs), keras.layers.LayerNormalization(**kwargs)
        np.testing.assert_allclose(to_numpy(ours(x)), to_numpy(reference(x)), rtol=1e-6)
