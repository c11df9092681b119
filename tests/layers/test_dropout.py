import keras
import numpy as np
import pytest

from keras_transformer.layers.dropout import Dropout
from keras_transformer.ops.dropout import quantized_rate
from tests.helpers import to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax


def _expected_scale(rate):
    return 1.0 / (1.0 - quantized_rate(rate))  # both backends: the 16-bit mask


def test_quantized_rate_is_within_half_a_level():
    for rate in (0.1, 0.3, 0.01, 0.5, 0.123456):
        assert abs(quantized_rate(rate) - rate) <= 2**-17
        assert (quantized_rate(rate) * 2**16).is_integer()
    assert quantized_rate(0.1) == 6554 / 65536


@pytest.mark.parametrize("shape", [(300, 257), (50, 20, 2, 13)])  # odd element counts too
@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_drops_at_the_rate_and_rescales_the_rest(shape, rate):
    x = np.random.default_rng(0).uniform(1.0, 2.0, size=shape).astype("float32")
    y = to_numpy(Dropout(rate, seed=3)(x, training=True))
    assert y.shape == x.shape
    dropped = y == 0
    n = x.size
    # Binomial: within 5 standard deviations of the rate.
    assert abs(dropped.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / n)
    np.testing.assert_allclose(y[~dropped], x[~dropped] * _expected_scale(rate), rtol=1e-6)
    # Every position can be dropped: the mask covers the whole tensor, last element included.
    assert dropped.reshape(-1, shape[-1]).any(axis=0).mean() > 0.5
    assert dropped.reshape(-1)[n // 2 :].mean() == pytest.approx(rate, abs=0.02)


def test_masks_differ_between_calls_and_repeat_from_the_same_seed():
    x = np.ones((64, 512), "float32")
    first_layer, twin = Dropout(0.1, seed=11), Dropout(0.1, seed=11)
    a = to_numpy(first_layer(x, training=True)) == 0
    b = to_numpy(first_layer(x, training=True)) == 0
    assert (a != b).mean() > 0.1
    np.testing.assert_array_equal(a, to_numpy(twin(x, training=True)) == 0)
    # Adjacent elements come from the two halves of one random word: independent.
    pairs = a.reshape(-1, 2)
    both = (pairs[:, 0] & pairs[:, 1]).mean()
    assert abs(both - 0.01) < 5 * np.sqrt(0.01 * 0.99 / len(pairs))


def test_inference_and_rate_zero_return_the_input():
    x = np.random.default_rng(1).normal(size=(8, 16)).astype("float32")
    np.testing.assert_array_equal(to_numpy(Dropout(0.3)(x, training=False)), x)
    np.testing.assert_array_equal(to_numpy(Dropout(0.0)(x, training=True)), x)


def test_gradient_is_the_mask_times_the_scale():
    x = np.random.default_rng(2).normal(size=(40, 30)).astype("float32")
    layer = Dropout(0.2, seed=5)
    if keras.backend.backend() == "jax":
        import jax

        def objective(x):
            out = layer(x, training=True)
            return keras.ops.sum(out), out

        # One draw: the seed generator's state is read, not advanced, inside jax.grad.
        gradient, out = jax.grad(objective, has_aux=True)(x)
        gradient, out = np.asarray(gradient), np.asarray(out)
    else:
        import tensorflow as tf

        tensor = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(tensor)
            out = layer(tensor, training=True)
        gradient = tape.gradient(out, tensor).numpy()
        out = out.numpy()
    kept = out != 0
    np.testing.assert_allclose(gradient, kept * _expected_scale(0.2), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_keeps_low_precision_dtypes(dtype):
    x = keras.ops.ones((32, 64), dtype=dtype)
    y = Dropout(0.1, seed=2, dtype=f"mixed_{dtype}")(x, training=True)
    assert keras.backend.standardize_dtype(y.dtype) == dtype
    values = np.unique(to_numpy(y))
    assert values[0] == 0 and values[-1] == pytest.approx(_expected_scale(0.1), rel=1e-2)


def test_serializes_under_its_registered_name():
    layer = Dropout(0.25, seed=4, name="drop")
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == "keras_transformer>Dropout"
    restored = keras.saving.deserialize_keras_object(serialized)
    assert isinstance(restored, Dropout) and restored.rate == 0.25
