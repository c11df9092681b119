"""The resume backup is replaced as one step: a kill in the middle of writing it restores
either the old weights with the old epoch or the new with the new, never a mix."""

import json
import os

import keras
import numpy as np
import pytest

from keras_transformer.train import backup as backup_module
from keras_transformer.train.backup import NEW_METADATA, NEW_WEIGHTS, AtomicBackupAndRestore


class Killed(BaseException):
    """Stands for the process dying at that point: nothing after it runs."""


def _model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)  # as after a first update
    return model


def _save(backup_dir, model, epoch):
    callback = AtomicBackupAndRestore(backup_dir)
    callback.set_model(model)
    callback._current_epoch = epoch
    callback._save_model()


def _restore(backup_dir):
    """A new start: a fresh model restored by the callback, and the epoch it resumes at."""
    model = _model(seed=99)
    callback = AtomicBackupAndRestore(backup_dir)
    callback.set_model(model)
    callback.on_train_begin()
    return model.get_weights(), model._initial_epoch


def _kill_at_replace(monkeypatch, which):
    """Kills the process at the `which`-th rename (1: the weights', 2: the epoch's)."""
    calls = []
    real = os.replace

    def replace(source, destination):
        calls.append(destination)
        if len(calls) == which:
            raise Killed
        real(source, destination)

    monkeypatch.setattr(backup_module.os, "replace", replace)


@pytest.mark.parametrize(
    "which, expected_epoch",
    [(1, 1), (2, 2)],  # before the weights' rename: the old backup; after it: the new one
)
def test_a_kill_while_the_backup_is_written_restores_a_matching_pair(
    tmp_path, monkeypatch, which, expected_epoch
):
    backup_dir = str(tmp_path / "backup")
    first, second = _model(seed=1), _model(seed=2)
    _save(backup_dir, first, epoch=1)
    _kill_at_replace(monkeypatch, which)
    with pytest.raises(Killed):
        _save(backup_dir, second, epoch=2)
    monkeypatch.undo()
    assert os.path.exists(os.path.join(backup_dir, NEW_METADATA))

    weights, epoch = _restore(backup_dir)
    assert epoch == expected_epoch
    expected = (first if expected_epoch == 1 else second).get_weights()
    for restored, saved in zip(weights, expected, strict=True):
        np.testing.assert_array_equal(restored, saved)
    # The interrupted commit was finished or discarded, not left to confuse the next one.
    assert not os.path.exists(os.path.join(backup_dir, NEW_WEIGHTS))
    assert not os.path.exists(os.path.join(backup_dir, NEW_METADATA))
    with open(os.path.join(backup_dir, "training_metadata.json"), encoding="utf-8") as f:
        assert json.load(f)["epoch"] == expected_epoch


def test_an_uninterrupted_backup_leaves_only_keras_files(tmp_path):
    backup_dir = str(tmp_path / "backup")
    model = _model(seed=3)
    _save(backup_dir, model, epoch=4)
    assert sorted(os.listdir(backup_dir)) == ["latest.weights.h5", "training_metadata.json"]
    weights, epoch = _restore(backup_dir)
    assert epoch == 4
    for restored, saved in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(restored, saved)
