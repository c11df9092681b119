"""Training on several devices: tf.distribute's MirroredStrategy over 2 logical CPU devices,
and the rows each process of a data-parallel run keeps (the runs of real processes:
tests/test_distribute_processes.py)."""

import keras
import numpy as np
import pytest

from keras_transformer.config import TransformerConfig
from keras_transformer.losses import LabelSmoothedCrossEntropy


@pytest.fixture(scope="module")
def mirrored_strategy():
    """One MirroredStrategy over two logical CPU devices for the whole module.

    (Several strategies in one process can collide in their collective ops.)
    """
    if keras.backend.backend() != "tensorflow":
        pytest.skip("tf.distribute needs the TensorFlow backend")
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


# ------------------------------------------------------------ data-parallel (JAX) processes


def test_the_retired_multi_worker_name_points_at_data_parallel(tmp_path, monkeypatch):
    from keras_transformer import cli

    for name in ("s", "t"):
        (tmp_path / name).write_text("a b\n")
    files = ["--src-train", "s", "--tgt-train", "t", "--src-valid", "s", "--tgt-valid", "t"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"replaced by --strategy data-parallel.*--coordinator"):
        cli.main(["train", *files, "--out", "run", "--strategy", "multi-worker"])
    with pytest.raises(
        SystemExit, match="strategy must be one of default, mirrored, data-parallel"
    ):
        cli.main(["train", *files, "--out", "run", "--strategy", "horovod"])
    with pytest.raises(SystemExit, match="need strategy='data-parallel'"):
        cli.main(["train", *files, "--out", "run", "--num-processes", "2"])
    assert not (tmp_path / "run").exists()


def test_process_settings_from_flags_and_environment(monkeypatch):
    from keras_transformer.train.data_parallel import (
        ENV_COORDINATOR,
        ENV_NUM_PROCESSES,
        ENV_PROCESS_ID,
        _process_settings,
    )

    for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert _process_settings(None, None, None) == (None, 1, 0)  # one process, all its devices
    assert _process_settings("10.0.0.1:1234", 2, 1) == ("10.0.0.1:1234", 2, 1)
    monkeypatch.setenv(ENV_COORDINATOR, "10.0.0.1:1234,10.0.0.2:2345")  # Keras' list form
    monkeypatch.setenv(ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(ENV_PROCESS_ID, "1")
    assert _process_settings(None, None, None) == ("10.0.0.1:1234", 2, 1)
    assert _process_settings(None, None, 0) == ("10.0.0.1:1234", 2, 0)  # the flag wins
    with pytest.raises(ValueError, match="process_id must be between 0 and 1"):
        _process_settings(None, None, 2)
    monkeypatch.delenv(ENV_COORDINATOR)
    with pytest.raises(ValueError, match="needs the coordinator's address"):
        _process_settings(None, None, None)
    with pytest.raises(ValueError, match="process 0's HOST:PORT"):
        _process_settings("10.0.0.1", None, None)
    monkeypatch.setenv(ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="KERAS_DISTRIBUTION_NUM_PROCESSES must be an integer"):
        _process_settings(None, None, None)


def test_data_parallel_needs_the_jax_backend():
    from keras_transformer.train.data_parallel import start_data_parallel

    if keras.backend.backend() == "jax":
        pytest.skip("checks the message under another backend")
    with pytest.raises(RuntimeError, match="KERAS_BACKEND=jax"):
        start_data_parallel()


def _batches(*row_counts, width=3):
    """Global batches of `row_counts` rows whose every token is its row number + 1."""
    import tensorflow as tf

    def batch(rows):
        ids = np.repeat(np.arange(1, rows + 1, dtype="int32")[:, None], width, axis=1)
        return {"source_ids": ids, "target_ids": ids}, ids

    batches = [batch(rows) for rows in row_counts]
    return tf.data.Dataset.from_generator(
        lambda: iter(batches),
        output_signature=(
            {k: tf.TensorSpec((None, width), tf.int32) for k in ("source_ids", "target_ids")},
            tf.TensorSpec((None, width), tf.int32),
        ),
    )


@pytest.mark.parametrize(
    "count, paired, rows, expected",
    [
        (2, False, (5, 2), [3, 1]),  # 5 rows: 3 each, the 6th an empty row
        (3, False, (2,), [1]),  # 1 empty row
        (3, True, (2,), [2]),  # a pair and 4 empty rows: the padding comes in pairs too
    ],
)
def test_each_process_keeps_its_rows_of_every_global_batch(count, paired, rows, expected):
    from keras_transformer.train.data_parallel import Processes, share_of_each_batch

    shares = []  # shares[process][batch] = (features' source_ids, labels)
    for index in range(count):
        processes = Processes(index=index, count=count, devices=count)
        dataset = share_of_each_batch(_batches(*rows), processes, paired)
        shares.append([(x["source_ids"].numpy(), y.numpy()) for x, y in dataset])
    for batch, real in enumerate(rows):
        assert [len(share[batch][1]) for share in shares] == [expected[batch]] * count
        together = np.concatenate([share[batch][1] for share in shares])
        # Every real row once, in order, then only empty rows; features cut like labels.
        assert together[:real, 0].tolist() == list(range(1, real + 1))
        assert not together[real:].any()
        assert all(np.array_equal(*share[batch]) for share in shares)


def test_the_global_token_mean_is_unchanged_by_empty_rows_and_shares():
    """The loss of a global batch: the padding rows added for the devices change nothing,
    and it is not the mean of the processes' own means when their shares of real
    tokens differ."""
    loss = LabelSmoothedCrossEntropy(0.1)
    rng = np.random.default_rng(0)
    labels = np.array([[4, 5, 6, 7], [4, 5, 6, 0], [4, 0, 0, 0]], "int32")  # 4+3+1 tokens
    logits = rng.normal(size=(3, 4, 9)).astype("float32")
    padded_labels = np.concatenate([labels, np.zeros((1, 4), "int32")])
    padded_logits = np.concatenate([logits, rng.normal(size=(1, 4, 9)).astype("float32")])
    whole = float(loss(labels, logits))
    assert float(loss(padded_labels, padded_logits)) == pytest.approx(whole, rel=1e-6)
    shares = [float(loss(padded_labels[i : i + 2], padded_logits[i : i + 2])) for i in (0, 2)]
    assert np.mean(shares) != pytest.approx(whole, rel=1e-3)
