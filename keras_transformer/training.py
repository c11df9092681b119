"""The paper's training recipe: schedule, optimizer, label-smoothed loss, accuracy."""

from __future__ import annotations

import keras
from keras import ops
from keras_transformer_runtime.specials import PAD_ID

from keras_transformer.ops.loss import label_smoothed_token_losses, paired_symmetric_kl
from keras_transformer.validation import check_consistency, check_positive_int, check_rate


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Warm-up then inverse square root decay (equation 3 of the paper).

    lr(step) = scale * hidden_dim^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

    Steps count from 1. Keras passes the optimizer's iteration counter, which
    starts at 0; step 0 is treated as step 1 so that the first update does not
    get a learning rate of zero. The maximum is reached at `warmup_steps`.

    With gradient accumulation Keras passes the count of micro-batches, not of
    updates; `accumulation_steps` divides it back so that warm-up and decay
    count optimizer updates.

    An optional linear cool-down ends the run at a learning rate of zero: over
    the last `cooldown_steps` of `total_steps` updates the curve is multiplied
    by `(total_steps - iteration) / cooldown_steps`, `iteration` being Keras'
    0-based update counter. A run whose length is known in
    advance then finishes annealed instead of at the inverse-square-root
    rate, which is what checkpoint averaging otherwise approximates.

    Args:
        hidden_dim: int. Model width d_model.
        warmup_steps: int. Length of the linear warm-up, in updates.
        scale: float. Multiplier on the whole curve.
        accumulation_steps: int. Micro-batches per update (the optimizer's
            `gradient_accumulation_steps`; 1 = none).
        total_steps: int or None. The run's length in updates; needed with
            `cooldown_steps`.
        cooldown_steps: int or None. Length of the final linear cool-down to
            zero, in updates, at most `total_steps`; None: no cool-down (the
            paper's curve).

    Example:

    >>> schedule = TransformerSchedule(hidden_dim=512, warmup_steps=4000)
    >>> float(schedule(4000))  # 512**-0.5 * 4000**-0.5
    0.000698771...
    """

    def __init__(
        self,
        hidden_dim,
        warmup_steps=4000,
        scale=1.0,
        accumulation_steps=1,
        total_steps=None,
        cooldown_steps=None,
    ):
        check_positive_int("hidden_dim", hidden_dim)
        check_positive_int("warmup_steps", warmup_steps)
        check_positive_int("accumulation_steps", accumulation_steps)
        if not isinstance(scale, (int, float)) or scale <= 0:
            raise ValueError(f"scale must be a positive number. Received: scale={scale!r}")
        if total_steps is not None:
            check_positive_int("total_steps", total_steps)
        if cooldown_steps is not None:
            check_positive_int("cooldown_steps", cooldown_steps)
            if total_steps is None:
                raise ValueError("cooldown_steps needs total_steps, the run's length in updates.")
            if cooldown_steps > total_steps:
                raise ValueError(
                    f"cooldown_steps ({cooldown_steps}) must be at most total_steps "
                    f"({total_steps})."
                )
        self.hidden_dim = hidden_dim
        self.warmup_steps = warmup_steps
        self.scale = float(scale)
        self.accumulation_steps = accumulation_steps
        self.total_steps = total_steps
        self.cooldown_steps = cooldown_steps

    def __call__(self, step):
        if self.accumulation_steps > 1:
            step = ops.floor_divide(step, self.accumulation_steps)
        iteration = ops.cast(step, "float32")
        step = ops.maximum(iteration, 1.0)
        warmup = ops.cast(self.warmup_steps, "float32")
        rate = ops.minimum(ops.rsqrt(step), step * warmup**-1.5)
        if self.cooldown_steps is not None:
            # Keras' counter runs 0 .. total_steps - 1: the first update of the
            # cool-down keeps the full rate, the last gets 1 / cooldown_steps.
            remaining = float(self.total_steps) - iteration
            rate = rate * ops.clip(remaining / float(self.cooldown_steps), 0.0, 1.0)
        return self.scale * self.hidden_dim**-0.5 * rate

    def get_config(self):
        return {
            "hidden_dim": self.hidden_dim,
            "warmup_steps": self.warmup_steps,
            "scale": self.scale,
            "accumulation_steps": self.accumulation_steps,
            "total_steps": self.total_steps,
            "cooldown_steps": self.cooldown_steps,
        }

    def peak(self) -> float:
        """The largest learning rate, reached after `warmup_steps` updates."""
        return self.scale * (self.hidden_dim * self.warmup_steps) ** -0.5


def transformer_optimizer(
    hidden_dim,
    warmup_steps=4000,
    scale=1.0,
    accumulation_steps=1,
    total_steps=None,
    cooldown_steps=None,
    **kwargs,
):
    """Adam as in section 5.3 (beta_1=0.9, beta_2=0.98, epsilon=1e-9) on `TransformerSchedule`.

    `accumulation_steps` > 1 averages the gradients of that many batches
    before each update (Keras' `gradient_accumulation_steps`), so one device
    reaches a large effective batch; the schedule counts updates. Extra
    keyword arguments (e.g. `clipnorm`, or another `epsilon`) go to
    `keras.optimizers.Adam`.
    """
    settings = dict(beta_1=0.9, beta_2=0.98, epsilon=1e-9) | kwargs
    return keras.optimizers.Adam(
        learning_rate=TransformerSchedule(
            hidden_dim, warmup_steps, scale, accumulation_steps, total_steps, cooldown_steps
        ),
        gradient_accumulation_steps=accumulation_steps if accumulation_steps > 1 else None,
        **settings,
    )


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
        predicted = ops.cast(ops.argmax(y_pred, axis=-1), "int32")
        hits = ops.cast(ops.equal(predicted, y_true), "float32") * mask
        self.correct.assign_add(ops.sum(hits))
        self.total.assign_add(ops.sum(mask))

    def result(self):
        return ops.divide_no_nan(self.correct, self.total)

    def reset_state(self):
        self.correct.assign(0.0)
        self.total.assign(0.0)
