import keras
import numpy as np
import pytest
from keras import ops

from keras_transformer import DecoderLayer, EncoderLayer, TransformerConfig, build_transformer
from keras_transformer.ops import attention as attention_ops
from keras_transformer.ops import (
    dot_product_attention,
    fused_attention_enabled,
    set_fused_attention,
)
from tests.helpers import to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax

RNG = np.random.default_rng(3)


@pytest.fixture(autouse=True)
def _automatic_attention_path():
    yield
    set_fused_attention(None)


def _qkv(batch=2, query_len=5, key_len=6, heads=2, head_dim=4):
    def x(length):
        return RNG.normal(size=(batch, length, heads, head_dim)).astype("float32")

    return (x(query_len) / np.sqrt(head_dim)).astype("float32"), x(key_len), x(key_len)


def _mask(batch=2, query_len=5, key_len=6):
    mask = RNG.random((batch, query_len, key_len)) > 0.4
    mask[0, 1] = False  # one query with nothing to attend to
    return mask


def test_paths_agree_on_values():
    q, k, v = _qkv()
    mask = _mask()
    fused, no_weights = dot_product_attention(q, k, v, ops.convert_to_tensor(mask), fused=True)
    plain, weights = dot_product_attention(q, k, v, ops.convert_to_tensor(mask), fused=False)
    assert no_weights is None and tuple(weights.shape) == (2, 2, 5, 6)
    np.testing.assert_allclose(to_numpy(fused), to_numpy(plain), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(to_numpy(fused)[0, 1], 0.0)
    # Against numpy, on the rows that have keys.
    scores = np.einsum("btnh,bsnh->bnts", q, k)
    scores = np.where(mask[:, None], scores, -1e30)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    has_key = mask.any(-1)[:, :, None, None]  # (B, T, 1, 1)
    expected = np.einsum("bnts,bsnh->btnh", probs, v) * has_key
    np.testing.assert_allclose(to_numpy(fused), expected, rtol=1e-5, atol=1e-6)


def _gradients(fused, q, k, v, mask, upstream):
    """Gradients of sum(attention * upstream) wrt q, k and v."""
    if keras.backend.backend() == "jax":
        import jax

        def objective(q, k, v):
            out, _ = dot_product_attention(q, k, v, mask, fused=fused)
            return ops.sum(out * upstream)

        return [np.asarray(g) for g in jax.grad(objective, argnums=(0, 1, 2))(q, k, v)]
    import tensorflow as tf

    q, k, v = (tf.constant(t) for t in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out, _ = dot_product_attention(q, k, v, mask, fused=fused)
        objective = tf.reduce_sum(out * upstream)
    return [g.numpy() for g in tape.gradient(objective, [q, k, v])]


def test_paths_agree_on_gradients():
    q, k, v = _qkv()
    mask = ops.convert_to_tensor(_mask())
    upstream = RNG.normal(size=q.shape).astype("float32")
    fused = _gradients(True, q, k, v, mask, upstream)
    plain = _gradients(False, q, k, v, mask, upstream)
    for a, b in zip(fused, plain, strict=True):
        assert np.isfinite(a).all() and np.abs(a).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bfloat16_paths_agree_and_keep_the_dtype():
    q, k, v = (ops.cast(t, "bfloat16") for t in _qkv())
    mask = ops.convert_to_tensor(_mask())
    fused, _ = dot_product_attention(q, k, v, mask, fused=True)
    plain, _ = dot_product_attention(q, k, v, mask, fused=False)
    assert keras.backend.standardize_dtype(fused.dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(plain.dtype) == "bfloat16"
    np.testing.assert_allclose(to_numpy(fused), to_numpy(plain), atol=2e-2)


def test_switch_chooses_the_path(monkeypatch):
    calls = []
    original = ops.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("mask") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_ops.ops, "dot_product_attention", spy)
    q, k, v = _qkv()
    set_fused_attention(True)
    dot_product_attention(q, k, v)
    assert calls == [False]
    set_fused_attention(False)
    dot_product_attention(q, k, v)
    assert calls == [False]  # the plain path did not call it
    set_fused_attention(None)
    assert fused_attention_enabled() == (keras.backend.backend() != "tensorflow")  # on a CPU


def test_dropped_weights_take_the_plain_path(monkeypatch):
    monkeypatch.setattr(
        attention_ops.ops, "dot_product_attention", lambda *a, **k: pytest.fail("fused path")
    )
    dropout = keras.layers.Dropout(0.5, seed=1)
    q, k, v = _qkv()
    out, weights = dot_product_attention(q, k, v, dropout=dropout, training=True, fused=True)
    assert weights is not None and tuple(out.shape) == q.shape


def test_bad_switch_value():
    with pytest.raises(ValueError, match="enabled must be True, False or None. Received"):
        set_fused_attention("yes")


def test_attention_dropout_reaches_the_attention_layers():
    encoder = EncoderLayer(8, 16, 2, dropout=0.3, attention_dropout=0.0)
    decoder = DecoderLayer(8, 16, 2, dropout=0.3)
    assert encoder.self_attention.dropout == 0.0
    assert encoder.self_attention_dropout.rate == 0.3
    assert decoder.self_attention.dropout == decoder.cross_attention.dropout == 0.3
    assert EncoderLayer.from_config(encoder.get_config()).self_attention.dropout == 0.0
    # A layer config saved before the field existed reads as "same as dropout".
    old = {k: v for k, v in decoder.get_config().items() if k != "attention_dropout"}
    assert DecoderLayer.from_config(old).cross_attention.dropout == 0.3
    with pytest.raises(ValueError, match="attention_dropout"):
        EncoderLayer(8, 16, 2, attention_dropout=1.5)


def test_fused_training_matches_plain_training():
    """Without attention dropout, one fit step on either path gives the same weights."""
    config = TransformerConfig.from_preset("tiny", dropout=0.1, attention_dropout=0.0)
    source = RNG.integers(3, 64, size=(4, 7)).astype("int32")
    source[:, 5:] = 0
    target = RNG.integers(3, 64, size=(4, 6)).astype("int32")
    x = {"source_ids": source, "target_ids": target}
    y = np.roll(target, -1, axis=1)
    weights = {}
    for fused in (True, False):
        set_fused_attention(fused)
        keras.utils.set_random_seed(7)
        model = build_transformer(config)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.train_on_batch(x, y)
        weights[fused] = [to_numpy(w) for w in model.weights]
    for a, b in zip(weights[True], weights[False], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
