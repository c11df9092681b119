"""Training under real tf.distribute strategies: 2 logical CPU devices, 2 local worker processes."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_transformer.config import TransformerConfig
from keras_transformer.losses import LabelSmoothedCrossEntropy

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="tf.distribute needs the TensorFlow backend"
)


@pytest.fixture(scope="module")
def mirrored_strategy():
    """One MirroredStrategy over two logical CPU devices for the whole module.

    (Several strategies in one process can collide in their collective ops.)
    """
    import tensorflow as tf

    from keras_transformer.distribute import make_strategy

    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) < 2:
        pytest.skip("needs 2 logical CPU devices (tests/conftest.py sets them up at start)")
    return make_strategy("mirrored", devices=devices[:2])


class PerReplicaMeanLoss(LabelSmoothedCrossEntropy):
    """The wrong reduction: each replica's own token mean, averaged over replicas.

    This is what a Keras loss with the default reduction does under a strategy.
    """

    def __call__(self, y_true, y_pred, sample_weight=None):
        from keras.src.losses.loss import scale_loss_for_distribution

        mask = keras.ops.cast(keras.ops.not_equal(y_true, 0), "float32")
        losses = self.call(y_true, y_pred)
        return scale_loss_for_distribution(
            keras.ops.divide_no_nan(keras.ops.sum(losses), keras.ops.sum(mask))
        )


def _uneven_batches(num_batches=3, batch_size=4, length=12, vocabulary_size=40, seed=0):
    """Global batches whose first half is long sentences and second half short ones.

    Split over two replicas, replica 0 holds ~6x the real tokens of replica 1.
    """
    rng = np.random.default_rng(seed)
    n = num_batches * batch_size
    source = rng.integers(3, vocabulary_size, (n, length)).astype("int32")
    target = rng.integers(3, vocabulary_size, (n, length + 1)).astype("int32")
    for i in range(n):
        if i % batch_size >= batch_size // 2:  # the second half of each batch: short
            source[i, 3:] = 0
            target[i, 3:] = 0
    return {"source_ids": source, "target_ids": target[:, :-1]}, target[:, 1:]


def _fit(model, x, y, batch_size):
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()]


def _train_pair(strategy, loss=None, optimizer=None, steps=3):
    """Trains a mirrored and a one-device copy of the same model on the same global batches."""
    from keras_transformer.train import build_and_compile

    config = TransformerConfig.from_preset("tiny", vocabulary_size=40, dropout=0.0)
    mirrored = build_and_compile(config, strategy, warmup_steps=2)
    single = build_and_compile(config, None, warmup_steps=2)
    start = [np.asarray(w) for w in mirrored.get_weights()]
    single.set_weights(start)
    if loss is not None or optimizer is not None:
        with strategy.scope():
            mirrored.compile(optimizer=optimizer(), loss=loss or mirrored.loss)
            mirrored.optimizer.build(mirrored.trainable_variables)
        single.compile(optimizer=optimizer(), loss=loss or single.loss)
        single.optimizer.build(single.trainable_variables)  # as build_and_compile does
    x, y = _uneven_batches(num_batches=steps)
    return _fit(mirrored, x, y, 4), _fit(single, x, y, 4), mirrored, start


def _sgd():
    return keras.optimizers.SGD(learning_rate=0.5, momentum=0.9)


def test_mirrored_over_two_cpus_equals_one_device(mirrored_strategy):
    strategy = mirrored_strategy
    assert strategy.num_replicas_in_sync == 2
    mirrored, single, model, start = _train_pair(strategy, optimizer=_sgd)
    assert int(model.optimizer.iterations.numpy()) == 3
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(mirrored, single, strict=True))
    assert difference < 1e-5
    # The steps did move the weights (the comparison is not between two idle models).
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(mirrored, start, strict=True)) > 1e-2


@pytest.mark.slow
def test_mirrored_with_the_training_optimizer(mirrored_strategy):
    """The same with Adam and the paper's schedule, as `train` uses them.

    Adam divides each gradient by its own running magnitude, so an element
    whose true gradient is ~0 turns float rounding noise (different summation
    order on two replicas) into a step of random sign. Attention key biases
    are such elements everywhere (softmax ignores a shift shared by all keys)
    and are left out; elsewhere almost every element must agree to 1e-5.
    """
    mirrored, single, model, _ = _train_pair(mirrored_strategy)
    paths = [v.path for v in model.weights]
    disagreeing = total = 0
    for path, a, b in zip(paths, mirrored, single, strict=True):
        if path.endswith("key_dense/bias"):
            continue
        disagreeing += int(np.sum(np.abs(a - b) > 1e-5))
        total += a.size
    assert total > 0.99 * sum(w.size for w in mirrored)
    assert disagreeing / total < 1e-4, f"{disagreeing} of {total} elements differ by more than 1e-5"


def test_a_mean_of_replica_means_would_differ(mirrored_strategy):
    """The control: with uneven padding, averaging per-replica means is a different update."""
    mirrored, single, _, _ = _train_pair(
        mirrored_strategy, loss=PerReplicaMeanLoss(0.1), optimizer=_sgd
    )
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(mirrored, single, strict=True))
    assert difference > 1e-3


def test_global_token_mean_inside_a_replica_step(mirrored_strategy):
    """Each replica's loss is its token-loss sum over the global real-token count."""
    import tensorflow as tf

    strategy = mirrored_strategy
    loss = LabelSmoothedCrossEntropy(0.0)
    logits = np.zeros((4, 3, 5), "float32")  # uniform: log(5) per real token
    labels = np.array([[1, 2, 3], [1, 2, 0], [1, 0, 0], [0, 0, 0]], "int32")  # 3+2+1+0 tokens

    def step(y):
        return loss(y, tf.zeros(tf.concat([tf.shape(y), [5]], 0)))

    per_replica = strategy.run(
        step, args=(strategy.experimental_distribute_values_from_function(
            lambda ctx: labels[2 * ctx.replica_id_in_sync_group : 2 * ctx.replica_id_in_sync_group + 2]
        ),)
    )  # fmt: skip
    values = [float(v) for v in strategy.experimental_local_results(per_replica)]
    assert values == pytest.approx([5 * np.log(5) / 6, 1 * np.log(5) / 6], rel=1e-5)
    assert sum(values) == pytest.approx(float(loss(labels, logits)), rel=1e-5)


