import numpy as np
import pytest

from keras_transformer import EncoderLayer
from tests.helpers import run_layer_test, to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax

X = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], "bool")


@pytest.mark.parametrize("normalize_first", [False, True])
def test_layer_contract(normalize_first):
    run_layer_test(
        EncoderLayer,
        dict(
            hidden_dim=8,
            intermediate_dim=16,
            num_heads=2,
            dropout=0.1,
            normalize_first=normalize_first,
        ),
        dict(inputs=X, padding_mask=MASK),
        expected_output_shape=(2, 5, 8),
    )


def test_post_norm_output_is_normalized():
    layer = EncoderLayer(hidden_dim=8, intermediate_dim=16, num_heads=2)
    out = to_numpy(layer(X))
    np.testing.assert_allclose(out.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(out.std(-1), 1.0, atol=1e-2)


def test_pre_norm_keeps_the_residual_stream():
    layer = EncoderLayer(hidden_dim=8, intermediate_dim=16, num_heads=2, normalize_first=True)
    out = to_numpy(layer(X * 10))
    assert out.std(-1).mean() > 3  # not re-normalized after the residual sum


def test_padding_changes_nothing_at_real_positions():
    layer = EncoderLayer(hidden_dim=8, intermediate_dim=16, num_heads=2)
    short = to_numpy(layer(X[:1, :3], padding_mask=np.ones((1, 3), "bool")))
    padded = to_numpy(layer(X[:1], padding_mask=MASK[:1]))
    np.testing.assert_allclose(padded[:, :3], short, rtol=1e-5, atol=1e-5)
