"""JAX data-parallel runs of 1 and 2 real `train` processes on 127.0.0.1: the same weights
as one process, a dying process, a dead coordinator, SIGTERM and SIGINT, R-Drop over two
devices, and a prepared dataset."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest


def _jax_available():
    import importlib.util

    return importlib.util.find_spec("jax") is not None


def _fixed_length_corpus(folder):
    """600 training and 40 validation pairs of five one-letter words (reversed and upper-cased
    on the target side): every sentence the same length, so one bucket and few shapes to
    compile."""
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrst")
    paths = {}
    for name, count in (("train", 600), ("valid", 40)):
        words = [rng.choice(letters, 5) for _ in range(count)]
        for side, lines in (
            ("src", [" ".join(w) for w in words]),
            ("tgt", [" ".join(w[::-1]).upper() for w in words]),
        ):
            path = folder / f"{name}.{side}"
            path.write_text("\n".join(lines) + "\n")
            paths[f"{name}.{side}"] = str(path)
    return paths


@pytest.fixture(scope="module")
def fixed_corpus(tmp_path_factory):
    return _fixed_length_corpus(tmp_path_factory.mktemp("fixed_corpus"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_processes(paths, out, count, *extra, port=None, env=None):
    """`count` processes of one `train` command (count 1 and no port: a default one-device run)."""
    base = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
    files = []  # the text files given (none for training when `extra` has --data)
    for key in ("train.src", "train.tgt", "valid.src", "valid.tgt"):
        if key in paths:
            files += ["--" + "-".join(reversed(key.split("."))), paths[key]]
    command = [
        sys.executable, "-m", "keras_transformer.cli", "train", *files,
        "--out", str(out), "--preset", "tiny", "--vocab-size", "400", "--precision", "float32",
        "--tokens-per-batch", "1024", "--warmup-steps", "50", *extra,
    ]  # fmt: skip
    processes = []
    for index in range(count):
        place = []
        if port is not None:
            place = ["--strategy", "data-parallel", "--coordinator", f"127.0.0.1:{port}"]
            place += ["--num-processes", str(count), "--process-id", str(index)]
        log = open(f"{out}.process{index}.log", "w")
        processes.append((subprocess.Popen(command + place, env=base, stdout=log, stderr=log), log))
    return processes


def _wait(processes, timeout):
    deadline = time.time() + timeout
    try:
        for process, _ in processes:
            process.wait(timeout=max(1, deadline - time.time()))
    finally:
        for process, log in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    return [p.returncode for p, _ in processes]


def _logs(out, count):
    return "\n".join(Path(f"{out}.process{i}.log").read_text()[-3000:] for i in range(count))


def _h5_arrays(path):
    import h5py

    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, obj: arrays.__setitem__(name, obj[()]) if hasattr(obj, "shape") else None
        )
    return arrays


@pytest.mark.integration
@pytest.mark.skipif(not _jax_available(), reason="needs jax (pip install '.[jax]')")
def test_two_processes_train_the_weights_of_one(fixed_corpus, tmp_path):
    """2 processes of 1 CPU device each (JAX, gloo over 127.0.0.1), each fed half of every
    global batch, against 1 process on one device fed the whole batches: after the same 6
    updates (an epoch of 5 batches, then one more), the same weights.

    Tolerance: 2e-5 absolute, on every element but the attention key biases. The
    two runs sum the same numbers in another order (two half-batch gradients
    then an all-reduce, against one sum), so values differ by float32 rounding;
    Adam divides each gradient by its own running magnitude, which turns that
    noise into whole steps of random sign where the true gradient is ~0. The
    key biases are such elements everywhere (softmax ignores a shift shared by
    all keys), so they are left out, as in the mirrored test (here up to 3.3e-5
    apart, on biases of at most 6e-5; every other element within 1e-5).
    """
    steps = ["--max-steps", "6", "--epochs", "2", "--select-by", "bleu"]
    one, two = tmp_path / "one", tmp_path / "two"
    # Both runs at once, so that their start-up (imports, the tokenizer) and the
    # group's waits on each other overlap.
    reference = _start_processes(fixed_corpus, one, 1, *steps)
    group = _start_processes(fixed_corpus, two, 2, *steps, port=_free_port())
    codes = _wait(reference, timeout=600), _wait(group, timeout=600)
    assert codes[0] == [0], _logs(one, 1)
    assert codes[1] == [0, 0], _logs(two, 2)

    # Process 0 wrote the run; process 1 left nothing in it.
    assert {"model.keras", "spm.model", "metrics.json", "history.json", "config.json"} <= set(
        os.listdir(two)
    )
    assert (two / "spm.model").read_bytes() == (one / "spm.model").read_bytes()
    history_one = json.loads((one / "history.json").read_text())
    history_two = json.loads((two / "history.json").read_text())
    assert [e["steps"] for e in history_two] == [e["steps"] for e in history_one] == [5, 6]
    # The validation BLEU of every epoch, decoded by process 0 alone.
    assert all("val_bleu" in e for e in history_two)
    log = Path(f"{two}.process0.log").read_text()
    assert "Training on 2 devices of 2 processes" in log

    first, second = (
        _h5_arrays(one / "checkpoints" / "epoch-002.weights.h5"),
        _h5_arrays(two / "checkpoints" / "epoch-002.weights.h5"),
    )
    assert set(first) == set(second)
    compared = disagreeing = 0
    for key, value in first.items():
        if "optimizer" in key or key.endswith("key_dense/vars/1"):  # the key biases
            continue
        compared += value.size
        disagreeing += int(np.sum(np.abs(value - second[key]) > 2e-5))
    assert compared > 10_000
    assert disagreeing == 0, f"{disagreeing} of {compared} elements differ by more than 2e-5"
    start = _h5_arrays(one / "checkpoints" / "epoch-001.weights.h5")
    moved = max(float(np.max(np.abs(first[k] - start[k]))) for k in first if "optimizer" not in k)
    # The last update alone moved weights by 2e-4, ten times the tolerance: not an idle comparison.
    assert moved > 1e-4


def _process_folders():
    import glob
    import tempfile

    return set(glob.glob(os.path.join(tempfile.gettempdir(), "keras-transformer-process-*")))


# A dead process is noticed after 5 missed heartbeats of 1 s.
FAST_WATCH = {
    "KERAS_DISTRIBUTION_HEARTBEAT_INTERVAL": "1",
    "KERAS_DISTRIBUTION_MISSED_HEARTBEATS": "5",
}


def _kill_after_first_backup(fixed_corpus, out, extra, killed, timeout):
    """Two processes, process `killed` killed once the first backup is written:
    `(group, exit codes, seconds from the kill to the end)`."""
    group = _start_processes(fixed_corpus, out, 2, *extra, port=_free_port(), env=FAST_WATCH)
    metadata = out / "backup" / "training_metadata.json"
    deadline = time.time() + 600
    while not metadata.exists() and time.time() < deadline and group[0][0].poll() is None:
        time.sleep(0.2)
    assert metadata.exists(), _logs(out, 2)
    group[killed][0].kill()
    started = time.time()
    codes = _wait(group, timeout=timeout)
    return group, codes, time.time() - started


@pytest.mark.slow
@pytest.mark.skipif(not _jax_available(), reason="needs jax (pip install '.[jax]')")
def test_a_dying_process_ends_the_run_and_the_same_commands_resume_it(fixed_corpus, tmp_path):
    """Process 1 is killed after the first epoch's backup: process 0 ends within the
    heartbeat timeout with one line that names process 1 and no stack dump; the same
    two commands then resume from process 0's backup. (A dead process 0: the test below.)"""
    import shutil

    before = _process_folders()
    out, extra = tmp_path / "run", ["--epochs", "3", "--select-by", "loss"]
    group, codes, took = _kill_after_first_backup(fixed_corpus, out, extra, 1, 120)
    log = Path(f"{out}.process0.log").read_text()
    try:
        assert codes[0] == 1, log[-3000:]
        assert took < 5 * 1 + 20, log[-3000:]
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "process 1 of the run" in errors[0], log[-3000:]
        assert "start the same commands again" in errors[0]
        for dump in ("Traceback", "Check failure stack trace", "terminate called"):
            assert dump not in log, log[-3000:]
        first = json.loads((out / "history.json").read_text())
        assert len(first) in (1, 2)

        group = _start_processes(fixed_corpus, out, 2, *extra, port=_free_port())
        assert _wait(group, timeout=900) == [0, 0], _logs(out, 2)
        history = json.loads((out / "history.json").read_text())
        assert [e["epoch"] for e in history] == [1, 2, 3]
        assert history[0] == first[0]
        assert [e["steps"] for e in history] == [5, 10, 15]
        assert "Resuming" in Path(f"{out}.process0.log").read_text()
    finally:
        for folder in _process_folders() - before:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(not _jax_available(), reason="needs jax (pip install '.[jax]')")
