import numpy as np
import pytest
from keras import ops

from keras_transformer import DecoderLayer
from tests.helpers import run_layer_test, to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax

RNG = np.random.default_rng(0)
Y = RNG.normal(size=(2, 4, 8)).astype("float32")
X = RNG.normal(size=(2, 6, 8)).astype("float32")
Y_MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], "bool")
X_MASK = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], "bool")


@pytest.mark.parametrize("normalize_first", [False, True])
def test_layer_contract(normalize_first):
    run_layer_test(
        DecoderLayer,
        dict(
            hidden_dim=8,
            intermediate_dim=16,
            num_heads=2,
            dropout=0.1,
            normalize_first=normalize_first,
        ),
        dict(
            decoder_sequence=Y,
            encoder_sequence=X,
            decoder_padding_mask=Y_MASK,
            encoder_padding_mask=X_MASK,
        ),
        expected_output_shape=(2, 4, 8),
    )


def test_causal_self_attention_is_leak_free():
    layer = DecoderLayer(hidden_dim=8, intermediate_dim=16, num_heads=2)
    changed = Y.copy()
    changed[:, 2:] = RNG.normal(size=(2, 2, 8))
    a, b = to_numpy(layer(Y, X)), to_numpy(layer(changed, X))
    np.testing.assert_allclose(a[:, :2], b[:, :2], atol=1e-6)
    assert not np.allclose(a[:, 2:], b[:, 2:])


def test_encoder_padding_is_ignored():
    layer = DecoderLayer(hidden_dim=8, intermediate_dim=16, num_heads=2)
    noisy = X.copy()
    noisy[0, 4:] = 100.0  # padded positions of sentence 0
    a = to_numpy(layer(Y, X, encoder_padding_mask=X_MASK))
    b = to_numpy(layer(Y, noisy, encoder_padding_mask=X_MASK))
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("normalize_first", [False, True])
def test_token_by_token_with_cache_equals_full_pass(normalize_first):
    layer = DecoderLayer(
        hidden_dim=8, intermediate_dim=16, num_heads=2, normalize_first=normalize_first
    )
    full = to_numpy(layer(Y, X, encoder_padding_mask=X_MASK))
    self_cache = ops.zeros((2, 2, 6, 2, 4))
    cross_cache = None
    for t in range(Y.shape[1]):
        out, self_cache, cross_cache = layer(
            Y[:, t : t + 1],
            X if cross_cache is None else None,
            encoder_padding_mask=X_MASK,
            self_attention_cache=self_cache,
            self_attention_cache_update_index=t,
            cross_attention_cache=cross_cache,
        )
        np.testing.assert_allclose(to_numpy(out)[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_returns_cross_attention_weights():
    layer = DecoderLayer(hidden_dim=8, intermediate_dim=16, num_heads=2)
    out, weights = layer(Y, X, encoder_padding_mask=X_MASK, return_attention_scores=True)
    weights = to_numpy(weights)
    assert weights.shape == (2, 2, 4, 6)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(weights[0, :, :, 4:], 0.0)


def test_needs_encoder_sequence_or_cache():
    layer = DecoderLayer(hidden_dim=8, intermediate_dim=16, num_heads=2)
    with pytest.raises(ValueError, match="encoder_sequence"):
        layer(Y)
