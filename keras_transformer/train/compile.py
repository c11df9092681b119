"""The model of a run, built in its precision and compiled for training with the paper's
optimizer, schedule and loss."""

from __future__ import annotations

import contextlib

import keras

from keras_transformer.config import TransformerConfig
from keras_transformer.losses import LabelSmoothedCrossEntropy, MaskedAccuracy
from keras_transformer.model import build_transformer
from keras_transformer.precision import resolve_precision
from keras_transformer.schedules import transformer_optimizer
from keras_transformer.train.jax_step import split_optimizer_update


def build_and_compile(
    config: TransformerConfig,
    strategy=None,
    precision: str = "float32",
    warmup_steps: int = 4000,
    learning_rate_scale: float = 1.0,
    label_smoothing: float = 0.1,
    jit_compile=False,
    accumulate_steps: int = 1,
    total_steps: int | None = None,
    cooldown_steps: int | None = None,
    rdrop_alpha: float = 0.0,
    learning_rate: float | None = None,
) -> keras.Model:
    """Builds `config` under `strategy`'s scope in `precision` and compiles it for training.

    Adam with the paper's schedule, `LabelSmoothedCrossEntropy` and
    `MaskedAccuracy`; `mixed_float16` gets Keras' loss scaling; "auto"
    precision is resolved by `keras_transformer.precision.resolve_precision`.
    `jit_compile` compiles the train step with XLA on TensorFlow; JAX always
    compiles it, as two programs (`keras_transformer.train.jax_step`).
    `accumulate_steps` > 1 averages that many batches' gradients per update.
    `cooldown_steps` of `total_steps` end the schedule with a linear fall to
    zero (`TransformerSchedule`). `rdrop_alpha` > 0 adds R-Drop's consistency
    term to the loss; the batches must then hold each sentence twice
    (`keras_transformer.data.pipeline.duplicate_rows`). `learning_rate`: a
    constant rate after the warm-up (fine-tuning) instead of the paper's curve.
    `strategy` (anything with a `scope()`: a `tf.distribute.Strategy`, or a
    `keras.distribution.Distribution` under JAX) places the variables; None
    is one device.

    Example:

    >>> from keras_transformer.distribute import make_strategy
    >>> strategy = make_strategy("mirrored")
    >>> model = build_and_compile(TransformerConfig.from_preset("small"), strategy)
    >>> model.fit(dataset, epochs=10)  # doctest: +SKIP
    """
    precision, _ = resolve_precision(precision)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    previous_policy = keras.config.dtype_policy()
    with scope:
        keras.config.set_dtype_policy(precision)
        try:
            model = build_transformer(config)
        finally:
            keras.config.set_dtype_policy(previous_policy)
        model.compile(
            optimizer=transformer_optimizer(
                config.hidden_dim,
                warmup_steps,
                learning_rate_scale,
                accumulate_steps,
                total_steps,
                cooldown_steps,
                constant=learning_rate,
            ),
            loss=LabelSmoothedCrossEntropy(label_smoothing, consistency=rdrop_alpha),
            metrics=[MaskedAccuracy()],
            # JAX without jit runs every op of a step on its own, each compiled per
            # shape: 3x slower than with it on the tiny preset (docs/distributed.md).
            jit_compile=jit_compile or keras.backend.backend() == "jax",
        )
        # The optimizer's slots now, not on first use: built inside the first
        # trace of the training step, they make TensorFlow trace it twice.
        model.optimizer.build(model.trainable_variables)
    split_optimizer_update(model)
    return model
