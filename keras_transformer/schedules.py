"""The paper's learning-rate schedule (equation 3) and the Adam optimizer that follows it."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer.checks import check_positive_int


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
        constant: float or None. A fixed learning rate reached by a linear
            warm-up over `warmup_steps` and then kept (fine-tuning a trained
            model), instead of the paper's curve; `scale` and `hidden_dim`
            then play no part. The cool-down applies to it as well.

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
        constant=None,
    ):
        check_positive_int("hidden_dim", hidden_dim)
        if constant is not None and not (isinstance(constant, (int, float)) and constant > 0):
            raise ValueError(f"constant must be a positive number. Received: constant={constant!r}")
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
        self.constant = None if constant is None else float(constant)

    def __call__(self, step):
        if self.accumulation_steps > 1:
            step = ops.floor_divide(step, self.accumulation_steps)
        iteration = ops.cast(step, "float32")
        step = ops.maximum(iteration, 1.0)
        warmup = ops.cast(self.warmup_steps, "float32")
        if self.constant is not None:
            rate = self.constant * ops.minimum(1.0, step / warmup)
        else:
            rate = (
                self.scale
                * self.hidden_dim**-0.5
                * ops.minimum(ops.rsqrt(step), step * warmup**-1.5)
            )
        if self.cooldown_steps is not None:
            # Keras' counter runs 0 .. total_steps - 1: the first update of the
            # cool-down keeps the full rate, the last gets 1 / cooldown_steps.
            remaining = float(self.total_steps) - iteration
            rate = rate * ops.clip(remaining / float(self.cooldown_steps), 0.0, 1.0)
        return rate

    def get_config(self):
        return {
            "hidden_dim": self.hidden_dim,
            "warmup_steps": self.warmup_steps,
            "scale": self.scale,
            "accumulation_steps": self.accumulation_steps,
            "total_steps": self.total_steps,
            "cooldown_steps": self.cooldown_steps,
            "constant": self.constant,
        }

    def peak(self) -> float:
        """The largest learning rate, reached after `warmup_steps` updates."""
        if self.constant is not None:
            return self.constant
        return self.scale * (self.hidden_dim * self.warmup_steps) ** -0.5


def transformer_optimizer(
    hidden_dim,
    warmup_steps=4000,
    scale=1.0,
    accumulation_steps=1,
    total_steps=None,
    cooldown_steps=None,
    constant=None,
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
            hidden_dim,
            warmup_steps,
            scale,
            accumulation_steps,
            total_steps,
            cooldown_steps,
            constant,
        ),
        gradient_accumulation_steps=accumulation_steps if accumulation_steps > 1 else None,
        **settings,
    )
