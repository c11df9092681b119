"""Training on the devices of several processes (hosts): JAX and `keras.distribution`.

`--strategy data-parallel` (`KERAS_BACKEND=jax`) starts this process in a
group of `num_processes` (`keras.distribution.initialize`, with process 0's
address as the coordinator) and trains under `keras.distribution.DataParallel`
over every device of every process: the variables are replicated, each
global batch is split along its rows, and XLA sums the gradients. The loss
(`LabelSmoothedCrossEntropy`) is computed on the global batch, so it is the
mean over the real tokens of the whole global batch, whatever each device's
share of padding: the update equals one device's on the same batch.

Every process reads the same files and builds the same global batches (same
seed); each keeps its rows of every batch (`share_of_each_batch`), padded with
empty rows to a multiple of the device count. Every process runs the same
callbacks: saving and restoring distributed variables are collectives, which
all processes must enter in the same order. Process 0 owns the run directory;
the others write the same files to a temporary folder of their own, start
from a copy of process 0's backup (`share_backup`) and follow process 0's
decisions (`Processes.first_value`).

One process without a coordinator is a group of one: `data-parallel` then
splits each batch over the local devices (e.g. the GPUs of one machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import keras
import numpy as np

from keras_transformer.train import peers

# Keras' own variables for `keras.distribution.initialize`; the flags win over them.
ENV_COORDINATOR = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
ENV_NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"
ENV_PROCESS_ID = "KERAS_DISTRIBUTION_PROCESS_ID"


@dataclasses.dataclass
class Processes:
    """This process's place among the processes of a run.

    `index` 0 of `count` is the first process: it writes the run directory,
    and its clock, history and backups decide for all. `devices` share each
    global batch (those of every process). `distribution` is the
    `keras.distribution.DataParallel` the model trains under (None: one
    device, or a `tf.distribute` strategy).
    """

    index: int = 0
    count: int = 1
    devices: int = 1
    distribution: object = None
    watch: object = None  # the `peers.PeerWatch` of a run of several processes

    @property
    def first(self) -> bool:
        return self.index == 0

    def scope(self):
        """The context to build and fit the model in: the distribution's scope, if any."""
        if self.distribution is None:
            return contextlib.nullcontext()
        return self.distribution.scope()

    def leave(self) -> None:
        """Ends this process's part in the group (after `fit`, on every process).

        Process 0 then finishes the run alone (choosing, decoding, saving) on a
        one-device copy, while the others exit: nobody waits on a collective.
        """
        if self.count > 1:
            import jax

            if self.watch is not None:
                self.watch.stop()
            jax.distributed.shutdown()

    def first_value(self, value: int) -> int:
        """Process 0's `value` on every process (a collective: all must call it).

        For decisions that must be the same everywhere, such as stopping on a
        time budget that each process measures with its own clock.
        """
        if self.count == 1:
            return int(value)
        from jax.experimental import multihost_utils

        return int(multihost_utils.broadcast_one_to_all(np.int64(value)))

    def first_arrays(self, arrays: list) -> list:
        """Process 0's numpy `arrays` on every process (a collective)."""
        if self.count == 1:
            return list(arrays)
        from jax.experimental import multihost_utils

        return [np.asarray(a) for a in multihost_utils.broadcast_one_to_all(list(arrays))]

    def check_agree(self, **values: int) -> None:
        """Raises on every process when some process's integer `values` differ from process 0's.

        Every process builds its own SentencePiece model and batches from its
        own copy of the files; other files or settings would train silently
        on mismatched batches.

        Raises:
            ValueError: naming the values that differ and the processes.
        """
        if self.count == 1:
            return
        from jax.experimental import multihost_utils

        local = np.asarray(list(values.values()), np.int64)
        everyone = np.asarray(multihost_utils.process_allgather(local))  # (count, len(values))
        differs = (everyone != everyone[0]).any(axis=0)
        if differs.any():
            # Every process sees the same table, so every process raises here.
            names = [name for name, d in zip(values, differs, strict=True) if d]
            table = "; ".join(
                f"process {i}: "
                + ", ".join(
                    f"{n}={int(v)}" for n, v, d in zip(values, row, differs, strict=True) if d
                )
                for i, row in enumerate(everyone)
            )
            raise ValueError(
                f"The processes disagree on: {', '.join(names)} ({table}). Every process must "
                "read the same training files with the same settings."
            )


SINGLE_PROCESS = Processes()


def _process_settings(coordinator, num_processes, process_id):
    """The flags, else Keras' environment variables; checked."""
    environment = os.environ
    if coordinator is None:
        coordinator = environment.get(ENV_COORDINATOR) or None
    if num_processes is None and environment.get(ENV_NUM_PROCESSES):
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None and environment.get(ENV_PROCESS_ID):
        process_id = _env_int(ENV_PROCESS_ID)
    if num_processes is None or num_processes == 1:
        if process_id not in (None, 0):
            raise ValueError(
                f"process_id must be 0 in a run of one process. Received: process_id={process_id}"
            )
        return None, 1, 0
    if num_processes < 1:
        raise ValueError(
            f"num_processes must be a positive integer. Received: num_processes={num_processes}"
        )
    if coordinator is None or process_id is None:
        raise ValueError(
            f"A run of {num_processes} processes needs the coordinator's address (--coordinator "
            f"HOST:PORT or {ENV_COORDINATOR}) and this process's id (--process-id or "
            f"{ENV_PROCESS_ID})."
        )
    first = coordinator.split(",")[0]
    host, _, port = first.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            "The coordinator must be process 0's HOST:PORT, e.g. 10.0.0.1:1234. "
            f"Received: {coordinator!r}"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id must be between 0 and {num_processes - 1}. Received: "
            f"process_id={process_id}"
        )
    return first, num_processes, process_id


