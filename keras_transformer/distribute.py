"""Training under `tf.distribute`: choosing a strategy, building under its scope, chief/worker roles.

`MirroredStrategy` copies the model onto every device of one machine (GPUs, or
logical CPU devices); `MultiWorkerMirroredStrategy` spans machines, reading the
cluster from the `TF_CONFIG` environment variable. Both split each global
batch across the replicas and sum the gradients; `LabelSmoothedCrossEntropy`
divides by the real-token count of the global batch, so the update equals the
one-device update on the same batch.

TensorFlow backend only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import types

import keras
import numpy as np

STRATEGIES = ("default", "mirrored", "multi-worker")


def _require_tensorflow_backend():
    import keras

    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "tf.distribute strategies need the TensorFlow backend; "
            f"KERAS_BACKEND is {keras.backend.backend()!r}."
        )


_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
    '"task": {"type": "worker", "index": 0}}'
)


def cluster_spec() -> dict | None:
    """The parsed and checked `TF_CONFIG`, or None when it is unset.

    Raises:
        ValueError: naming what is wrong, when `TF_CONFIG` is not JSON, lacks
            `cluster` or `task`, lists a job that is not a list of `"host:port"`
            addresses, or names a task that is not in the cluster.
    """
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"TF_CONFIG is not valid JSON: {error}") from error
    if not isinstance(spec, dict) or "cluster" not in spec or "task" not in spec:
        raise ValueError(f'TF_CONFIG must hold "cluster" and "task", e.g. {_TF_CONFIG_EXAMPLE}.')
    cluster, task = spec["cluster"], spec["task"]
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(
            'TF_CONFIG\'s "cluster" must map job names to address lists, e.g. '
            f'{{"worker": ["host1:12345", "host2:12345"]}}. Received: {cluster!r}'
        )
    for job, addresses in cluster.items():
        if (
            not isinstance(addresses, list)
            or not addresses
            or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in addresses)
        ):
            raise ValueError(
                f'TF_CONFIG\'s cluster job "{job}" must be a list of "host:port" addresses. '
                f"Received: {addresses!r}"
            )
    if not isinstance(task, dict) or task.get("type") not in cluster:
        raise ValueError(
            'TF_CONFIG\'s "task" must name a job of the cluster '
            f'({", ".join(cluster)}), e.g. {{"type": "worker", "index": 0}}. Received: {task!r}'
        )
    index, addresses = task.get("index", 0), cluster[task["type"]]
    if not isinstance(index, int) or not 0 <= index < len(addresses):
        raise ValueError(
            f"TF_CONFIG's task index must be between 0 and {len(addresses) - 1} (the cluster "
            f'lists {len(addresses)} "{task["type"]}" addresses). Received: index={index!r}'
        )
    return spec


def make_strategy(name: str = "default", devices=None):
    """Returns the `tf.distribute.Strategy` called `name`.

    Args:
        name: `"default"` (one device), `"mirrored"` (all GPUs of this machine,
            or `devices`), or `"multi-worker"` (the cluster in `TF_CONFIG`).
        devices: list of str. Devices for `"mirrored"`, e.g. `["/cpu:0", "/cpu:1"]`.
    """
    _require_tensorflow_backend()
    import tensorflow as tf

    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}. Received: {name!r}")
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy(devices=devices)
    spec = cluster_spec()
    if spec is None:
        raise ValueError(
            "--strategy multi-worker reads the cluster from TF_CONFIG, which is not set. "
            "See the README for a TF_CONFIG example for each worker."
        )
    return tf.distribute.MultiWorkerMirroredStrategy()


def is_chief(strategy=None) -> bool:
    """True on the process that owns the run directory.

    That is the `chief` task when the cluster has one, otherwise worker 0, and
    always the single process of a one-machine run.
    """
    spec = cluster_spec()
    if spec is None:
        return True
    task = spec["task"]
    if task.get("type") == "chief":
        return True
    if "chief" in spec["cluster"]:
        return False
    return task.get("type") == "worker" and int(task.get("index", 0)) == 0


def working_directory(out_dir: str) -> str:
    """`out_dir` on the chief; a folder of its own in the system's temporary space elsewhere.

    Every worker writes its checkpoints and backups (the writes are collective
    in multi-worker Keras), but only the chief's copy is kept. A worker's
    folder is named after the run and the worker's task, so a restarted worker
    finds its own backup again.
    """
    if is_chief():
        return out_dir
    task = cluster_spec()["task"]
    digest = hashlib.sha1(os.path.abspath(out_dir).encode()).hexdigest()[:12]
    path = os.path.join(
        tempfile.gettempdir(), f"keras-transformer-{digest}-{task['type']}-{task['index']}"
    )
    os.makedirs(path, exist_ok=True)
    return path


def is_multi_worker(strategy) -> bool:
    """True for a `MultiWorkerMirroredStrategy` whose cluster has more than one task."""
    if strategy is None:
        return False
    import tensorflow as tf

    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


# ------------------------------------------------ Keras 3 fit under MultiWorkerMirroredStrategy
#
# Keras 3 (checked on 3.15) `Model.fit` on the TensorFlow backend fails under a
# multi-worker MultiWorkerMirroredStrategy in two places
# (keras-team/keras#20585, #20329), both in keras/src/backend/tensorflow/trainer.py:
#
# 1. `TensorFlowTrainer._maybe_symbolic_build` takes the first distributed batch
#    and `strategy.reduce("MEAN", batch)`s it across workers only to learn its
#    shapes: a collective over integer token ids whose shapes differ between
#    workers (each holds its own share of a token-budget batch).
# 2. `reduce_per_replica(..., reduction="auto")` turns the step's scalar logs
#    into `strategy.reduce("MEAN", value, axis=0)`: `axis` there means an axis
#    *inside* each value, which a scalar does not have. The single-machine path
#    of the same function averages over replicas (`tf.reduce_mean` of the local
#    results, axis 0 being the replica axis); the multi-worker equivalent is
#    `strategy.reduce("MEAN", value, axis=None)`.
#
# `enable_multi_worker_fit` fixes both, for multi-worker strategies only: the
# symbolic build reads shapes from the dataset's `element_spec` instead of a
# reduced batch, and the logs are averaged over replicas with `axis=None`. The
# gradients, the optimizer step and the loss are Keras' and TensorFlow's own.


def _symbolic_build_from_specs(model, iterator=None, data_batch=None):
    """`_maybe_symbolic_build` that needs no collective: shapes come from the dataset's specs."""
    if data_batch is None and iterator is not None:
        data_batch = iterator.data_adapter.get_tf_dataset().element_spec
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data_batch)


