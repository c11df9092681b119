import numpy as np
import pytest

from keras_transformer import FeedForward
from tests.helpers import run_layer_test, to_numpy


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


def test_bad_arguments():
    with pytest.raises(ValueError, match="intermediate_dim must be a positive integer"):
        FeedForward(hidden_dim=4, intermediate_dim=0)
