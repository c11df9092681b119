"""Under JAX, the train step as two compiled programs: the loss and its gradients, compiled
once per batch shape, and the optimizer's update, compiled once.

Keras compiles its JAX train step as one program, so every new batch shape compiles
Adam's update of every variable again, although that update never changes shape. On
the `small` preset on a CPU the update is about a third of a shape's compile time
(docs/performance.md, "JAX on a CPU"). The two programs run one after the other on the
same arrays, so the result is Keras' own step's.

It needs three members of Keras' JAX trainer that are not public API (named in
`TRAINER_MEMBERS`); where one is missing, the model keeps Keras' own step.
"""

from __future__ import annotations

import functools
import os
import time
import typing

import keras

TRAINER_MEMBERS = ("_make_function", "_update_metrics_variables", "_get_state_sharding_spec")


def split_optimizer_update(model: keras.Model) -> bool:
    """Makes `model.fit` (and `train_on_batch`) run the train step as two programs under
    JAX. Returns whether it did: not under another backend, nor where the trainer lacks
    one of `TRAINER_MEMBERS`."""
    if keras.backend.backend() != "jax":
        return False
    if not all(hasattr(model, name) for name in TRAINER_MEMBERS):
        return False
    model.make_train_function = functools.partial(_make_train_function, model)
    return True


def _make_train_function(model, force=False):
    if model.train_function is not None and not force:
        return
    if model.run_eagerly or not model.jit_compile:
        type(model).make_train_function(model, force)
        return
    import jax

    grads_out = update_out = state_shardings = None
    distribution = keras.distribution.distribution()
    if distribution is not None:
        state_shardings = _on_the_mesh(model._get_state_sharding_spec(), distribution)
        trainable, non_trainable, optimizer, metrics = state_shardings
        grads_out = (None, trainable, non_trainable, metrics)
        update_out = (trainable, optimizer)

    def gradients(trainable, non_trainable, optimizer_variables, metrics, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
        (_, aux), grads = grad_fn(
            trainable,
            non_trainable,
            metrics,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=optimizer_variables,
        )
        unscaled_loss, y_pred, non_trainable, metrics = aux
        logs, metrics = model._update_metrics_variables(
            metrics, unscaled_loss, x, y, y_pred, sample_weight
        )
        return logs, grads, non_trainable, metrics

    def update(optimizer_variables, grads, trainable):
        return model.optimizer.stateless_apply(optimizer_variables, grads, trainable)

    # The trainable variables and the optimizer's are read by both programs, so only
    # the update may take their buffers over (the gradients' would have no output to
    # go to).
    gradients = jax.jit(gradients, donate_argnums=(1, 3), out_shardings=grads_out)
    update = jax.jit(update, donate_argnums=(0, 2), out_shardings=update_out)

    def train_step(state, data):
        if state_shardings is not None:
            state = tuple(map(_placed, state, state_shardings))
        trainable, non_trainable, optimizer_variables, metrics = state
        logs, grads, non_trainable, metrics = gradients(
            trainable, non_trainable, optimizer_variables, metrics, data
        )
        trainable, optimizer_variables = update(optimizer_variables, grads, trainable)
        return logs, (trainable, non_trainable, optimizer_variables, metrics)

    model.train_function = model._make_function(train_step)
    # Past Keras' attribute tracking, which would turn the tuple into a tracked list.
    object.__setattr__(
        model, "_keras_transformer_programs", _Programs(gradients, update, state_shardings)
    )


def _placed(arrays, shardings):
    """`arrays` put on `shardings` where they come fresh from the variables (or from
    `reset_metrics`): the first step's types are then the next steps' (one compile per
    shape, not two). Those the programs returned are left as they are."""
    import jax

    if arrays and type(arrays[0].sharding) is not type(shardings[0]):
        return jax.device_put(arrays, shardings)
    return arrays


class _Programs(typing.NamedTuple):
    """The two jitted programs of a model's train step, and the state's shardings."""

    gradients: object
    update: object
    state_shardings: object


class CompileAhead(keras.callbacks.Callback):
    """`compile_ahead` when `fit` begins (its metrics and optimizer built by then);
    `log(message)` is told how long it took."""

    def __init__(self, shapes, threads: int = 2, log=None):
        super().__init__()
        self.shapes, self.threads, self.log = list(shapes), threads, log

    def on_train_begin(self, logs=None):
        started = time.perf_counter()
        count = compile_ahead(self.model, self.shapes, self.threads)
        if count and self.log is not None:
            self.log(
                f"Compiled the train step for {count - 1} batch shapes ahead, "
                f"{self.threads} at a time, in {time.perf_counter() - started:.0f} s."
            )


def compile_ahead(model: keras.Model, shapes, threads: int = 2) -> int:
    """Compiles the train step for batches of each `(rows, length)` of `shapes` (inputs
    `source_ids` and `target_ids` and int32 labels of that shape) before `fit` meets
    them, on `threads` threads at once: XLA compiles the programs side by side, where
    `fit` would compile each when its first batch comes. The compiled programs are the
    ones `fit` then runs. The model's metrics and optimizer must be built (`fit` builds
    them: call it from `CompileAhead`). Returns how many it compiled: 0 where the model
    does not run the two-program step (`split_optimizer_update`)."""
    if "make_train_function" not in vars(model):
        return 0
    model.make_train_function()
    programs = getattr(model, "_keras_transformer_programs", None)
    if programs is None:
        return 0
    import concurrent.futures

    import jax

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    if programs.state_shardings is not None:  # as `train_step` places it
        state = tuple(map(_placed, state, programs.state_shardings))
    distribution = keras.distribution.distribution()

    def batch(shape):
        sharding = None
        if distribution is not None:
            sharding = distribution.get_data_layout(shape).backend_layout
        ids = jax.ShapeDtypeStruct(shape, "int32", sharding=sharding)
        return ({"source_ids": ids, "target_ids": ids}, ids)

    trainable, non_trainable, optimizer_variables, metrics = state

    def compile_one(shape):
        if shape is None:
            return programs.update.lower(optimizer_variables, trainable, trainable).compile()
        data = batch(shape)
        return programs.gradients.lower(
            trainable, non_trainable, optimizer_variables, metrics, data
        ).compile()

    jobs = [None, *sorted(set(shapes))]
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for _ in pool.map(compile_one, jobs):
            pass
    return len(jobs)


def _on_the_mesh(shardings, distribution):
    """`shardings` with each one-device sharding as the same device replicated over the
    distribution's mesh (a `DataParallel` of one device places the variables on that
    device alone, but a step's outputs come back typed with the data's mesh)."""
    import jax

    mesh = distribution.get_data_layout((1,)).backend_layout.mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def one(sharding):
        if isinstance(sharding, jax.sharding.SingleDeviceSharding) and mesh.size == 1:
            return replicated
        return sharding

    return jax.tree.map(one, shardings)


def ahead_of_fit(data, settings, log) -> list:
    """`[CompileAhead]` for a run's training batches under JAX (the `batch_shapes` of its
    stream's plan, or of its text files' stats; rows doubled under R-Drop), else `[]`."""
    known = data.stream.batch_shapes if data.stream is not None else data.train_stats.batch_shapes
    if keras.backend.backend() != "jax" or not known:
        return []
    twice = 2 if settings.rdrop_alpha else 1
    shapes = [(rows * twice, positions) for rows, positions in known]
    return [CompileAhead(shapes, threads=min(4, os.cpu_count() or 1), log=log)]
