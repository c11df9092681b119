"""The backup a rerun resumes from: Keras' `BackupAndRestore`, committed as one step.

Keras writes the backup's weights (`latest.weights.h5`) in place and then its
epoch (`training_metadata.json`): a kill during the first write leaves a
corrupt file that the next start cannot load, and a kill between the two
restores new weights with the previous epoch's number, so that a rerun trains
the same batches twice. `AtomicBackupAndRestore` writes both beside the
backup first, then renames the weights and then the epoch into place;
`settle_backup` finishes or discards a commit that a kill interrupted:

- the new weights are still beside the backup: the kill came before the
  commit, and the previous backup stands (the new files are removed);
- only the new epoch is: the weights were renamed into place, so the epoch
  is renamed after them.

Either way the weights and the epoch restored belong together.
"""

from __future__ import annotations

import json
import os

import keras

WEIGHTS = "latest.weights.h5"
METADATA = "training_metadata.json"
NEW_WEIGHTS = "incoming.weights.h5"
NEW_METADATA = "incoming_metadata.json"


def settle_backup(backup_dir: str) -> None:
    """Completes or discards a backup commit that was interrupted (see the module)."""
    new_weights = os.path.join(backup_dir, NEW_WEIGHTS)
    new_metadata = os.path.join(backup_dir, NEW_METADATA)
    if os.path.exists(new_weights):
        os.remove(new_weights)
        if os.path.exists(new_metadata):
            os.remove(new_metadata)
    elif os.path.exists(new_metadata):
        os.replace(new_metadata, os.path.join(backup_dir, METADATA))


def _sync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` (once per epoch) whose weights and epoch are
    replaced together or not at all; an epoch that `stop` (a `PreemptionStop`) drops is
    not backed up."""

    def __init__(self, backup_dir, stop=None, **kwargs):
        super().__init__(backup_dir, **kwargs)
        self.stop = stop

    def on_epoch_end(self, epoch, logs=None):
        if self.stop is not None and self.stop.drops_epoch:
            return
        super().on_epoch_end(epoch, logs)

    def on_train_begin(self, logs=None):
        settle_backup(self.backup_dir)
        super().on_train_begin(logs)

    def _save_model(self):
        os.makedirs(self.backup_dir, exist_ok=True)
        new_weights = os.path.join(self.backup_dir, NEW_WEIGHTS)
        new_metadata = os.path.join(self.backup_dir, NEW_METADATA)
        # Saving weights is a collective under keras.distribution: every process saves.
        self.model.save_weights(new_weights, overwrite=True)
        with open(new_metadata, "w", encoding="utf-8") as f:
            json.dump({"epoch": self._current_epoch, "batch": self._last_batch_seen}, f)
            f.flush()
            os.fsync(f.fileno())
        _sync(new_weights)
        # The commit: the weights first; the epoch beside them says it is complete.
        os.replace(new_weights, os.path.join(self.backup_dir, WEIGHTS))
        os.replace(new_metadata, os.path.join(self.backup_dir, METADATA))
