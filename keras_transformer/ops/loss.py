"""The label-smoothed cross-entropy per token, with a hand-written gradient."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer.ops import gradients


def label_smoothed_token_losses(y_true, logits, label_smoothing):
    """Per-token label-smoothed cross-entropy, float32, shape of `y_true`.

    The smoothed target puts `1 - label_smoothing` on the true token and
    spreads `label_smoothing` uniformly over the whole vocabulary:
    `(1 - e) * nll + e * mean_v(-log p_v)`, which is
    `logsumexp - (1 - e) * logit_y - e * mean_v(logit_v)`.

    The gradient is written by hand where
    `keras_transformer.ops.hand_written_gradients("loss")` says so:
    `softmax - smoothed target`, times the incoming gradient. Its backward
    pass keeps only the logits and one logsumexp per token, where automatic
    differentiation keeps the fused kernel's softmax and scatters the label
    gather's gradient into a zero `(batch, length, vocabulary)` tensor
    (docs/performance.md, "Training step": the `gradients` ablation's "autodiff
    loss" variant).

    Example:

    >>> losses = label_smoothed_token_losses(np.array([[3]]), np.zeros((1, 1, 8), "float32"), 0.1)
    >>> np.round(ops.convert_to_numpy(losses), 4)  # uniform logits: log(8)
    array([[2.0794]], dtype=float32)
    """
    logits = ops.cast(logits, "float32")
    labels = ops.cast(y_true, "int32")
    if not gradients.hand_written_gradients("loss"):
        return _plain_smoothed_cross_entropy(labels, logits, float(label_smoothing))
    return _smoothed_cross_entropy(labels, float(label_smoothing))(logits)


def _plain_smoothed_cross_entropy(labels, logits, smoothing):
    """The same per-token losses, left to automatic differentiation."""
    return _smoothed_losses(labels, logits, ops.logsumexp(logits, axis=-1), smoothing)


def _smoothed_losses(labels, logits, log_normalizer, smoothing, positions=None):
    """`logsumexp - (1 - e) * logit_y - e * mean_v(logit_v)`, shape `(B, T)`."""
    loss = log_normalizer - (1.0 - smoothing) * _true_logits(labels, logits, positions)
    if smoothing:
        loss = loss - smoothing * ops.mean(logits, axis=-1)
    return loss


def _smoothed_cross_entropy(labels, smoothing):
    """`logits -> per-token losses` with the hand-written gradient, for fixed `labels`."""
    confidence = 1.0 - smoothing

    @ops.custom_gradient
    def losses(logits):
        vocabulary_size = ops.shape(logits)[-1]
        # On TensorFlow the true labels are read and written as B*T scalars of
        # the flattened logits; found once here, used forward and backward.
        positions = None
        if keras.backend.backend() == "tensorflow":
            positions = _flat_label_positions(labels, vocabulary_size)
        log_normalizer = ops.logsumexp(logits, axis=-1)  # (B, T)
        loss = _smoothed_losses(labels, logits, log_normalizer, smoothing, positions)

        def grad(*args, upstream=None):
            upstream = args[0] if upstream is None else upstream
            upstream = ops.cast(upstream, "float32")
            probs = ops.exp(logits - ops.expand_dims(log_normalizer, -1))
            if smoothing:
                probs = probs - smoothing / ops.cast(vocabulary_size, "float32")
            gradient = probs * ops.expand_dims(upstream, -1)
            return _add_at_labels(gradient, labels, -confidence * upstream, positions)

        return loss, grad

    return losses


def _flat_label_positions(labels, vocabulary_size):
    """Positions of `labels` in the flattened `(B, T, V)` logits, int64."""
    # int64: B*T*V passes 2**31 at 58k tokens with a 37000-token vocabulary.
    rows = ops.arange(ops.size(labels), dtype="int64")
    return rows * ops.cast(vocabulary_size, "int64") + ops.cast(ops.reshape(labels, (-1,)), "int64")


def _true_logits(labels, logits, positions=None):
    """`logits[b, t, labels[b, t]]`, shape `(B, T)`; `positions` from `_flat_label_positions`."""
    if positions is None:
        return ops.squeeze(ops.take_along_axis(logits, ops.expand_dims(labels, -1), axis=-1), -1)
    return ops.reshape(ops.take(ops.reshape(logits, (-1,)), positions), ops.shape(labels))


def _add_at_labels(values, labels, amounts, positions=None):
    """`values` with `amounts[b, t]` added at `[b, t, labels[b, t]]`."""
    if positions is None:
        one_hot = ops.one_hot(labels, ops.shape(values)[-1], dtype=values.dtype)
        return values + one_hot * ops.expand_dims(amounts, -1)
    # A scatter of B*T scalars into the flattened tensor: no second (B, T, V) tensor.
    flat = ops.reshape(values, (-1,))
    updated = ops.take(flat, positions) + ops.reshape(amounts, (-1,))
    flat = ops.scatter_update(flat, ops.expand_dims(positions, -1), updated)
    return ops.reshape(flat, ops.shape(values))


def paired_symmetric_kl(logits):
    """`KL(p||q) + KL(q||p)` per token between rows `2i` and `2i + 1`, shape `(B/2, T)`.

    The consistency term of R-Drop (Liang et al., 2021, "R-Drop: Regularized
    Dropout for Neural Networks"): the batch holds every sentence twice, in
    adjacent rows, and dropout gives the two copies different sub-models.
    `KL(p||q) + KL(q||p) = sum_v (p_v - q_v) (log p_v - log q_v)`, in float32.

    Where `keras_transformer.ops.hand_written_gradients("loss")` says so, the
    gradient is written by hand: with `a = log p - log q`, the first copy's
    logits get `p * (a - E_p[a]) + p - q` and the second's `q * (E_q[a] - a) +
    q - p`, times the incoming gradient, recomputed from the logits and the
    two log-normalizers instead of kept from the forward pass.

    Example:

    >>> logits = np.zeros((2, 1, 4), "float32")  # one pair, equal distributions
    >>> float(paired_symmetric_kl(logits)[0, 0])
    0.0
    """
    logits = ops.cast(logits, "float32")
    if not gradients.hand_written_gradients("loss"):
        return _plain_paired_symmetric_kl(logits)
    return _paired_symmetric_kl(logits)


def _plain_paired_symmetric_kl(logits):
    log_p = ops.log_softmax(logits[0::2], axis=-1)
    log_q = ops.log_softmax(logits[1::2], axis=-1)
    return ops.sum((ops.exp(log_p) - ops.exp(log_q)) * (log_p - log_q), axis=-1)


@ops.custom_gradient
def _paired_symmetric_kl(logits):
    first, second = logits[0::2], logits[1::2]
    normalizers = (
        ops.logsumexp(first, axis=-1, keepdims=True),
        ops.logsumexp(second, axis=-1, keepdims=True),
    )

    def parts():
        log_p, log_q = first - normalizers[0], second - normalizers[1]
        return ops.exp(log_p), ops.exp(log_q), log_p - log_q

    p, q, a = parts()
    divergence = ops.sum((p - q) * a, axis=-1)

    def grad(*args, upstream=None):
        upstream = args[0] if upstream is None else upstream
        upstream = ops.expand_dims(ops.cast(upstream, "float32"), -1)
        p, q, a = parts()
        difference = p - q
        to_first = p * (a - ops.sum(p * a, axis=-1, keepdims=True)) + difference
        to_second = q * (ops.sum(q * a, axis=-1, keepdims=True) - a) - difference
        # Rows back in their places: 2i from the first copies, 2i + 1 from the second.
        paired = ops.stack([to_first * upstream, to_second * upstream], axis=1)
        return ops.reshape(paired, ops.shape(logits))

    return divergence, grad