def test_a_dead_coordinator_ends_the_others_with_one_line_and_no_stack_dump(fixed_corpus, tmp_path):
    """kill -9 of process 0: JAX's client in process 1 aborts at once; its standard
    error shows one line naming the coordinator and the file that holds JAX's dump,
    and its temporary folder is gone."""
    before = _process_folders()
    out, extra = tmp_path / "run", ["--epochs", "3", "--select-by", "loss"]
    group, codes, took = _kill_after_first_backup(fixed_corpus, out, extra, 0, 60)
    log_path = Path(f"{out}.process1.log")
    deadline = (
        time.time() + 30
    )  # the line comes from the relay, which outlives the process a moment
    while "error:" not in log_path.read_text() and time.time() < deadline:
        time.sleep(0.1)
    log = log_path.read_text()
    report = None
    try:
        assert codes[1] != 0 and took < 30, log[-3000:]
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, log[-3000:]
        assert "process 0 (the coordinator, 127.0.0.1:" in errors[0]
        assert "start the same commands again" in errors[0]
        for dump in ("Check failure stack trace", "terminate called", "@ 0x"):
            assert dump not in log, log[-3000:]
        report = errors[0].rsplit("JAX's report: ", 1)[1]
        assert "Check failure stack trace" in Path(report).read_text()
        assert _process_folders() == before
    finally:
        if report and os.path.exists(report):
            os.remove(report)
        for folder in _process_folders() - before:
            shutil.rmtree(folder, ignore_errors=True)