def _env_int(name):
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer. Received: {value!r}") from None


def start_data_parallel(coordinator=None, num_processes=None, process_id=None) -> Processes:
    """Joins the run's group of processes and returns this process's `Processes`.

    Needs `KERAS_BACKEND=jax`; must come before any JAX computation. The
    arguments default to Keras' environment variables (`ENV_COORDINATOR`,
    `ENV_NUM_PROCESSES`, `ENV_PROCESS_ID`); without a process count, this
    process alone, on all its devices. On CPUs the processes exchange
    gradients through gloo over TCP.

    Raises:
        RuntimeError: under another backend.
        ValueError: when the address, count or id is missing or malformed.
    """
    if keras.backend.backend() != "jax":
        raise RuntimeError(
            "--strategy data-parallel trains with JAX: start it with KERAS_BACKEND=jax "
            f"(KERAS_BACKEND is {keras.backend.backend()!r})."
        )
    coordinator, count, index = _process_settings(coordinator, num_processes, process_id)
    interval, missed = _heartbeats()
    import jax

    watch = None
    if count > 1:
        from jax._src import distributed

        # The CPU backend has no cross-process collectives without it.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # What keras.distribution.initialize does, with JAX's own watch set behind ours.
        jax.distributed.initialize(
            coordinator,
            count,
            index,
            heartbeat_timeout_seconds=peers.jax_heartbeat_timeout(interval, missed),
        )
        watch = peers.PeerWatch(distributed.global_state.client, index, count, interval, missed)
        peers.relay_standard_error(watch, coordinator)
        watch.start()
    devices = jax.devices()
    distribution = keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False)
    return Processes(jax.process_index(), jax.process_count(), len(devices), distribution, watch)


def _heartbeats() -> tuple[float, int]:
    """The heartbeat interval and the heartbeats missed before a process counts as dead:
    `peers.ENV_INTERVAL` and `peers.ENV_MISSED`, else the defaults; checked."""
    interval, missed = peers.DEFAULT_INTERVAL, peers.DEFAULT_MISSED
    if os.environ.get(peers.ENV_INTERVAL):
        value = os.environ[peers.ENV_INTERVAL]
        try:
            interval = float(value)
        except ValueError:
            interval = -1.0
        if not 0 < interval < float("inf"):
            raise ValueError(
                f"{peers.ENV_INTERVAL} must be a positive number of seconds. Received: {value!r}"
            )
    if os.environ.get(peers.ENV_MISSED):
        missed = _env_int(peers.ENV_MISSED)
        if missed < 1:
            raise ValueError(f"{peers.ENV_MISSED} must be at least 1. Received: {missed}")
    return interval, missed


def rows_multiple(processes: Processes, paired_rows: bool = False) -> int:
    """The row count every global batch is padded to a multiple of: one row per device
    at least, and an even count when rows come in pairs (R-Drop's copies)."""
    return math.lcm(processes.devices, 2 if paired_rows else 1)


def share_of_each_batch(dataset, processes: Processes, paired_rows: bool = False):
    """This process's rows of every global batch of `dataset` (`(features, labels)`).

    Each batch gains empty rows (all padding, id 0) up to a multiple of
    `rows_multiple`; process i keeps the i-th of `processes.count` equal
    slices. Empty rows have no real token, so neither the loss nor the
    gradients change; only the batch's row count does. Paired rows stay
    together in order, since a batch of pairs gains an even number of rows.
    """
    if processes.devices == 1:
        return dataset
    import tensorflow as tf

    multiple = rows_multiple(processes, paired_rows)
    index, count = processes.index, processes.count

    def cut(tensor, rows, padded):
        padding = [[0, padded - rows]] + [[0, 0]] * (len(tensor.shape) - 1)
        tensor = tf.pad(tensor, padding)
        share = padded // count
        return tensor[index * share : (index + 1) * share]

    def keep_share(features, labels):
        rows = tf.shape(labels)[0]
        padded = (rows + multiple - 1) // multiple * multiple
        return (
            {name: cut(t, rows, padded) for name, t in features.items()},
            cut(labels, rows, padded),
        )

    return dataset.map(keep_share)


def share_backup(processes: Processes, backup_dir: str) -> None:
    """Copies process 0's `keras.callbacks.BackupAndRestore` files into `backup_dir` of every
    other process (a collective: all must call it), before `fit`.

    Restoring assigns every variable, and assigning a distributed variable is
    itself a collective: every process must restore the same state, in the
    same order. Process 0's backup is the run's; the others' folders are new.
    """
    if processes.count == 1:
        return
    for name in ("latest.weights.h5", "training_metadata.json"):
        path = os.path.join(backup_dir, name)
        size = os.path.getsize(path) if processes.first and os.path.isfile(path) else -1
        size = processes.first_value(size)
        if size < 0:
            continue
        local = np.fromfile(path, np.uint8) if processes.first else np.zeros(size, np.uint8)
        (data,) = processes.first_arrays([local])
        if not processes.first:
            os.makedirs(backup_dir, exist_ok=True)
            data.astype(np.uint8).tofile(path)