def _reduce_per_replica_multi_worker(original, values, strategy, reduction):
    if reduction in ("auto", "mean") and is_multi_worker(strategy):
        from keras import tree

        return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
    return original(values, strategy, reduction)


def enable_multi_worker_fit(model, strategy):
    """Lets `model.fit` and `model.evaluate` run under a multi-worker `strategy` (Keras 3).

    A no-op for any other strategy. See the comment above for the two Keras
    bugs this works around; remove it when Keras fixes them.

    Args:
        model: a compiled `keras.Model` built under `strategy.scope()`.
        strategy: the `tf.distribute.Strategy` the model was built under.

    Returns:
        `model`.
    """
    if not is_multi_worker(strategy):
        return model
    from keras.src.backend.tensorflow import trainer

    if not (
        hasattr(trainer, "reduce_per_replica")
        and hasattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build")
        and hasattr(trainer.TensorFlowTrainer, "_symbolic_build")
    ):
        raise RuntimeError(
            "This Keras version changed the trainer internals that "
            "keras_transformer.distribute.enable_multi_worker_fit patches; check whether "
            "keras-team/keras#20585 is fixed and update the workaround."
        )
    if not getattr(trainer.reduce_per_replica, "_keras_transformer_patch", False):
        patched = functools.partial(_reduce_per_replica_multi_worker, trainer.reduce_per_replica)
        patched._keras_transformer_patch = True
        # Looked up at trace time by `TensorFlowTrainer._make_function`; the
        # patched function behaves as before for every other strategy.
        trainer.reduce_per_replica = patched
    model._maybe_symbolic_build = types.MethodType(_symbolic_build_from_specs, model)
    return model