def _prepare_fixed(fixed_corpus, prepared):
    command = [
        sys.executable, "-m", "keras_transformer.cli", "prepare", "--out", str(prepared),
        "--src-train", fixed_corpus["train.src"], "--tgt-train", fixed_corpus["train.tgt"],
        "--src-valid", fixed_corpus["valid.src"], "--tgt-valid", fixed_corpus["valid.tgt"],
        "--vocab-size", "400", "--max-length", "48", "--workers", "1",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300)


def _signal_after_first_span(valid, out, extra, signum):
    """Two processes of `--data` training, `signum` sent to process 1 once the first
    span is saved; both must exit 0 within 30 s."""
    group = _start_processes(valid, out, 2, *extra, port=_free_port())
    positions = out / "data_position.json"
    deadline = time.time() + 600
    while time.time() < deadline and group[0][0].poll() is None:
        if positions.exists() and "1" in json.loads(positions.read_text()):
            break
        time.sleep(0.02)
    group[1][0].send_signal(signum)
    started = time.time()
    assert _wait(group, timeout=60) == [0, 0], _logs(out, 2)
    assert time.time() - started < 30


@pytest.mark.slow
@pytest.mark.skipif(not _jax_available(), reason="needs jax (pip install '.[jax]')")
def test_sigint_to_one_process_is_passed_on_as_sigterm_and_stops_both(fixed_corpus, tmp_path):
    """Ctrl-C on one process of a run: passed on as a SIGTERM, so that both stop
    after the same update, save it and exit 0."""
    prepared = tmp_path / "prepared"
    _prepare_fixed(fixed_corpus, prepared)
    valid = {k: v for k, v in fixed_corpus.items() if k.startswith("valid")}
    extra = ["--data", str(prepared), "--save-every-steps", "2", "--max-steps", "30"]
    extra += ["--select-by", "loss", "--final", "last"]
    _signal_after_first_span(valid, tmp_path / "run", extra, signal.SIGINT)
    saved = json.loads((tmp_path / "run" / "data_position.json").read_text())
    at = saved[max((k for k in saved if k.isdigit()), key=int)]
    assert 2 < at < 30
    assert f"after update {at}" in Path(f"{tmp_path / 'run'}.process0.log").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not _jax_available(), reason="needs jax (pip install '.[jax]')")
