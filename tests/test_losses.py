"""The label-smoothed loss, R-Drop's consistency term and the token accuracy
(keras_transformer.losses)."""

import math

import keras
import numpy as np
import pytest

from keras_transformer import LabelSmoothedCrossEntropy, MaskedAccuracy
from tests.helpers import to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax


def _hand_loss(labels, logits, eps):
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] == 0:
                continue
            z = logits[b, t].astype(np.float64)
            log_p = z - (z.max() + math.log(np.exp(z - z.max()).sum()))
            vocab = len(z)
            target = np.full(vocab, eps / vocab)
            target[labels[b, t]] += 1.0 - eps
            total += -(target * log_p).sum()
            count += 1
    return total / count


@pytest.mark.usefixtures("loss_gradient_path")
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_equals_hand_computation(eps):
    rng = np.random.default_rng(0)
    labels = np.array([[3, 1, 4, 0, 0], [2, 2, 0, 0, 0]], "int32")
    logits = rng.normal(size=(2, 5, 6)).astype("float32")
    loss = float(to_numpy(LabelSmoothedCrossEntropy(eps)(labels, logits)))
    assert loss == pytest.approx(_hand_loss(labels, logits, eps), rel=1e-5)


def test_padded_positions_contribute_nothing():
    rng = np.random.default_rng(1)
    labels = np.array([[3, 1, 0, 0]], "int32")
    logits = rng.normal(size=(1, 4, 6)).astype("float32")
    changed = logits.copy()
    changed[:, 2:] = rng.normal(size=(1, 2, 6)) * 100
    loss = LabelSmoothedCrossEntropy(0.1)
    assert float(to_numpy(loss(labels, logits))) == float(to_numpy(loss(labels, changed)))
    # All padding: zero, not NaN.
    assert float(to_numpy(loss(np.zeros((1, 4), "int32"), logits))) == 0.0


def test_loss_is_float32_under_float16_logits():
    labels = np.array([[3, 1]], "int32")
    logits = np.random.default_rng(2).normal(size=(1, 2, 6)).astype("float16")
    value = LabelSmoothedCrossEntropy(0.1)(labels, logits)
    assert keras.backend.standardize_dtype(value.dtype) == "float32"
    assert float(to_numpy(value)) == pytest.approx(
        _hand_loss(labels, logits.astype("float32"), 0.1), rel=1e-4
    )


def test_loss_serializes_and_validates():
    loss = LabelSmoothedCrossEntropy(0.2)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    assert restored.label_smoothing == 0.2
    with pytest.raises(ValueError, match="label_smoothing"):
        LabelSmoothedCrossEntropy(1.0)


def test_masked_accuracy_counts_real_tokens_only():
    metric = MaskedAccuracy()
    labels = np.array([[3, 1, 0], [2, 0, 0]], "int32")
    logits = np.zeros((2, 3, 5), "float32")
    logits[0, 0, 3] = logits[0, 1, 4] = logits[1, 0, 2] = 1.0  # 2 of 3 right
    logits[0, 2, 0] = logits[1, 1, 0] = logits[1, 2, 0] = 1.0  # "right" on padding
    metric.update_state(labels, logits)
    assert float(to_numpy(metric.result())) == pytest.approx(2 / 3)
    metric.reset_state()
    assert float(to_numpy(metric.result())) == 0.0


def test_masked_accuracy_takes_the_first_of_tied_maxima_as_argmax_does():
    metric = MaskedAccuracy()
    labels = np.array([[3, 2, 4]], "int32")
    logits = np.full((1, 3, 5), -np.inf, "float32")
    logits[0, 0, [1, 3]] = 2.0  # the label ties with an earlier piece: argmax says 1, a miss
    logits[0, 1, [2, 4]] = -1.0  # the label ties with a later piece: argmax says 2, a hit
    logits[0, 2] = 0.5  # all tied: argmax says 0, a miss
    metric.update_state(labels, logits)
    assert float(to_numpy(metric.result())) == pytest.approx(1 / 3)