# ------------------------------------------------------------ agreement between workers


def _sum_over_workers(strategy, values, chief_only=False):
    """The sum over workers of each of `values` (numpy arrays), on every worker.

    Each worker contributes once (through its first device); with
    `chief_only`, only the chief does (replica 0 is the chief's first device),
    which broadcasts the chief's values exactly, since x + 0 == x.
    """
    import tensorflow as tf

    local_replicas = len(strategy.extended.worker_devices)

    @tf.function
    def reduce(tensors):
        def replica_fn(tensors):
            context = tf.distribute.get_replica_context()
            replica = context.replica_id_in_sync_group
            contributes = tf.equal(replica if chief_only else replica % local_replicas, 0)
            tensors = [tf.where(contributes, t, tf.zeros_like(t)) for t in tensors]
            # One batched all-reduce per dtype: a batch must share its dtype.
            reduced = list(tensors)
            for dtype in sorted({t.dtype for t in tensors}, key=lambda d: d.name):
                indices = [i for i, t in enumerate(tensors) if t.dtype == dtype]
                for i, t in zip(
                    indices, context.all_reduce("SUM", [tensors[i] for i in indices]), strict=True
                ):
                    reduced[i] = t
            return reduced

        return strategy.experimental_local_results(strategy.run(replica_fn, args=(tensors,)))[0]

    return [np.asarray(t) for t in reduce([tf.constant(v) for v in values])]


def share_global_batches(dataset):
    """`dataset` for a multi-replica strategy: every worker keeps its share of each global batch.

    Every worker builds the same global batches (same seed), so sharding by
    data (not by file) splits each batch across the replicas; the token
    budget stays global.
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def chief_value(strategy, value: int) -> int:
    """The chief's `value` on every worker (a collective: every worker must call it).

    For decisions that must be the same everywhere, such as when to stop
    training on a time budget that each worker measures with its own clock.
    `value` itself outside multi-worker runs.
    """
    if not is_multi_worker(strategy):
        return value
    return int(_sum_over_workers(strategy, [np.int64(value)], chief_only=True)[0])


def check_workers_agree(strategy, **values: int) -> None:
    """Raises on every worker when some worker's `values` differ from the chief's.

    Every worker builds its own SentencePiece model and batches from its own
    copy of the files; different files or tokenizers would train silently on
    mismatched batches. No-op outside multi-worker runs.

    Raises:
        ValueError: naming the values that differ.
    """
    if not is_multi_worker(strategy):
        return
    local = np.asarray(list(values.values()), np.int64)
    (chief,) = _sum_over_workers(strategy, [local], chief_only=True)
    # Every worker must raise, or the others would wait for it in the next collective.
    (differs,) = _sum_over_workers(strategy, [(chief != local).astype(np.int64)])
    if differs.any():
        names = [name for name, count in zip(values, differs, strict=True) if count]
        raise ValueError(
            f"The workers disagree on: {', '.join(names)} (the chief has "
            f"{dict(zip(names, chief[differs > 0].tolist(), strict=True))}, this worker "
            f"{dict(zip(names, local[differs > 0].tolist(), strict=True))}). Every worker "
            "must read the same training files with the same settings."
        )


class SyncWithChief(keras.callbacks.Callback):
    """Makes every worker start `fit` from the chief's weights, optimizer state and epoch.

    Goes after `keras.callbacks.BackupAndRestore` in the callback list. That
    callback restores each worker from its own backup; a worker killed between
    the chief's backup and its own would otherwise resume an epoch behind, with
    other weights, and the job would diverge or hang. A no-op outside
    multi-worker runs.
    """

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy

    def on_train_begin(self, logs=None):
        if not is_multi_worker(self.strategy):
            return
        variables = list(self.model.weights) + list(self.model.optimizer.variables)
        epoch = np.asarray(self.model._initial_epoch or 0, np.int64)
        values = _sum_over_workers(
            self.strategy, [np.asarray(v.numpy()) for v in variables] + [epoch], chief_only=True
        )
        for variable, value in zip(variables, values, strict=False):
            variable.assign(value)
        self.model._initial_epoch = int(values[-1]) or None
