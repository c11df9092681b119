import numpy as np
import pytest

from benchmarks.recipe_sweep import WIDTHS, Batches
from keras_transformer import LabelSmoothedCrossEntropy, TransformerConfig, build_transformer
from keras_transformer.data.pipeline import EncodedPairs, PipelineStats

pytestmark = pytest.mark.integration


def _pairs(count, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=(count, 2))
    source = [list(rng.integers(4, 60, size=n)) for n in lengths[:, 0]]
    target = [list(rng.integers(4, 60, size=n)) for n in lengths[:, 1]]
    return source, target


def test_sweep_batches_are_the_pipelines_batches_padded_to_one_shape():
    source, target = _pairs(700)
    batches = Batches(source, target, 512, 128, seed=3)
    stats = PipelineStats(700, 0, 0, 700, 0, 0)
    epoch = batches.epoch_members()
    assert len(epoch) == batches.count() == EncodedPairs(source, target, 128, stats).batches(512)
    assert sorted(i for members in epoch for i in members) == list(range(700))
    shapes = set()
    for members in epoch:
        # One bucket per batch, at most its batch size (tf.data's bucket_by_sequence_length).
        keys = [max(len(source[i]), len(target[i])) + 1 for i in members]
        (bucket,) = set(np.searchsorted(batches.boundaries, keys))
        assert len(members) <= batches.sizes[bucket]
        x, labels = batches.pad(members)
        shapes.add(x["source_ids"].shape)
        for row, i in enumerate(members):
            assert list(x["source_ids"][row, : len(source[i]) + 1]) == [*source[i], 2]
            assert list(labels[row, : len(target[i]) + 1]) == [*target[i], 2]
            assert list(x["target_ids"][row, : len(target[i]) + 1]) == [1, *target[i]]
        assert not labels[len(members) :].any()
    assert len(shapes) == 1 and shapes.pop()[1] in WIDTHS  # one compiled program


def test_padding_rows_and_columns_leave_the_loss_unchanged():
    source, target = _pairs(40, seed=1)
    batches = Batches(source, target, 256, 64, seed=0)
    model = build_transformer(
        TransformerConfig.from_preset("tiny", vocabulary_size=64, dropout=0.0)
    )
    loss = LabelSmoothedCrossEntropy(0.1)
    members = batches.epoch_members()[0]
    x, labels = batches.pad(members)
    n = len(members)
    s_len = max(len(source[i]) for i in members) + 1
    t_len = max(len(target[i]) for i in members) + 1
    assert x["source_ids"].shape[0] > n and x["source_ids"].shape[1] > max(s_len, t_len)
    trimmed = {"source_ids": x["source_ids"][:n, :s_len], "target_ids": x["target_ids"][:n, :t_len]}
    padded_loss = float(loss(labels, model(x)))
    trimmed_loss = float(loss(labels[:n, :t_len], model(trimmed)))
    np.testing.assert_allclose(padded_loss, trimmed_loss, rtol=1e-5)


def test_rdrop_batches_pair_each_sentence_as_the_pipeline_does():
    import tensorflow as tf

    from keras_transformer.data.pipeline import duplicate_rows

    source, target = _pairs(60, seed=2)
    once = Batches(source, target, 256, 64, seed=5)
    twice = Batches(source, target, 256, 64, seed=5, twice=True)
    members = once.epoch_members()[0]
    x, labels = once.pad(members)
    x2, labels2 = twice.pad(members)
    dataset = tf.data.Dataset.from_tensors((x, labels))
    ((expected_x, expected_labels),) = list(duplicate_rows(dataset).as_numpy_iterator())
    for name in ("source_ids", "target_ids"):
        np.testing.assert_array_equal(x2[name], expected_x[name])
    np.testing.assert_array_equal(labels2, expected_labels)
    assert x2["source_ids"].shape[0] == 2 * x["source_ids"].shape[0]