@pytest.mark.parametrize(
    "tf_config, message",
    [
        ('{"cluster": {}}', 'must hold "cluster" and "task"'),
        ('{"cluster": {"worker": "127.0.0.1:1"}, "task": {"type": "worker", "index": 0}}',
         'job "worker" must be a list of "host:port" addresses'),
        ('{"cluster": {"worker": ["127.0.0.1"]}, "task": {"type": "worker", "index": 0}}',
         'job "worker" must be a list of "host:port" addresses'),
        ('{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "chief", "index": 0}}',
         '"task" must name a job of the cluster'),
        ('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 2}}',
         "task index must be between 0 and 1"),
    ],
)  # fmt: skip
def test_train_rejects_a_bad_tf_config_before_writing(tf_config, message, tmp_path, monkeypatch):
    from keras_transformer import cli

    for name in ("s", "t"):
        (tmp_path / name).write_text("a b\n")
    monkeypatch.setenv("TF_CONFIG", tf_config)
    files = ["--src-train", "s", "--tgt-train", "t", "--src-valid", "s", "--tgt-valid", "t"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli.main(["train", *files, "--out", "run", "--strategy", "multi-worker"])
    assert not (tmp_path / "run").exists()


def test_strategy_argument_checks():
    from keras_transformer.distribute import make_strategy

    with pytest.raises(ValueError, match="strategy must be one of"):
        make_strategy("horovod")


def test_multi_worker_needs_tf_config(monkeypatch):
    from keras_transformer.distribute import make_strategy

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG, which is not set"):
        make_strategy("multi-worker")
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        make_strategy("multi-worker")


def test_chief_and_working_directories(monkeypatch, tmp_path):
    from keras_transformer.distribute import is_chief, working_directory

    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})
    )
    assert is_chief() and working_directory(str(tmp_path / "run")) == str(tmp_path / "run")
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}})
    )
    assert not is_chief()
    private = working_directory(str(tmp_path / "run"))
    assert not private.startswith(str(tmp_path)) and private == working_directory(
        str(tmp_path / "run")
    )
    with_chief = {"chief": ["127.0.0.1:3"], **cluster}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": with_chief, "task": {"type": "worker", "index": 0}})
    )
    assert not is_chief()


# ----------------------------------------------------------------- two worker processes


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _start_workers(paths, out, epochs, ports):
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    processes = []
    for index in range(len(ports)):
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "TF_CONFIG": json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}
            ),
        }
        command = [
            sys.executable, "-m", "keras_transformer.cli", "train", "--strategy", "multi-worker",
            "--src-train", paths["train.src"], "--tgt-train", paths["train.tgt"],
            "--src-valid", paths["valid.src"], "--tgt-valid", paths["valid.tgt"],
            "--out", str(out), "--preset", "tiny", "--vocab-size", "400", "--dropout", "0",
            "--tokens-per-batch", "1024", "--warmup-steps", "50", "--epochs", str(epochs),
        ]  # fmt: skip
        log = open(out.parent / f"worker{index}.log", "w")
        processes.append((subprocess.Popen(command, env=env, stdout=log, stderr=log), log))
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


