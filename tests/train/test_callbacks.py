"""The callbacks of a run: history, checkpoints kept, stopping, and the progress bar."""

import os

import numpy as np

from keras_transformer.config import TransformerConfig
from keras_transformer.model import build_transformer
from keras_transformer.train.callbacks import RunRecorder, fit_verbosity


def test_recorder_keeps_last_and_best_checkpoints_and_stops_on_patience(tmp_path):
    """A real recorder on a real model, fed the validation losses of six epochs."""
    model = build_transformer(TransformerConfig.from_preset("tiny", vocabulary_size=40))
    model.compile(optimizer="sgd", loss="mse")
    history = []
    recorder = RunRecorder(str(tmp_path), history, keep=2, select_by="loss", patience=3)
    recorder.set_model(model)
    losses = [5.0, 2.0, 1.5, 3.0, 2.5, 1.6]
    stopped = []
    for epoch, loss in enumerate(losses):
        recorder.on_epoch_begin(epoch)
        # Each epoch's weights are recognizable: every value equals the epoch number.
        model.set_weights([np.full(w.shape, epoch + 1.0, w.dtype) for w in model.get_weights()])
        recorder.on_epoch_end(epoch, {"loss": loss, "val_loss": loss})
        stopped.append(model.stop_training)
        model.stop_training = False
    # Epoch 3 is best; 3 epochs later (epoch 6) patience 3 is spent.
    assert stopped == [False] * 5 + [True]
    kept = sorted(os.listdir(tmp_path / "checkpoints"))
    # The last 2 (5, 6) and the best 2 (3, 6 by loss 1.5, 1.6) stay.
    assert kept == ["epoch-003.weights.h5", "epoch-005.weights.h5", "epoch-006.weights.h5"]
    model.load_weights(str(tmp_path / "checkpoints" / "epoch-003.weights.h5"))
    assert all(np.all(w == 3.0) for w in model.get_weights())
    assert [e["val_loss"] for e in history] == losses


def test_the_live_progress_bar_only_on_a_terminal():
    assert fit_verbosity(1, terminal=True) == 1
    assert fit_verbosity(1, terminal=False) == 2  # one line an epoch in a log file
    assert fit_verbosity(0, terminal=False) == 0 and fit_verbosity(2, terminal=True) == 2