def test_sigterm_to_one_process_stops_both_at_one_update_and_the_rerun_resumes(
    fixed_corpus, tmp_path
):
    """SIGTERM to process 1 of a two-process `--data` run, after its first span: JAX's
    preemption sync makes both stop after the same update and save it, both exit 0
    within 30 s, and the same commands resume at the next batch and end with the
    weights of a run never stopped."""
    prepared = tmp_path / "prepared"
    _prepare_fixed(fixed_corpus, prepared)
    valid = {k: v for k, v in fixed_corpus.items() if k.startswith("valid")}
    extra = ["--data", str(prepared), "--save-every-steps", "2", "--max-steps", "30"]
    extra += ["--select-by", "loss", "--final", "last"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    reference = _start_processes(valid, whole, 2, *extra, port=_free_port())
    assert _wait(reference, timeout=900) == [0, 0], _logs(whole, 2)

    _signal_after_first_span(valid, stopped, extra, signal.SIGTERM)
    saved = json.loads((stopped / "data_position.json").read_text())
    at = saved[max((k for k in saved if k.isdigit()), key=int)]
    assert 2 < at < 30
    assert f"Stopped by SIGTERM after update {at}" in Path(f"{stopped}.process0.log").read_text()

    group = _start_processes(valid, stopped, 2, *extra, port=_free_port())
    assert _wait(group, timeout=900) == [0, 0], _logs(stopped, 2)
    history = json.loads((stopped / "history.json").read_text())
    assert at in [e["steps"] for e in history] and history[-1]["steps"] == 30
    # The same trajectory: the same validation loss at the end. The weights agree to
    # float noise, which Adam turns into whole steps where a gradient is ~0 (see
    # test_two_processes_train_the_weights_of_one): 8e-4 at most in the runs here.
    whole_history = json.loads((whole / "history.json").read_text())
    assert history[-1]["val_loss"] == pytest.approx(whole_history[-1]["val_loss"], abs=1e-4)
    for a, b in zip(
        keras.saving.load_model(whole / "model.keras").get_weights(),
        keras.saving.load_model(stopped / "model.keras").get_weights(),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=2e-3)


@pytest.mark.slow
@pytest.mark.skipif(not _jax_available(), reason="needs jax (pip install '.[jax]')")
def test_rdrop_over_two_devices_of_one_process(fixed_corpus, tmp_path):
    """R-Drop under data-parallel: one process with 2 CPU devices (XLA's host device
    count) against one device. Each sentence's two rows stay adjacent in the global
    batch, so the loss pairs them as on one device and the weights agree (2e-5, key
    biases aside as above). Dropout is 0 so that both runs draw no masks; the
    pairing and the padding rows are what is checked."""
    extra = ["--rdrop-alpha", "1", "--max-steps", "3", "--select-by", "loss"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert _wait(_start_processes(fixed_corpus, one, 1, *extra), timeout=600) == [0], _logs(one, 1)
    devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    group = _start_processes(
        fixed_corpus, two, 1, *extra, "--strategy", "data-parallel", env=devices
    )
    assert _wait(group, timeout=600) == [0], _logs(two, 1)
    assert "Training on 2 devices of 1 process " in Path(f"{two}.process0.log").read_text()
    first = _h5_arrays(one / "checkpoints" / "epoch-001.weights.h5")
    second = _h5_arrays(two / "checkpoints" / "epoch-001.weights.h5")
    for key, value in first.items():
        if "optimizer" not in key and not key.endswith("key_dense/vars/1"):
            np.testing.assert_allclose(second[key], value, atol=2e-5, err_msg=key)


@pytest.mark.slow
@pytest.mark.skipif(not _jax_available(), reason="needs jax (pip install '.[jax]')")
def test_two_processes_train_on_a_prepared_dataset(fixed_corpus, tmp_path):
    """`train --data` under data-parallel: each process streams its own half of the prepared
    pairs as its rows of every global batch, in spans of --save-every-steps updates;
    process 0 records the data position and the number of readers."""
    prepared = tmp_path / "prepared"
    _prepare_fixed(fixed_corpus, prepared)
    out = tmp_path / "run"
    valid = {k: v for k, v in fixed_corpus.items() if k.startswith("valid")}
    extra = ["--data", str(prepared), "--save-every-steps", "2", "--max-steps", "4"]
    group = _start_processes(valid, out, 2, *extra, "--select-by", "loss", port=_free_port())
    assert _wait(group, timeout=900) == [0, 0], _logs(out, 2)
    history = json.loads((out / "history.json").read_text())
    assert [e["steps"] for e in history] == [2, 4]
    assert [e["data_epochs"] for e in history] == [0.4, 0.8]  # 5 batches an epoch
    assert json.loads((out / "data_position.json").read_text()) == {"1": 2, "2": 4, "readers": 2}
    log = Path(f"{out}.process0.log").read_text()
    assert "Training on 2 devices of 2 processes" in log
    assert "Each of the 2 processes reads its own 1/2 of the pairs" in log
