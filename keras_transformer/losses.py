"""The paper's label-smoothed cross-entropy (with R-Drop's consistency term) and the
token accuracy it is reported with; both skip padding."""

from __future__ import annotations

import keras
from keras import ops
from keras_transformer_runtime.specials import PAD_ID

from keras_transformer.checks import check_consistency, check_rate
from keras_transformer.ops.loss import label_smoothed_token_losses, paired_symmetric_kl


def _real_token_mask(y_true):
    return ops.cast(ops.not_equal(ops.cast(y_true, "int32"), PAD_ID), "float32")


def _token_weights(y_true, sample_weight):
    """1 on real tokens, 0 on padding, times a per-token or per-sentence weight."""
    weights = _real_token_mask(y_true)
    if sample_weight is None:
        return weights
    sample_weight = ops.cast(sample_weight, "float32")
    if len(sample_weight.shape) == 1:
        sample_weight = ops.expand_dims(sample_weight, -1)
    return weights * sample_weight


def _first_max_index(logits):
    """`argmax` over the last axis (the first index of the maximum), int32.

    Under JAX written as a maximum, then the least index that reaches it: XLA's
    CPU code for `argmax` is a reduction over (value, index) pairs that ran at
    18.5 ms for the `small` preset's 1,024 x 8,000 logits, a tenth of the
    training step; the two plain reductions take about a millisecond
    (docs/performance.md, "JAX on a CPU").
    """
    if keras.backend.backend() != "jax":
        return ops.cast(ops.argmax(logits, axis=-1), "int32")
    size = ops.shape(logits)[-1]
    reached = ops.equal(logits, ops.max(logits, axis=-1, keepdims=True))
    return ops.min(ops.where(reached, ops.arange(size, dtype="int32"), size), axis=-1)


def _sum_over_replicas(value):
    """`value` summed over the replicas of a running `tf.distribute` step (else unchanged)."""
    if keras.backend.backend() != "tensorflow":
        return value
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


@keras.saving.register_keras_serializable(package="keras_transformer")
class LabelSmoothedCrossEntropy(keras.losses.Loss):
    """Label-smoothed cross-entropy over logits that ignores padding labels (id 0).

    The result is the mean over real (non-padding) target tokens, computed in
    float32. Under a `tf.distribute` strategy it is the mean over the real
    tokens of the global batch, not a mean of per-replica means. A batch with no real token gives 0. `sample_weight`, when given,
    weights each token `(batch_size, target_len)` or sentence `(batch_size,)`
    on top of the padding mask.

    With `consistency` alpha > 0 (R-Drop, Liang et al. 2021) the batch must
    hold every sentence twice, in adjacent rows (`duplicate_rows`), and each
    token's loss gains `alpha / 4 * (KL(p||q) + KL(q||p))` between its two
    copies: per pair, half of R-Drop's `ce_1 + ce_2 + alpha / 2 * (KL(p||q) +
    KL(q||p))`. Under training the copies see different dropout masks; in
    evaluation they agree and the term is zero, so the validation loss stays
    the plain cross-entropy.

    Args:
        label_smoothing: float in [0, 1). 0.1 in the paper (section 5.4).
        consistency: float >= 0, R-Drop's alpha; 0 (default): none.

    Example:

    >>> loss = LabelSmoothedCrossEntropy(0.1)
    >>> value = loss(np.array([[3, 0]]), np.zeros((1, 2, 8), "float32"))  # one real token
    >>> round(float(value), 4)  # uniform logits: log(8), whatever the smoothing
    2.0794
    """

    def __init__(
        self, label_smoothing=0.1, consistency=0.0, name="label_smoothed_cross_entropy", **kwargs
    ):
        check_rate("label_smoothing", label_smoothing)
        check_consistency(consistency)
        kwargs.pop("reduction", None)
        super().__init__(name=name, reduction="sum", dtype="float32", **kwargs)
        self.label_smoothing = float(label_smoothing)
        self.consistency = float(consistency)

    def _token_losses(self, y_true, y_pred):
        losses = label_smoothed_token_losses(y_true, y_pred, self.label_smoothing)
        if self.consistency:
            divergence = ops.repeat(paired_symmetric_kl(y_pred), 2, axis=0)
            losses = losses + (self.consistency / 4.0) * divergence
        return losses

    def __call__(self, y_true, y_pred, sample_weight=None):
        mask = _token_weights(y_true, sample_weight)
        losses = self._token_losses(y_true, y_pred)
        # Under tf.distribute each replica divides its own sum by the real-token
        # count of the whole global batch; the summed gradients are then those
        # of the global mean, whatever the replicas' shares of padding.
        return ops.divide_no_nan(ops.sum(losses * mask), _sum_over_replicas(ops.sum(mask)))

    def call(self, y_true, y_pred):
        # Unreduced per-token losses (padding zeroed), for callers that want them.
        return self._token_losses(y_true, y_pred) * _real_token_mask(y_true)

    def get_config(self):
        return {
            "label_smoothing": self.label_smoothing,
            "consistency": self.consistency,
            "name": self.name,
        }


@keras.saving.register_keras_serializable(package="keras_transformer")
class MaskedAccuracy(keras.metrics.Metric):
    """Token accuracy over real (non-padding) target tokens.

    Example:

    >>> metric = MaskedAccuracy()
    >>> logits = np.eye(4, dtype="float32")[[[2, 1, 0]]]  # predicts 2, 1, 0
    >>> metric.update_state(np.array([[2, 3, 0]]), logits)  # the padding position is ignored
    >>> float(metric.result())
    0.5
    """

    def __init__(self, name="masked_accuracy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.correct = self.add_variable(shape=(), initializer="zeros", name="correct")
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = ops.cast(y_true, "int32")
        mask = _token_weights(y_true, sample_weight)
        predicted = _first_max_index(y_pred)
        hits = ops.cast(ops.equal(predicted, y_true), "float32") * mask
        self.correct.assign_add(ops.sum(hits))
        self.total.assign_add(ops.sum(mask))

    def result(self):
        return ops.divide_no_nan(self.correct, self.total)

    def reset_state(self):
        self.correct.assign(0.0)
        self.total.assign(0.0)
