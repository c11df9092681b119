"""The run directory: a new one, this run's (resume), another run's, or not a run's."""

import json

import keras
import pytest

from keras_transformer.train.run_dir import (
    RunDirectoryError,
    _check_run_directory,
    open_run,
    stream_seed,
)
from keras_transformer.train.settings import RESUMABLE_FIELDS, TrainSettings


@pytest.fixture
def settings(tmp_path):
    paths = []
    for name in ("a", "b"):
        (tmp_path / name).write_text("x\n")
        paths.append(str(tmp_path / name))
    yield TrainSettings(*paths, *paths, preset="tiny")
    keras.backend.clear_session()


def test_a_new_directory_is_opened_and_the_same_settings_resume_it(settings, tmp_path):
    out = tmp_path / "run"
    assert _check_run_directory(str(out), settings) is False  # missing: new
    out.mkdir()
    assert _check_run_directory(str(out), settings) is False  # empty: new
    run = open_run(settings, str(out), verbose=0, strategy=None)
    assert (run.resume, run.chief, run.replicas) == (False, True, 1)
    written = json.loads((out / "train_config.json").read_text())
    assert set(written) == {f for f in vars(settings)}  # identity and resumable fields
    assert _check_run_directory(str(out), settings) is True
    # A setting that only says when to stop or how to finish may change.
    assert "epochs" in RESUMABLE_FIELDS
    settings.epochs = 50
    assert _check_run_directory(str(out), settings) is True


def test_another_runs_or_a_foreign_directory_is_refused(settings, tmp_path):
    out = tmp_path / "run"
    open_run(settings, str(out), verbose=0, strategy=None)
    settings.label_smoothing = 0.2
    with pytest.raises(RunDirectoryError, match="label_smoothing: 0.1 there, 0.2 now"):
        _check_run_directory(str(out), settings)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine\n")
    with pytest.raises(RunDirectoryError, match="is not empty and has no train_config.json"):
        _check_run_directory(str(foreign), settings)
    with pytest.raises(RunDirectoryError, match="is not a directory"):
        _check_run_directory(str(foreign / "notes.txt"), settings)


def test_a_setting_added_since_a_run_was_written_counts_as_its_default(settings, tmp_path):
    out = tmp_path / "run"
    open_run(settings, str(out), verbose=0, strategy=None)
    written = json.loads((out / "train_config.json").read_text())
    del written["rdrop_alpha"]
    written["a_setting_since_removed"] = 3
    (out / "train_config.json").write_text(json.dumps(written))
    assert _check_run_directory(str(out), settings) is True


def test_each_resumed_start_draws_its_own_streams():
    assert stream_seed(7, 0) == 7  # a new run: the seed itself
    seeds = {stream_seed(7, done) for done in range(1, 6)}
    assert len(seeds) == 5 and 7 not in seeds
    assert stream_seed(7, 3) == stream_seed(7, 3)  # a repeated start draws the same