def test_sentence_weights_combine_with_the_padding_mask():
    rng = np.random.default_rng(3)
    labels = np.array([[3, 1, 0], [2, 2, 4]], "int32")
    logits = rng.normal(size=(2, 3, 6)).astype("float32")
    loss = LabelSmoothedCrossEntropy(0.1)
    first_only = float(to_numpy(loss(labels[:1], logits[:1])))
    weighted = float(to_numpy(loss(labels, logits, sample_weight=np.array([1.0, 0.0]))))
    assert weighted == pytest.approx(first_only, rel=1e-6)
    metric = MaskedAccuracy()
    metric.update_state(labels, logits, sample_weight=np.array([0.0, 1.0]))
    expected = (logits[1].argmax(-1) == labels[1]).mean()
    assert float(to_numpy(metric.result())) == pytest.approx(expected)


def _loss_gradient(loss, labels, logits):
    if keras.backend.backend() == "jax":
        import jax

        return np.asarray(jax.grad(lambda x: loss(labels, x))(logits))
    import tensorflow as tf

    x = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = loss(labels, x)
    return tape.gradient(value, x).numpy()


@pytest.fixture(params=[True, False], ids=["hand-written", "automatic"])
def loss_gradient_path(request, monkeypatch):
    """Runs a test with the loss's hand-written gradient and with automatic differentiation."""
    from keras_transformer.ops import gradients

    monkeypatch.setattr(gradients, "hand_written_gradients", lambda part: request.param)
    return request.param


@pytest.mark.usefixtures("loss_gradient_path")
def test_loss_gradient_is_softmax_minus_smoothed_target():
    eps, vocabulary = 0.1, 7
    rng = np.random.default_rng(2)
    labels = np.array([[3, 1, 6, 0], [2, 5, 0, 0]], "int32")
    logits = rng.normal(size=(2, 4, vocabulary)).astype("float32")
    gradient = _loss_gradient(LabelSmoothedCrossEntropy(eps), labels, logits)
    softmax = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    target = np.full(logits.shape, eps / vocabulary)
    target[np.arange(2)[:, None], np.arange(4)[None], labels] += 1 - eps
    expected = (softmax - target) * (labels != 0)[..., None] / (labels != 0).sum()
    np.testing.assert_allclose(gradient, expected, atol=1e-6)


@pytest.mark.usefixtures("loss_gradient_path")
def test_loss_and_gradient_stay_exact_when_logits_spread_far():
    # The true token's probability underflows float32 (its logit is 1000
    # below the largest): the loss must still be the exact ~1000 nats, not inf.
    eps, vocabulary = 0.1, 6
    labels = np.array([[2, 4]], "int32")
    logits = np.zeros((1, 2, vocabulary), "float32")
    logits[0, 0] = [500.0, -3.0, -500.0, 1.0, 0.0, 2.0]
    logits[0, 1] = [-1.0, 0.5, 0.0, 3.0, 2.0, -2.0]
    loss = LabelSmoothedCrossEntropy(eps)
    value = float(to_numpy(loss(labels, logits)))
    assert value == pytest.approx(_hand_loss(labels, logits, eps), rel=1e-5)
    assert value > 400
    gradient = _loss_gradient(loss, labels, logits)
    assert np.isfinite(gradient).all()
    # The first token: softmax is one-hot on the 500 logit.
    expected = -np.full(vocabulary, eps / vocabulary)
    expected[0] += 1.0
    expected[2] -= 1 - eps
    np.testing.assert_allclose(gradient[0, 0], expected / 2, atol=1e-6)


