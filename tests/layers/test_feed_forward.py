import numpy as np
import pytest

from keras_transformer import FeedForward
from keras_transformer.ops import gradients
from tests.helpers import run_layer_test, to_numpy, value_and_gradients

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax


def test_layer_contract():
    run_layer_test(
        FeedForward,
        dict(hidden_dim=8, intermediate_dim=32, dropout=0.1),
        dict(inputs=np.random.default_rng(0).normal(size=(2, 3, 8)).astype("float32")),
        expected_output_shape=(2, 3, 8),
    )


def test_is_relu_mlp():
    layer = FeedForward(hidden_dim=4, intermediate_dim=6)
    x = np.random.default_rng(1).normal(size=(1, 2, 4)).astype("float32")
    out = to_numpy(layer(x))
    w1, b1, w2, b2 = (to_numpy(w) for w in layer.weights)
    np.testing.assert_allclose(out, np.maximum(x @ w1 + b1, 0) @ w2 + b2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hand_written", [True, False], ids=["hand-written", "automatic"])
def test_values_and_gradients_in_closed_form(hand_written, monkeypatch):
    # Both backward passes on every backend, whichever one the backend uses.
    parts = []
    monkeypatch.setattr(
        gradients, "hand_written_gradients", lambda part: parts.append(part) or hand_written
    )
    rng = np.random.default_rng(2)
    layer = FeedForward(hidden_dim=6, intermediate_dim=10)
    layer.build((3, 4, 6))
    for w in layer.trainable_weights:
        w.assign(rng.normal(size=w.shape).astype("float32"))
    x = rng.normal(size=(3, 4, 6)).astype("float32")
    upstream = rng.normal(size=(3, 4, 6)).astype("float32")
    out, grads = value_and_gradients(layer, x, upstream)
    assert set(parts) == {"feed_forward"}

    w1, b1, w2, b2 = (to_numpy(w) for w in layer.trainable_weights)
    rows, g = x.reshape(-1, 6), upstream.reshape(-1, 6)
    pre = rows @ w1 + b1
    hidden = np.maximum(pre, 0)
    np.testing.assert_allclose(out.reshape(-1, 6), hidden @ w2 + b2, rtol=1e-5, atol=1e-5)
    g_pre = (g @ w2.T) * (pre > 0)
    expected = [
        (g_pre @ w1.T).reshape(x.shape),
        rows.T @ g_pre,
        g_pre.sum(0),
        hidden.T @ g,
        g.sum(0),
    ]
    for name, got, want in zip(("x", "W1", "b1", "W2", "b2"), grads, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_bad_arguments():
    with pytest.raises(ValueError, match="intermediate_dim must be a positive integer"):
        FeedForward(hidden_dim=4, intermediate_dim=0)
