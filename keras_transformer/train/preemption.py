"""Stopping on a scheduler's notice: SIGTERM (and SIGINT) end training at an agreed update,
with the run resumable by the same command, and the process exits 0.

Schedulers (Kubernetes, Slurm, spot and preemptible VMs) stop a job with
SIGTERM, then SIGKILL after a grace period (30 s by default on Kubernetes).
`PreemptionStop` turns the notice into a stop after the update in flight:

- One process: a Python handler notes the signal; the next batch end stops.
- Several processes (JAX): JAX's distributed runtime already catches SIGTERM
  and tells every process. `multihost_utils.reached_preemption_sync_point`,
  asked at every batch end with the batches seen, becomes true on all of them
  at the same batch, so they stop together and nobody waits in a collective.
  SIGINT (Ctrl-C) is passed on to that mechanism as a SIGTERM.

What is kept depends on what the run can resume from:

- A prepared dataset (`--data`) resumes at any batch: the span in flight ends
  at the agreed batch, and its checkpoint, data position and backup are
  written as at any span end (without validation, which could outlast the
  grace period). The rerun goes on from the next batch.
- Text files resume only at epoch ends (their shuffled order is not
  addressable by batch): the epoch in flight ends at the stop but is dropped
  (`drops_epoch`: the recorder and the backup leave it out), the backup of
  the last epoch stands, and the rerun redoes that epoch.

A second signal on one process stops at once, as the signal's default does.
"""

from __future__ import annotations

import os
import signal
import threading

import keras

from keras_transformer.train.data_parallel import SINGLE_PROCESS

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionStop(keras.callbacks.Callback):
    """Stops `model.fit` at the batch end after SIGTERM or SIGINT (see the module).

    Args:
        processes: the run's `Processes`.
        resumes_mid_epoch: True when the data resumes at any batch (`--data`):
            the span in flight then ends, and is saved, at the stop.
    """

    def __init__(self, processes=SINGLE_PROCESS, resumes_mid_epoch=False):
        super().__init__()
        self.processes = processes
        self.resumes_mid_epoch = resumes_mid_epoch
        self.signal_name = None  # the signal that stopped the run, once it has
        self.stopped_at = None  # the optimizer's updates at the stop
        self.drops_epoch = False  # the epoch cut short is not to be recorded or backed up
        self._noticed = None
        self._previous = {}
        self._batches = 0

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def on_train_begin(self, logs=None):
        self._batches = 0
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for number in SIGNALS:
            if self.processes.count > 1 and number == signal.SIGTERM:
                continue  # JAX's runtime handles it, and tells the other processes
            self._previous[number] = signal.signal(number, self._notice)

    def on_train_end(self, logs=None):
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def _notice(self, number, frame):
        if self._noticed is not None and self.processes.count == 1:
            # A second signal: the default action, at once.
            signal.signal(number, self._previous.get(number, signal.SIG_DFL))
            os.kill(os.getpid(), number)
            return
        self._noticed = signal.Signals(number).name
        if self.processes.count > 1:
            self._noticed = "SIGTERM"
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self.processes.count > 1:
            from jax.experimental import multihost_utils

            # Every process asks at every batch end, with the same count.
            if not multihost_utils.reached_preemption_sync_point(self._batches):
                return
            self._noticed = self._noticed or "SIGTERM"
        elif self._noticed is None:
            return
        self.signal_name = self._noticed
        self.stopped_at = int(self.model.optimizer.iterations.numpy())
        self.drops_epoch = not self.resumes_mid_epoch
        self.model.stop_training = True
        _skip_validation(self.model)


def _skip_validation(model) -> None:
    """Makes `fit` skip the validation of the span being cut short (Keras asks
    `_should_eval` before validating; where it does not, validation runs)."""
    if hasattr(model, "_should_eval"):
        model._should_eval = lambda *args, **kwargs: False


def restore_validation(model) -> None:
    """Undoes `_skip_validation` (the model is used again after a stop)."""
    model.__dict__.pop("_should_eval", None)


def stopped_result(run, stop, history) -> dict:
    """Says where a run stopped by a signal resumes; `{"stopped_by": ...}` for `train`."""
    if not stop.drops_epoch:
        kept = f"the updates up to {stop.stopped_at} are saved"
    elif history:
        kept = (
            f"the epoch in flight is dropped (text files resume at epoch ends); the backup "
            f"after epoch {len(history)} stands"
        )
    else:
        kept = "the first epoch was not finished, so nothing is saved"
    run.log(
        f"Stopped by {stop.signal_name} after update {stop.stopped_at}: {kept}. "
        "Rerun the same command to resume."
    )
    return {"stopped_by": stop.signal_name, "steps": stop.stopped_at, "epochs": len(history)}
