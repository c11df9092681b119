"""cuDNN's flash attention with key lengths (`ops.padded_attention`) against the plain path.

The kernel exists only under JAX on an NVIDIA GPU: elsewhere these tests
check that the path declines (returns None), and the comparisons skip. On a
GPU machine: `KERAS_BACKEND=jax python -m pytest tests/ops/test_padded_attention.py`.
"""

import keras
import numpy as np
import pytest

from keras_transformer import DecoderLayer, EncoderLayer
from keras_transformer.layers.masks import merge_masks
from keras_transformer.ops import dot_product_attention
from keras_transformer.ops.attention import padded_attention

pytestmark = pytest.mark.jax


def _on_gpu():
    if keras.backend.backend() != "jax":
        return False
    import jax

    return jax.devices()[0].platform == "gpu"


needs_gpu = pytest.mark.skipif(not _on_gpu(), reason="cuDNN attention: JAX on a GPU only")


def _inputs(lengths, query_len, key_len, dtype="bfloat16", seed=0):
    rng = np.random.default_rng(seed)
    batch = len(lengths)

    def x(length):
        return rng.normal(size=(batch, length, 8, 64)).astype("float32")

    q = keras.ops.cast(x(query_len) / 8.0, dtype)
    k, v = keras.ops.cast(x(key_len), dtype), keras.ops.cast(x(key_len), dtype)
    keep = np.arange(key_len)[None, :] < np.asarray(lengths)[:, None]
    return q, k, v, keep


def test_declines_off_the_gpu_and_in_float32():
    q, k, v, keep = _inputs([3, 5], 5, 5, dtype="float32")
    assert padded_attention(q, k, v, keep) is None  # float32 everywhere
    if not _on_gpu():
        q, k, v, keep = _inputs([3, 5], 5, 5)
        assert padded_attention(q, k, v, keep) is None


def _plain(q, k, v, keep, causal):
    mask = merge_masks(q.shape[1], k.shape[1], key_padding_mask=keep, use_causal_mask=causal)
    return dot_product_attention(q, k, v, mask, fused=False)[0]


def _close(a, b):
    a = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(a, "float32")))
    b = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(b, "float32")))
    np.testing.assert_allclose(a, b, atol=3e-2, rtol=3e-2)


def _as_float32(*arrays):
    return [np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(a, "float32"))) for a in arrays]


def _no_worse_than_plain(got, plain, exact):
    """`got` (cuDNN, bfloat16) is as near the float32 result as the plain bfloat16 path is."""
    got, plain, exact = _as_float32(got, plain, exact)
    assert np.all(np.isfinite(got))
    scale = np.abs(exact).max() + 1e-6
    assert np.abs(got - exact).max() <= 2 * np.abs(plain - exact).max() + 1e-2 * scale


@needs_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[37, 64, 1, 0], [64, 64, 64, 64]])
def test_values_and_gradients_match_the_plain_path(causal, lengths):
    import jax

    q, k, v, keep = _inputs(lengths, 64, 64)
    q32, k32, v32 = (keras.ops.cast(t, "float32") for t in (q, k, v))
    fused = padded_attention(q, k, v, keep, causal=causal)
    assert fused is not None
    _no_worse_than_plain(fused, _plain(q, k, v, keep, causal), _plain(q32, k32, v32, keep, causal))
    if 0 in lengths:  # a sentence with no key: zeros, as on the plain path
        assert not np.any(_as_float32(fused[lengths.index(0)])[0])

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v).astype("float32") ** 2).sum()

    grads = jax.grad(loss(lambda *a: padded_attention(*a, keep, causal=causal)), (0, 1, 2))
    plain = jax.grad(loss(lambda *a: _plain(*a, keep, causal)), (0, 1, 2))
    for got, want, exact in zip(grads(q, k, v), plain(q, k, v), plain(q32, k32, v32), strict=True):
        _no_worse_than_plain(got, want, exact)


@needs_gpu
def test_a_mask_that_is_not_right_padded_takes_the_general_path():
    q, k, v, keep = _inputs([5, 6], 6, 6)
    keep[0] = [False, True, True, False, True, True]  # holes: no key length describes it
    _close(padded_attention(q, k, v, keep), _plain(q, k, v, keep, False))


@needs_gpu
def test_layers_use_it_under_mixed_bfloat16():
    """An encoder and a decoder layer give the same output with the path and without."""
    from keras_transformer.ops import set_fused_attention

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        rng = np.random.default_rng(1)
        x = rng.normal(size=(3, 20, 64)).astype("float32")
        keep = np.arange(20)[None, :] < np.array([[20], [7], [13]])
        encoder = EncoderLayer(64, 128, 4)
        decoder = DecoderLayer(64, 128, 4)
        outputs = []
        for fused in (None, False):  # automatic (the cuDNN path), then plain
            set_fused_attention(fused)
            e = encoder(x, padding_mask=keep)
            outputs.append((e, decoder(x, e, decoder_padding_mask=keep, encoder_padding_mask=keep)))
        set_fused_attention(None)
        for got, want in zip(outputs[0], outputs[1], strict=True):
            _close(got * keep[..., None], want * keep[..., None])
    finally:
        keras.mixed_precision.set_global_policy("float32")
