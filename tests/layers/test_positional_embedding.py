import math

import keras
import numpy as np
import pytest

from keras_transformer import PositionalEmbedding
from keras_transformer.layers.positional_embedding import sinusoid_table
from tests.helpers import run_layer_test, to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax


def test_layer_contract():
    ids = np.array([[5, 7, 9, 0], [3, 2, 0, 0]], dtype="int32")
    run_layer_test(
        PositionalEmbedding,
        dict(vocabulary_size=16, hidden_dim=8, max_length=10, dropout=0.1),
        dict(inputs=ids),
        expected_output_shape=(2, 4, 8),
    )


@pytest.mark.parametrize("pos,i", [(0, 0), (1, 0), (3, 1), (17, 5), (49, 31), (63, 2)])
def test_sinusoid_table_matches_formula(pos, i):
    d = 64
    table = sinusoid_table(64, d)
    angle = pos / 10000 ** (2 * i / d)
    assert table.dtype == np.float32
    assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-6)
    assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-6)


def test_output_is_scaled_embedding_plus_table():
    layer = PositionalEmbedding(vocabulary_size=12, hidden_dim=6, max_length=8)
    ids = np.array([[4, 1, 11]], dtype="int32")
    out = to_numpy(layer(ids))
    embeddings = to_numpy(layer.embeddings)
    expected = embeddings[ids[0]] * math.sqrt(6) + sinusoid_table(8, 6)[:3]
    np.testing.assert_allclose(out[0], expected, rtol=1e-6, atol=1e-6)


def test_start_index_offsets_positions():
    layer = PositionalEmbedding(vocabulary_size=12, hidden_dim=6, max_length=8)
    ids = np.array([[4, 1, 11, 5]], dtype="int32")
    full = to_numpy(layer(ids))
    step = to_numpy(layer(ids[:, 2:3], start_index=2))
    np.testing.assert_allclose(step[0, 0], full[0, 2], rtol=1e-6)


def test_reverse_uses_the_embedding_matrix():
    layer = PositionalEmbedding(vocabulary_size=12, hidden_dim=6, max_length=8)
    layer.build()
    hidden = np.random.default_rng(0).normal(size=(2, 3, 6)).astype("float32")
    logits = layer(hidden, reverse=True)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    np.testing.assert_allclose(
        to_numpy(logits), hidden @ to_numpy(layer.embeddings).T, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("hidden_dim", [6, 7, 64])
def test_positions_past_max_length_follow_the_sinusoids(hidden_dim):
    """Past the table, positions are computed: the paper's formula at every position,
    the table's exact values inside it, also from a start index (cached decoding)."""
    layer = PositionalEmbedding(vocabulary_size=12, hidden_dim=hidden_dim, max_length=4)
    ids = np.full((1, 300), 5, "int32")
    outputs = to_numpy(layer(ids))[0]
    token = to_numpy(layer.embeddings)[5] * math.sqrt(hidden_dim)
    positions = outputs - token
    expected = sinusoid_table(300, hidden_dim)
    np.testing.assert_allclose(positions[:4], expected[:4], atol=1e-6)  # the exact table
    np.testing.assert_allclose(positions, expected, atol=5e-5)  # float32 angles up to 299
    step = to_numpy(layer(ids[:, :1], start_index=250))[0, 0] - token
    np.testing.assert_allclose(step, expected[250], atol=5e-5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(vocabulary_size=0, hidden_dim=4, max_length=4), "vocabulary_size=0"),
        (dict(vocabulary_size=4, hidden_dim=-1, max_length=4), "hidden_dim=-1"),
        (dict(vocabulary_size=4, hidden_dim=4, max_length=4, dropout=1.5), "dropout=1.5"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PositionalEmbedding(**kwargs)
