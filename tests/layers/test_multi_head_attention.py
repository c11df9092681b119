import keras
import numpy as np
import pytest
from keras import ops

from keras_transformer import MultiHeadAttention
from keras_transformer.ops import set_fused_attention
from tests.helpers import run_layer_test, to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax

RNG = np.random.default_rng(0)


@pytest.fixture(params=[True, False], ids=["fused", "plain"])
def attention_path(request):
    """Runs a test on the fused (`ops.dot_product_attention`) and the plain attention path."""
    set_fused_attention(request.param)
    yield request.param
    set_fused_attention(None)


def _x(*shape):
    return RNG.normal(size=shape).astype("float32")


def test_self_attention_contract():
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype="bool")
    run_layer_test(
        MultiHeadAttention,
        dict(num_heads=2, hidden_dim=8, dropout=0.1),
        dict(query=_x(2, 5, 8), key_padding_mask=mask, use_causal_mask=True),
        expected_output_shape=(2, 5, 8),
    )


def test_cross_attention_contract():
    run_layer_test(
        MultiHeadAttention,
        dict(num_heads=2, hidden_dim=8),
        dict(query=_x(2, 3, 8), value=_x(2, 6, 8), key_padding_mask=np.ones((2, 6), "bool")),
        expected_output_shape=(2, 3, 8),
    )


def _reference_attention(layer, query, value, mask):
    """Plain numpy attention with the layer's own weights."""
    w = {v.path.split("/")[-2] + "/" + v.name: to_numpy(v) for v in layer.weights}
    heads, head_dim = layer.num_heads, layer.head_dim

    def project(x, name):
        return np.einsum("btd,dnh->btnh", x, w[f"{name}/kernel"]) + w[f"{name}/bias"]

    q = project(query, "query_dense") / np.sqrt(head_dim)
    k = project(value, "key_dense")
    v = project(value, "value_dense")
    scores = np.einsum("btnh,bsnh->bnts", q, k)
    scores = np.where(mask[:, None], scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", weights, v)
    assert out.shape[2] == heads
    return np.einsum("btnh,nhd->btd", out, w["output_dense/kernel"]) + w["output_dense/bias"]


def test_matches_reference_with_explicit_attention_mask(attention_path):
    layer = MultiHeadAttention(num_heads=2, hidden_dim=8)
    query, value = _x(2, 3, 8), _x(2, 4, 8)
    mask = RNG.random((2, 3, 4)) > 0.4
    mask[..., 0] = True  # every query sees something
    out = to_numpy(layer(query, value, attention_mask=mask.astype("int32")))
    np.testing.assert_allclose(
        out, _reference_attention(layer, query, value, mask), rtol=1e-4, atol=1e-5
    )


def test_causal_mask_is_leak_free(attention_path):
    layer = MultiHeadAttention(num_heads=2, hidden_dim=8)
    x = _x(1, 6, 8)
    changed = x.copy()
    changed[:, 4:] = _x(1, 2, 8)
    a = to_numpy(layer(x, use_causal_mask=True))
    b = to_numpy(layer(changed, use_causal_mask=True))
    np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-6)
    assert not np.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_fully_masked_row_gives_zeros(policy):
    layer = MultiHeadAttention(num_heads=2, hidden_dim=8, dtype=policy)
    query, value = _x(2, 3, 8), _x(2, 4, 8)
    key_mask = np.array([[0, 0, 0, 0], [1, 1, 0, 0]], "bool")
    out, weights = layer(query, value, key_padding_mask=key_mask, return_attention_scores=True)
    weights = to_numpy(weights)
    assert np.isfinite(to_numpy(out)).all()
    np.testing.assert_array_equal(weights[0], 0.0)  # nothing to attend to
    np.testing.assert_allclose(weights[1].sum(-1), 1.0, atol=1e-2)
    np.testing.assert_array_equal(weights[1][..., 2:], 0.0)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_fully_masked_row_gives_zeros_on_both_paths(policy, attention_path):
    layer = MultiHeadAttention(num_heads=2, hidden_dim=8, dtype=policy)
    query, value = _x(2, 3, 8), _x(2, 4, 8)
    key_mask = np.array([[0, 0, 0, 0], [1, 1, 0, 0]], "bool")
    out = to_numpy(layer(query, value, key_padding_mask=key_mask))
    bias = to_numpy(layer.output_dense.weights[1])
    assert np.isfinite(out).all()
    # Nothing to attend to: the attended values are zero, so only the output bias is left.
    np.testing.assert_allclose(out[0], np.broadcast_to(bias, (3, 8)), atol=1e-6)
    assert not np.allclose(out[1], np.broadcast_to(bias, (3, 8)), atol=1e-3)


def test_padded_queries_output_bias_only(attention_path):
    layer = MultiHeadAttention(num_heads=2, hidden_dim=8)
    x = _x(1, 4, 8)
    out = to_numpy(layer(x, query_padding_mask=np.array([[1, 1, 0, 0]], "bool")))
    bias = to_numpy(layer.output_dense.weights[1])
    np.testing.assert_allclose(out[0, 2:], np.broadcast_to(bias, (2, 8)), atol=1e-6)


def test_cached_steps_equal_full_causal_pass(attention_path):
    layer = MultiHeadAttention(num_heads=2, hidden_dim=8)
    x = _x(2, 5, 8)
    full = to_numpy(layer(x, use_causal_mask=True))
    cache = ops.zeros((2, 2, 7, 2, 4))  # room for more than the 5 steps
    for t in range(5):
        step, cache = layer(
            x[:, t : t + 1], use_causal_mask=True, cache=cache, cache_update_index=t
        )
        np.testing.assert_allclose(to_numpy(step)[:, 0], full[:, t], rtol=1e-5, atol=1e-5)


def test_read_only_cache_equals_cross_attention(attention_path):
    layer = MultiHeadAttention(num_heads=2, hidden_dim=8)
    query, memory = _x(2, 3, 8), _x(2, 6, 8)
    expected = to_numpy(layer(query, memory))
    cache = layer.compute_key_value_cache(memory)
    out, same_cache = layer(query, cache=cache)
    np.testing.assert_allclose(to_numpy(out), expected, rtol=1e-5, atol=1e-6)
    assert same_cache is cache


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(num_heads=0, hidden_dim=8),
            "num_heads must be a positive integer. Received: num_heads=0",
        ),
        (dict(num_heads=3, hidden_dim=8), "divisible"),
        (dict(num_heads=2, hidden_dim=8, dropout=-0.1), "dropout"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**kwargs)


def test_weights_have_expected_names():
    layer = MultiHeadAttention(num_heads=2, hidden_dim=8, name="mha")
    layer(_x(1, 2, 8))
    names = sorted(w.path for w in layer.weights)
    assert "mha/query_dense/kernel" in names and "mha/output_dense/bias" in names
    assert keras.backend.standardize_dtype(layer.weights[0].dtype) == "float32"