def _hand_symmetric_kl(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    log_p = a - np.log(np.exp(a).sum(-1, keepdims=True))
    log_q = b - np.log(np.exp(b).sum(-1, keepdims=True))
    return (np.exp(log_p) * (log_p - log_q)).sum(-1) + (np.exp(log_q) * (log_q - log_p)).sum(-1)


@pytest.mark.usefixtures("loss_gradient_path")
def test_rdrop_consistency_adds_the_pairs_symmetric_kl():
    """Rows 2i and 2i+1 are two copies of one sentence: the loss is the plain mean
    plus alpha / 4 times their symmetric KL, averaged over the real tokens."""
    eps, alpha = 0.1, 5.0
    rng = np.random.default_rng(4)
    one = np.array([[3, 1, 4, 0], [2, 2, 0, 0]], "int32")
    labels = np.repeat(one, 2, axis=0)
    logits = rng.normal(size=(4, 4, 6)).astype("float32")
    plain = _hand_loss(labels, logits, eps)
    divergence = _hand_symmetric_kl(logits[0::2], logits[1::2])  # (2, 4)
    real = one != 0
    expected = plain + alpha / 4 * 2 * (divergence * real).sum() / (2 * real.sum())
    loss = LabelSmoothedCrossEntropy(eps, consistency=alpha)
    assert float(to_numpy(loss(labels, logits))) == pytest.approx(expected, rel=1e-5)
    assert expected > plain + 0.1  # the term is not negligible here
    # Copies that agree (no dropout, as in validation) add nothing.
    same = np.repeat(logits[0::2], 2, axis=0)
    assert float(to_numpy(loss(labels, same))) == pytest.approx(
        _hand_loss(labels, same, eps), rel=1e-6
    )
    # The term pulls each copy towards the other: its gradient is not zero.
    gradient = _loss_gradient(loss, labels, logits)
    plain_gradient = _loss_gradient(LabelSmoothedCrossEntropy(eps), labels, logits)
    assert np.abs(gradient - plain_gradient).max() > 1e-3
    assert np.isfinite(gradient).all()


@pytest.mark.usefixtures("loss_gradient_path")
def test_rdrop_gradient_pulls_each_copy_towards_the_other():
    """The R-Drop loss's gradient against its float64 closed form: the plain
    cross-entropy's, plus for the first copy of a pair `alpha / 2 * (p * (a -
    E_p[a]) + p - q)` per real token (`a = log p - log q`; the pair's term is
    in both copies' losses) and the mirror image for the second."""
    eps, alpha = 0.1, 5.0
    rng = np.random.default_rng(5)
    one = np.array([[3, 1, 4, 0], [2, 2, 0, 0], [5, 1, 1, 2]], "int32")
    labels = np.repeat(one, 2, axis=0)
    logits = rng.normal(scale=2.0, size=(6, 4, 7)).astype("float32")
    gradient = _loss_gradient(LabelSmoothedCrossEntropy(eps, consistency=alpha), labels, logits)
    plain = _loss_gradient(LabelSmoothedCrossEntropy(eps), labels, logits)
    z = logits.astype(np.float64)
    log_p = z[0::2] - np.log(np.exp(z[0::2]).sum(-1, keepdims=True))
    log_q = z[1::2] - np.log(np.exp(z[1::2]).sum(-1, keepdims=True))
    p, q, a = np.exp(log_p), np.exp(log_q), log_p - log_q
    real = (one != 0)[..., None]
    scale = alpha / 4 * 2 * real / (2 * real.sum())
    expected = np.zeros_like(z)
    expected[0::2] = scale * (p * (a - (p * a).sum(-1, keepdims=True)) + p - q)
    expected[1::2] = scale * (q * ((q * a).sum(-1, keepdims=True) - a) + q - p)
    np.testing.assert_allclose(gradient - plain, expected, atol=1e-6)
    assert np.abs(expected).max() > 1e-2


def test_rdrop_consistency_serializes_and_validates():
    loss = LabelSmoothedCrossEntropy(0.1, consistency=2.5)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
    assert (restored.label_smoothing, restored.consistency) == (0.1, 2.5)
    for bad in (-1.0, float("nan"), float("inf"), "5"):
        with pytest.raises(ValueError, match="R-Drop alpha"):
            LabelSmoothedCrossEntropy(0.1, consistency=bad)
