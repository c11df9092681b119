"""Choosing on validation: ranking epochs, patience, kept checkpoints, final candidates."""

import math
import os

import keras
import numpy as np
import pytest

from keras_transformer.config import TransformerConfig
from keras_transformer.data.pipeline import EncodedPairs, PipelineStats
from keras_transformer.model import build_transformer
from keras_transformer.train import (
    AUTO_TOKENS_PER_BATCH,
    KEEP_CHECKPOINTS,
    MIN_UPDATES_PER_EPOCH,
    TrainSettings,
    _RunRecorder,
    automatic_tokens_per_batch,
    final_candidates,
    fit_verbosity,
    patience_spent,
    ranked_epochs,
)


def _history(key, values):
    return [{"epoch": e, key: v} for e, v in enumerate(values, start=1)]


def test_epochs_rank_by_loss_or_bleu_and_ties_keep_the_earlier():
    assert ranked_epochs(_history("val_loss", [3.0, 2.0, 2.5, 2.0]), "loss") == [2, 4, 3, 1]
    assert ranked_epochs(_history("val_bleu", [10.0, 30.0, 20.0, 30.0]), "bleu") == [2, 4, 3, 1]
    # An epoch without the measure (a run that switched measure) is not ranked.
    assert ranked_epochs([{"epoch": 1, "val_loss": 2.0}], "bleu") == []


@pytest.mark.parametrize(
    "losses,patience,spent",
    [
        ([3.0, 2.0, 2.5], 1, True),
        ([3.0, 2.0, 2.5], 2, False),
        ([3.0, 2.0, 2.0, 2.0], 2, True),  # equal is not better
        ([3.0, 2.0, 1.0], 1, False),
        ([3.0, 2.0, 2.5], None, False),
    ],
)
def test_patience(losses, patience, spent):
    assert patience_spent(_history("val_loss", losses), "loss", patience) is spent


def test_the_train_commands_help_states_the_defaults_train_applies():
    """The CLI writes these defaults as text (it imports `train` only to run it):
    the help must follow the constants."""
    from keras_transformer.cli import build_parser

    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]
    helps = {a.dest: a.help for a in train_parser._actions}
    assert f"default {KEEP_CHECKPOINTS}," in helps["average"]
    assert f"fewer than {MIN_UPDATES_PER_EPOCH} updates" in helps["tokens_per_batch"]


def test_final_candidates():
    history = _history("val_bleu", [10.0, 30.0, 20.0, 25.0])
    assert final_candidates(history, [1, 2, 3, 4], "bleu", 3) == {
        "last epoch": [4],
        "best epoch": [2],
        "mean of last 2": [3, 4],
        "mean of best 2": [2, 4],
        "mean of last 3": [2, 3, 4],
    }  # the best 3 are the last 3: listed once
    assert final_candidates(history, [1, 2, 3, 4], "bleu", 2, "last") == {"mean of last 2": [3, 4]}
    assert final_candidates(history, [1, 2, 3, 4], "bleu", 1, "best") == {"best epoch": [2]}
    # Only epochs whose checkpoint is still there.
    assert final_candidates(history, [3, 4], "bleu", 2, "best") == {"mean of best 2": [3, 4]}


def test_recorder_keeps_last_and_best_checkpoints_and_stops_on_patience(tmp_path):
    """A real recorder on a real model, fed the validation losses of six epochs."""
    model = build_transformer(TransformerConfig.from_preset("tiny", vocabulary_size=40))
    model.compile(optimizer="sgd", loss="mse")
    history = []
    recorder = _RunRecorder(str(tmp_path), history, keep=2, select_by="loss", patience=3)
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


def test_automatic_warmup_is_three_epochs_and_keeps_the_papers_peak(tmp_path):
    paths = []
    for name in ("a", "b"):
        (tmp_path / name).write_text("x\n")
        paths.append(str(tmp_path / name))
    settings = TrainSettings(*paths, *paths, preset="tiny")
    assert settings.precision == "auto"
    assert settings.schedule(250) == (750, pytest.approx(math.sqrt(750 / 4000)))
    assert settings.schedule(2_000) == (4000, 1.0)  # a big corpus: the paper's schedule
    explicit = TrainSettings(*paths, *paths, warmup_steps=800, learning_rate_scale=0.4)
    assert explicit.schedule(250) == (800, 0.4)
    assert settings.select_by == "bleu"  # the measure a translation is judged by
    assert TrainSettings(*paths, *paths, strategy="multi-worker").select_by == "loss"
    with pytest.raises(ValueError, match="select_by must be one of loss, bleu"):
        TrainSettings(*paths, *paths, select_by="accuracy")
    with pytest.raises(ValueError, match="patience must be a positive integer"):
        TrainSettings(*paths, *paths, patience=0)
    keras.backend.clear_session()


def test_cooldown_covers_the_last_fraction_of_the_shorter_budget(tmp_path):
    paths = []
    for name in ("a", "b"):
        (tmp_path / name).write_text("x\n")
        paths.append(str(tmp_path / name))
    assert TrainSettings(*paths, *paths, epochs=20).run_length(500) == (None, None)
    assert TrainSettings(*paths, *paths, epochs=20, cooldown=0.3).run_length(500) == (10_000, 3000)
    steps = TrainSettings(*paths, *paths, epochs=20, max_steps=4000, cooldown=0.25)
    assert steps.run_length(500) == (4000, 1000)
    assert TrainSettings(*paths, *paths, max_steps=7, cooldown=1.0).run_length(500) == (7, 7)
    with pytest.raises(ValueError, match="cooldown must be a fraction in"):
        TrainSettings(*paths, *paths, epochs=5, cooldown=1.5)
    with pytest.raises(ValueError, match="cooldown needs the run's length in updates"):
        TrainSettings(*paths, *paths, max_minutes=10, cooldown=0.2)


def test_the_live_progress_bar_only_on_a_terminal():
    assert fit_verbosity(1, terminal=True) == 1
    assert fit_verbosity(1, terminal=False) == 2  # one line an epoch in a log file
    assert fit_verbosity(0, terminal=False) == 0 and fit_verbosity(2, terminal=True) == 2


def _pairs(count, length=15):
    """`count` pairs of `length` pieces per side (16 positions with EOS)."""
    ids = [np.full(length, 5, np.int32)] * count
    return EncodedPairs(ids, ids, 128, PipelineStats(count, 0, 0, count, 0, 0))


def test_the_automatic_batch_is_the_largest_with_enough_updates_else_the_smallest():
    assert AUTO_TOKENS_PER_BATCH == (4096, 2048, 1024) and MIN_UPDATES_PER_EPOCH == 400
    # 16-position pairs: 256 a batch at 4096 tokens, 128 at 2048, 64 at 1024.
    for count, accumulate, chosen in [
        (256 * 400, 1, 4096),  # exactly 400 updates at 4096
        (256 * 399, 1, 2048),  # 399 at 4096, 798 at 2048
        (128 * 400, 2, 1024),  # accumulation halves the updates: 200 at 2048, 400 at 1024
        (64 * 100, 1, 1024),  # too few at every size: the smallest
        (1, 1, 1024),
    ]:
        pairs = _pairs(count)
        assert pairs.batches(4096) == -(-count // 256)
        assert automatic_tokens_per_batch(pairs, accumulate) == chosen, (count, accumulate)
