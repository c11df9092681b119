"""The callbacks of `model.fit` in a run: history, checkpoints and stopping, validation
BLEU, and the progress bar."""

from __future__ import annotations

import os
import time

import keras

from keras_transformer.io_utils import atomic_path, atomic_write_json
from keras_transformer.train.checkpoints import (
    checkpoint_epoch,
    epoch_checkpoints,
    patience_spent,
    ranked_epochs,
)
from keras_transformer.train.data_parallel import SINGLE_PROCESS
from keras_transformer.train.settings import KEEP_CHECKPOINTS


class EpochProgress(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, under an epoch line that states the real budget.

    Keras would print "Epoch 3/10000" for a run bounded by minutes or steps.
    """

    def __init__(self, budget):
        super().__init__()
        self.budget = budget

    def on_epoch_begin(self, epoch, logs=None):
        epochs, self.epochs = self.epochs, 1  # Keras prints its own line only when epochs > 1
        super().on_epoch_begin(epoch, logs)
        self.epochs = epochs
        if self.verbose:
            print(f"Epoch {epoch + 1} ({self.budget})")

    def on_epoch_end(self, epoch, logs=None):
        # An epoch cut short (--max-steps, a signal) ends at the batches it ran, not
        # at the epoch's size with a per-step time that never happened.
        target = self.target
        if getattr(self, "progbar", None) is not None and 0 < self.seen < (target or 0):
            self.target = self.progbar.target = self.seen
        super().on_epoch_end(epoch, logs)
        self.target = target


def fit_verbosity(verbose: int, terminal: bool) -> int:
    """`model.fit`'s verbosity: the live progress bar (1) only on a terminal.

    Redirected to a file (`nohup`, CI logs), the bar's carriage-return
    updates would write megabytes an epoch; one line per epoch (2) is kept.
    """
    return 2 if verbose == 1 and not terminal else verbose


class RunRecorder(keras.callbacks.Callback):
    """Keeps `history.json` (per-epoch metrics and seconds), epoch checkpoints, and stops.

    Each epoch's entry adds `epoch_fields` (the precision and device of this
    start). Keeps the checkpoints of the last `keep` epochs and of the best `keep` by
    `select_by`. Stops at the end of an epoch when `max_minutes` of training
    (summed over restarts) would be exceeded by one more epoch like the last,
    after `max_steps` optimizer updates, and when `patience` epochs passed
    without a better validation measure. In a run of several processes
    (`processes`), every process writes to its own folder (saving is a
    collective), and process 0's decisions to stop hold for all.
    """

    def __init__(
        self,
        out_dir,
        history,
        max_steps=None,
        max_minutes=None,
        keep=KEEP_CHECKPOINTS,
        processes=SINGLE_PROCESS,
        select_by="loss",
        patience=None,
        epoch_fields=None,
        stop=None,
    ):
        super().__init__()
        self.stop = stop  # a `PreemptionStop`: the epoch it drops is not recorded
        self.epoch_fields = dict(epoch_fields or {})
        self.processes = processes
        self.out_dir = out_dir
        self.history = history
        self.max_steps = max_steps
        self.max_seconds = None if max_minutes is None else 60.0 * max_minutes
        self.keep = keep
        self.select_by = select_by
        self.patience = patience
        self.checkpoint_dir = os.path.join(out_dir, "checkpoints")
        os.makedirs(self.checkpoint_dir, exist_ok=True)

    def _trained_seconds(self):
        return sum(entry["seconds"] for entry in self.history)

    def budget_spent(self) -> bool:
        """True when another epoch like the last one would exceed `max_minutes`."""
        if self.max_seconds is None or not self.history:
            return False
        return self._trained_seconds() + self.history[-1]["seconds"] > self.max_seconds

    def on_epoch_begin(self, epoch, logs=None):
        # Epochs after the restored backup are redone: forget what they logged.
        del self.history[epoch:]
        self.epoch_started = time.perf_counter()
        # After the backup's restore (on_train_begin), once an epoch.
        self.iterations = int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        # Counted here, not read from the optimizer: under JAX, `self.model` copies the
        # whole training state back into the variables, at every batch (2x slower).
        # (A step that float16 loss scaling skips counts here, not in the optimizer.)
        self.iterations += 1
        if self.max_steps is not None and self.iterations >= self.max_steps:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.stop is not None and self.stop.drops_epoch:
            return
        seconds = time.perf_counter() - self.epoch_started
        entry = {"epoch": epoch + 1, "seconds": round(seconds, 2)}
        entry["steps"] = int(self.model.optimizer.iterations.numpy())
        entry.update({k: float(v) for k, v in (logs or {}).items()})
        entry.update(self.epoch_fields)
        self.history.append(entry)
        self._write(epoch)
        # Each process times itself; all stop when process 0 does.
        spent = self.budget_spent() or patience_spent(self.history, self.select_by, self.patience)
        if self.processes.first_value(spent):
            self.model.stop_training = True

    def _write(self, epoch):
        path = os.path.join(self.checkpoint_dir, f"epoch-{epoch + 1:03d}.weights.h5")
        with atomic_path(path, suffix=".weights.h5") as tmp:
            self.model.save_weights(tmp)
        wanted = set(ranked_epochs(self.history, self.select_by)[: self.keep])
        checkpoints = epoch_checkpoints(self.out_dir)
        wanted.update(checkpoint_epoch(p) for p in checkpoints[-self.keep :])
        for old in checkpoints:
            if checkpoint_epoch(old) not in wanted:
                os.remove(old)
        atomic_write_json(os.path.join(self.out_dir, "history.json"), self.history)


class ValidationBleu(keras.callbacks.Callback):
    """Adds `val_bleu` and `val_bleu_lowercase` (greedy, sacreBLEU) to each epoch's logs.

    Runs before the recorder, so the scores reach `history.json`, the
    checkpoint ranking and TensorBoard. In a data-parallel run
    (`processes.distribution`), process 0 decodes alone, on a one-device copy
    of the model outside the distribution, and every process gets its scores.
    """

    def __init__(self, tokenizer, pairs, every=1, processes=SINGLE_PROCESS, stop=None):
        super().__init__()
        self.stop = stop  # a `PreemptionStop`: a span cut short by a signal is not decoded
        self.tokenizer = tokenizer
        self.pairs = pairs
        self.every = every  # epochs: as model.fit's validation_freq
        self.processes = processes
        self._copy = None

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every or (self.stop is not None and self.stop.stopped):
            return
        if self.processes.distribution is None:
            scores = bleu_on(self.model, self.tokenizer, self.pairs, beam_size=1)
            values = [scores["bleu"], scores["bleu_lowercase"]]
        else:
            values = [0.0, 0.0]
            if self.processes.first:
                scores = self._bleu_on_one_device()
                values = [scores["bleu"], scores["bleu_lowercase"]]
            values = [float(v) for v in self.processes.first_arrays(values)]
        if logs is not None:
            logs["val_bleu"], logs["val_bleu_lowercase"] = values

    def _bleu_on_one_device(self):
        distribution = keras.distribution.distribution()
        keras.distribution.set_distribution(None)  # decode with local variables and inputs
        try:
            if self._copy is None:
                self._copy = keras.models.clone_model(self.model)
            self._copy.set_weights(self.model.get_weights())
            return bleu_on(self._copy, self.tokenizer, self.pairs, beam_size=1)
        finally:
            keras.distribution.set_distribution(distribution)


def bleu_on(model, tokenizer, pairs, beam_size, progress=False) -> dict:
    from keras_transformer.evaluation import score_translations
    from keras_transformer.translation import translate_lines

    hypotheses = translate_lines(
        model, tokenizer, [s for s, _ in pairs], beam_size=beam_size, batch_size=64,
        progress=progress,
    )  # fmt: skip
    return score_translations(hypotheses, [t for _, t in pairs])