def _h5_arrays(path):
    import h5py

    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, obj: arrays.__setitem__(name, obj[()]) if hasattr(obj, "shape") else None
        )
    return arrays


@pytest.fixture(scope="module")
def toy_files(tmp_path_factory):
    from keras_transformer.data.toy import generate_toy_corpus

    corpus = generate_toy_corpus(num_train=600, num_valid=40, num_test=10, max_words=6, seed=2)
    return corpus.write(str(tmp_path_factory.mktemp("toy_text")))


def _worker_dir(out, index):
    from keras_transformer.distribute import working_directory

    old = os.environ.get("TF_CONFIG")
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": index}}
    )
    try:
        return Path(working_directory(str(out)))
    finally:
        if old is None:
            del os.environ["TF_CONFIG"]
        else:
            os.environ["TF_CONFIG"] = old


@pytest.mark.slow
def test_two_worker_processes_end_with_identical_weights(toy_files, tmp_path):
    out = tmp_path / "run"
    codes = _wait(_start_workers(toy_files, out, 2, _free_ports(2)), timeout=480)
    logs = "\n".join((tmp_path / f"worker{i}.log").read_text()[-2000:] for i in range(2))
    assert codes == [0, 0], logs
    assert {"model.keras", "spm.model", "metrics.json", "history.json", "config.json"} <= set(
        os.listdir(out)
    )
    assert json.loads((out / "metrics.json").read_text())["epochs"] == 2
    worker = _worker_dir(out, 1)
    try:
        assert not (worker / "model.keras").exists()  # the worker never finishes a run of its own
        assert (worker / "spm.model").read_bytes() == (out / "spm.model").read_bytes()
        _assert_same_weights(
            out / "checkpoints" / "epoch-002.weights.h5",
            worker / "checkpoints" / "epoch-002.weights.h5",
        )
    finally:
        import shutil

        shutil.rmtree(worker, ignore_errors=True)


def _assert_same_weights(chief_file, worker_file):
    chief, other = _h5_arrays(chief_file), _h5_arrays(worker_file)
    model_weights = [k for k in chief if "optimizer" not in k]
    assert model_weights and set(chief) == set(other)
    for key in model_weights:
        np.testing.assert_array_equal(chief[key], other[key], err_msg=key)


@pytest.mark.slow
def test_killed_worker_job_resumes_from_the_last_backup(toy_files, tmp_path):
    """Kill a worker mid-run, tear the job down, restart it: it resumes from the chief's backup.

    The killed worker also loses its temporary folder (as on a replaced
    machine), so it has no backup of its own: it must take the chief's
    weights, optimizer state and epoch, or the two would diverge or hang.
    """
    import shutil

    out = tmp_path / "run"
    processes = _start_workers(toy_files, out, 3, _free_ports(2))
    metadata = out / "backup" / "training_metadata.json"
    deadline = time.time() + 300
    while not metadata.exists() and time.time() < deadline and processes[0][0].poll() is None:
        time.sleep(0.05)
    processes[1][0].send_signal(signal.SIGKILL)  # a worker dies mid-run
    time.sleep(1)
    processes[0][0].send_signal(signal.SIGKILL)  # the job is torn down
    _wait(processes, timeout=30)
    assert metadata.exists(), "no epoch completed before the kill"
    first = json.loads((out / "history.json").read_text())
    worker = _worker_dir(out, 1)
    shutil.rmtree(worker, ignore_errors=True)

    try:
        codes = _wait(_start_workers(toy_files, out, 3, _free_ports(2)), timeout=480)
        logs = "\n".join((tmp_path / f"worker{i}.log").read_text()[-2000:] for i in range(2))
        assert codes == [0, 0], logs
        history = json.loads((out / "history.json").read_text())
        assert [e["epoch"] for e in history] == [1, 2, 3]
        assert history[0] == first[0]
        assert "Resuming" in (tmp_path / "worker0.log").read_text()
        # The worker ran only the epochs after the chief's backup, from the chief's state.
        worker_epochs = [e["epoch"] for e in json.loads((worker / "history.json").read_text())]
        assert worker_epochs == [e["epoch"] for e in history[len(first) :]]
        _assert_same_weights(
            out / "checkpoints" / "epoch-003.weights.h5",
            worker / "checkpoints" / "epoch-003.weights.h5",
        )
    finally:
        shutil.rmtree(worker, ignore_errors=True)
