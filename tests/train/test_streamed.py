"""`train --data`: a prepared dataset streamed, checkpoints every N updates, exact resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

from keras_transformer.data.pipeline import DataError
from keras_transformer.data.prepare import PrepareSettings, prepare
from keras_transformer.data.shards import PreparedData
from keras_transformer.data.toy import generate_toy_corpus
from keras_transformer.train import TrainSettings, train
from keras_transformer.train.streamed import check_prepared

SPAN = 3  # updates between checkpoints


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    corpus = generate_toy_corpus(num_train=600, num_valid=24, num_test=1)
    files = corpus.write(str(tmp_path_factory.mktemp("toy")))
    out = str(tmp_path_factory.mktemp("prepared") / "data")
    settings = PrepareSettings(vocab_size=400, max_length=24, pairs_per_shard=200)
    prepare(
        files["train.src"],
        files["train.tgt"],
        out,
        settings,
        src_valid=files["valid.src"],
        tgt_valid=files["valid.tgt"],
        workers=1,
        verbose=0,
    )
    return out


def _settings(data, **overrides):
    values = dict(
        data=data,
        preset="tiny",
        vocab_size=400,
        tokens_per_batch=128,
        select_by="loss",
        final="last",
        average=1,
        save_every_steps=SPAN,
        precision="float32",
    )
    values.update(overrides)
    return TrainSettings(**values)


def _weights(run_dir):
    model = keras.saving.load_model(os.path.join(run_dir, "model.keras"))
    return model.get_weights()


def test_prepared_data_refuses_what_it_cannot_serve(prepared, tmp_path):
    with pytest.raises(ValueError, match="save_every_steps needs a prepared dataset"):
        TrainSettings(src_train=__file__, tgt_train=__file__, src_valid=__file__,
                      tgt_valid=__file__, save_every_steps=5)  # fmt: skip
    with pytest.raises(ValueError, match="validate_every_steps must be a multiple"):
        _settings(prepared, validate_every_steps=SPAN + 1)
    with pytest.raises(ValueError, match="either --data or --src-train"):
        TrainSettings(data=prepared, src_train=__file__, tgt_train=__file__)
    with pytest.raises(ValueError, match="src_train is required"):
        TrainSettings(src_valid=__file__, tgt_valid=__file__)
    with pytest.raises(DataError, match="prepared with vocab_size 400, not 8000"):
        train(_settings(prepared, vocab_size=8000), str(tmp_path / "run"), verbose=0)
    data = PreparedData(prepared)
    data.manifest["max_length"] = 99  # as if prepared for longer pairs than tiny's 48
    with pytest.raises(DataError, match="max_length 99, longer than the model's 48"):
        check_prepared(_settings(prepared), data)
    assert not os.path.exists(tmp_path / "run")


EVERY = dict(validate_every_steps=2 * SPAN)  # validation at spans 2 and 4 only
STEPS = 3 * SPAN + 1


@pytest.fixture(scope="module")
def whole_run(prepared, tmp_path_factory):
    """A run of STEPS updates, never stopped: `(metrics, directory)`."""
    whole = str(tmp_path_factory.mktemp("whole") / "run")
    return train(_settings(prepared, max_steps=STEPS, **EVERY), whole, verbose=0), whole


@pytest.mark.integration
def test_a_resumed_run_continues_at_the_same_batch_with_the_same_weights(
    prepared, whole_run, tmp_path
):
    split = str(tmp_path / "split")
    every = EVERY
    metrics, whole = whole_run
    train(_settings(prepared, max_steps=2 * SPAN, **every), split, verbose=0)
    with open(os.path.join(split, "data_position.json"), encoding="utf-8") as f:
        assert json.load(f) == {"1": SPAN, "2": 2 * SPAN, "readers": 1}
    # The order of the data depends on how many processes read it: another count is refused.
    refused = str(tmp_path / "refused")
    shutil.copytree(split, refused)
    with open(os.path.join(refused, "data_position.json"), "w", encoding="utf-8") as f:
        json.dump({"1": SPAN, "2": 2 * SPAN, "readers": 2}, f)
    with pytest.raises(DataError, match=r"trained with 2 process\(es\).*this start has 1"):
        train(_settings(prepared, max_steps=3 * SPAN + 1, **every), refused, verbose=0)
    resumed = train(_settings(prepared, max_steps=3 * SPAN + 1, **every), split, verbose=0)
    # One history entry (and checkpoint) per span of SPAN updates; the last is short.
    assert [e["steps"] for e in metrics["history"]] == [3, 6, 9, 10]
    assert [e["steps"] for e in resumed["history"]] == [3, 6, 9, 10]
    assert ["val_loss" in e for e in metrics["history"]] == [False, True, False, True]
    assert [e.get("val_loss") for e in resumed["history"]] == pytest.approx(
        [e.get("val_loss") for e in metrics["history"]], abs=1e-6
    )
    for a, b in zip(_weights(whole), _weights(split), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    per_epoch = metrics["train_data"]["batches"]
    assert metrics["history"][-1]["data_epochs"] == pytest.approx(10 / per_epoch, abs=1e-4)


def _train_command(data, out, max_steps):
    return [
        sys.executable, "-m", "keras_transformer.cli", "train", "--data", data, "--out", out,
        "--preset", "tiny", "--vocab-size", "400", "--tokens-per-batch", "128",
        "--select-by", "loss", "--final", "last", "--average", "1", "--precision", "float32",
        "--save-every-steps", str(SPAN), "--max-steps", str(max_steps),
    ]  # fmt: skip


@pytest.mark.slow
def test_kill_9_in_the_middle_of_an_epoch_loses_at_most_one_span(prepared, tmp_path):
    """A run killed with SIGKILL and restarted ends with the weights of one never killed."""
    steps = 6 * SPAN
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    subprocess.run(_train_command(prepared, whole, steps), env=env, check=True,
                   capture_output=True)  # fmt: skip
    process = subprocess.Popen(_train_command(prepared, killed, steps), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    positions = os.path.join(killed, "data_position.json")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.isfile(positions):
            with open(positions, encoding="utf-8") as f:
                if "2" in json.load(f):
                    break
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    subprocess.run(_train_command(prepared, killed, steps), env=env, check=True,
                   capture_output=True)  # fmt: skip
    for a, b in zip(_weights(whole), _weights(killed), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _signal_when_written(path, key, number=signal.SIGTERM):
    """Sends `number` to this process once the JSON file `path` holds `key` (from a thread:
    the handler runs in the main thread, inside `fit`)."""

    def watch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    if key(json.load(f)):
                        os.kill(os.getpid(), number)
                        return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.integration
def test_sigterm_saves_the_span_in_flight_and_the_rerun_ends_as_an_unstopped_run(
    prepared, whole_run, tmp_path
):
    """SIGTERM after the first span: the run stops after the update in flight, saves it as
    a span (its data position, checkpoint and backup), and returns; the same settings
    then resume at the next batch and end with the weights of a run never stopped."""
    _, whole = whole_run
    stopped = str(tmp_path / "stopped")
    steps = STEPS
    positions = os.path.join(stopped, "data_position.json")
    watcher = _signal_when_written(positions, lambda p: "1" in p)
    result = train(_settings(prepared, max_steps=steps, **EVERY), stopped, verbose=0)
    watcher.join()
    assert result["stopped_by"] == "SIGTERM"
    at = result["steps"]
    assert SPAN < at < steps
    with open(positions, encoding="utf-8") as f:
        assert json.load(f) == {"1": SPAN, "2": at, "readers": 1}
    with open(os.path.join(stopped, "history.json"), encoding="utf-8") as f:
        history = json.load(f)
    assert [e["steps"] for e in history] == [SPAN, at]
    assert not os.path.exists(os.path.join(stopped, "model.keras"))  # not finished
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone again

    resumed = train(_settings(prepared, max_steps=steps, **EVERY), stopped, verbose=0)
    assert resumed["steps"] == steps
    for a, b in zip(_weights(whole), _weights(stopped), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
