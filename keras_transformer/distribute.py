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

import hashlib
import json
import os
import tempfile

STRATEGIES = ("default", "mirrored", "multi-worker")


def _require_tensorflow_backend():
    import keras

    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "tf.distribute strategies need the TensorFlow backend; "
            f"KERAS_BACKEND is {keras.backend.backend()!r}."
        )


def cluster_spec() -> dict | None:
    """The parsed `TF_CONFIG`, or None when it is unset. Malformed JSON raises a clear error."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"TF_CONFIG is not valid JSON: {error}") from error
    if not isinstance(spec, dict) or "cluster" not in spec or "task" not in spec:
        raise ValueError(
            'TF_CONFIG must hold "cluster" and "task", e.g. {"cluster": {"worker": '
            '["host1:12345", "host2:12345"]}, "task": {"type": "worker", "index": 0}}.'
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
