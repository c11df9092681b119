import itertools
import json
import os
import shutil

import numpy as np
import pytest

from keras_transformer.data.pipeline import BATCH_SHAPES, DataError, encode_pairs, read_parallel
from keras_transformer.data.prepare import PrepareSettings, prepare
from keras_transformer.data.shards import PreparedData
from keras_transformer.data.tokenizer import EOS_ID, PAD_ID, train_sentencepiece
from keras_transformer.data.toy import generate_toy_corpus

SETTINGS = PrepareSettings(vocab_size=400, max_length=14, pairs_per_shard=500)
TOKENS_PER_BATCH = 100


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """The toy corpus's training pairs, with an empty pair, one undecodable line, and
    pairs too long for max_length (the toy corpus has up to 10 words a side)."""
    corpus = generate_toy_corpus(num_train=2200, num_valid=40, num_test=1)
    folder = tmp_path_factory.mktemp("text")
    valid = corpus.write(str(folder / "toy"))
    sources = [s for s, _ in corpus.train] + ["", "ein Hund"]
    targets = [t for _, t in corpus.train] + ["x", "a dog"]
    src, tgt = folder / "train.src", folder / "train.tgt"
    src.write_bytes("\n".join(sources).encode() + b"\nbad \xff byte\n")
    tgt.write_text("\n".join(targets) + "\nbad byte\n")
    return str(src), str(tgt), valid["valid.src"], valid["valid.tgt"]


@pytest.fixture(scope="module")
def prepared(text, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prepared") / "data")
    prepare(text[0], text[1], out, SETTINGS, src_valid=text[2], tgt_valid=text[3], verbose=0)
    return out


def _shard_mtimes(out):
    return {
        name: os.stat(os.path.join(out, name, "source.npy")).st_mtime_ns
        for name in os.listdir(out)
        if name.startswith("shard-")
    }


def test_counts_ids_and_vocabulary_equal_the_in_memory_pipeline(text, prepared):
    sources, targets = read_parallel(text[0], text[1])
    tokenizer = train_sentencepiece(sources + targets, vocabulary_size=400, seed=0)
    data = PreparedData(prepared)
    # A corpus within the sample trains the very model that train would.
    assert data.tokenizer().model_proto == tokenizer.model_proto
    encoded = encode_pairs(sources, targets, tokenizer, SETTINGS.max_length)
    assert data.stats() == encoded.stats
    assert encoded.stats.empty_pairs == 1 and encoded.stats.too_long_pairs > 0
    batches = data.batches_per_epoch(TOKENS_PER_BATCH)
    assert batches == encoded.batches(TOKENS_PER_BATCH)
    # One epoch of the stream: every kept pair exactly once, with its ids.
    seen = []
    for source, decoder, labels in itertools.islice(data.batches(0, TOKENS_PER_BATCH), batches):
        for s, d, lab in zip(source, decoder, labels, strict=True):
            pieces = s[: np.flatnonzero(s == EOS_ID)[0]].tolist()
            target = lab[: np.flatnonzero(lab == EOS_ID)[0]].tolist()
            assert d[1 : len(target) + 1].tolist() == target
            assert (s[len(pieces) + 1 :] == PAD_ID).all()
            seen.append((tuple(pieces), tuple(target)))
    expected = [
        (tuple(s.tolist()), tuple(t.tolist()))
        for s, t in zip(encoded.source_ids, encoded.target_ids, strict=True)
    ]
    assert sorted(seen) == sorted(expected)


def test_a_stream_resumes_at_any_batch_and_reshuffles_each_epoch(prepared):
    data = PreparedData(prepared)
    per_epoch = data.batches_per_epoch(TOKENS_PER_BATCH)
    run = [b[0] for b in itertools.islice(data.batches(3, TOKENS_PER_BATCH), 2 * per_epoch)]
    resumed = data.batches(3, TOKENS_PER_BATCH, start_epoch=1, start_batch=5)
    for expected, batch in zip(run[per_epoch + 5 :], resumed, strict=False):
        np.testing.assert_array_equal(batch[0], expected)
    first, second = run[:per_epoch], run[per_epoch:]
    assert any(a.shape != b.shape or (a != b).any() for a, b in zip(first, second, strict=True))


def _pairs_of(batch):
    """The (source, target) pieces of the real rows of a batch (rows of padding left out)."""
    source, _, labels = batch
    pairs = []
    for s, lab in zip(source, labels, strict=True):
        if (lab == PAD_ID).all():
            continue
        pieces = s[: np.flatnonzero(s == EOS_ID)[0]].tolist()
        pairs.append((tuple(pieces), tuple(lab[: np.flatnonzero(lab == EOS_ID)[0]].tolist())))
    return pairs


@pytest.mark.parametrize("count", [2, 3])
def test_readers_read_their_own_runs_of_shards_in_steps_of_one_shape(prepared, count):
    data = PreparedData(prepared)
    total = data.stats().kept_pairs
    parts = [data.part_pieces((i, count)) for i in range(count)]
    # Contiguous runs of equal size that cover every pair once, cut within at most count-1 shards.
    flat = [(shard, row) for pieces in parts for shard, a, b in pieces for row in range(a, b)]
    assert len(flat) == len(set(flat)) == total
    assert (
        max(sum(b - a for _, a, b in p) for p in parts)
        - min(sum(b - a for _, a, b in p) for p in parts)
        <= 1
    )
    opened = [{shard for shard, _, _ in pieces} for pieces in parts]
    assert sum(len(shards) for shards in opened) <= len(data.shard_names) + count - 1

    # The global batch keeps its budget: each reader fills 1/count of it.
    local = TOKENS_PER_BATCH // count
    steps = data.steps_per_epoch(local, count)
    assert steps == len(data.schedule(0, 0, local, count))
    own_batches = [sum(1 for _ in data.epoch_plan(0, 0, local, (i, count))) for i in range(count)]
    assert max(own_batches) <= steps <= sum(own_batches)
    streams = [
        list(itertools.islice(data.batches(0, local, part=(i, count), rows_multiple=2), steps))
        for i in range(count)
    ]
    seen = []
    for step in zip(*streams, strict=True):
        assert len({batch[0].shape for batch in step}) == 1  # one global batch
        assert step[0][0].shape[0] % 2 == 0
        seen += [pair for batch in step for pair in _pairs_of(batch)]
    one_reader = itertools.islice(
        data.batches(0, TOKENS_PER_BATCH), data.batches_per_epoch(TOKENS_PER_BATCH)
    )
    assert sorted(seen) == sorted(pair for batch in one_reader for pair in _pairs_of(batch))
    # Each reader's plan refers only to its own rows.
    for i, pieces in enumerate(parts):
        own = {(shard << 32) + row for shard, a, b in pieces for row in range(a, b)}
        planned = np.concatenate([refs for _, refs in data.epoch_plan(0, 0, local, (i, count))])
        assert set(planned.tolist()) == own
    # A reader resumes at any global step of any epoch.
    later = list(itertools.islice(data.batches(0, local, part=(1, count)), steps + 9))
    resumed = data.batches(0, local, start_epoch=1, start_batch=4, part=(1, count))
    for expected, batch in zip(later[steps + 4 :], resumed, strict=False):
        np.testing.assert_array_equal(batch[2], expected[2])
    with pytest.raises(DataError, match="fewer than 99999 readers"):
        data.part_pieces((0, 99999))
    with pytest.raises(ValueError, match="index must be in"):
        data.part_pieces((2, 2))


def test_few_shapes_stream_one_shape_per_bucket_as_text_batches_do(text, prepared):
    """With `few` shapes the stream's batches are those of the in-memory pipeline: the same
    count an epoch, and every batch of a bucket at its full row count."""
    few = BATCH_SHAPES["few"]
    data = PreparedData(prepared, shapes=few)
    pairs = encode_pairs(*read_parallel(text[0], text[1]), data.tokenizer(), 14, shapes=few)
    per_epoch = data.batches_per_epoch(TOKENS_PER_BATCH)
    assert per_epoch == pairs.batches(TOKENS_PER_BATCH)
    boundaries = few.boundaries(14)
    rows = dict(zip(boundaries, few.rows(boundaries, TOKENS_PER_BATCH), strict=True))
    stream = data.batches(seed=0, tokens_per_batch=TOKENS_PER_BATCH)
    shapes, real = set(), 0
    for source, _, labels in itertools.islice(stream, 2 * per_epoch):
        assert source.shape == (rows[source.shape[1]], source.shape[1])
        shapes.add(source.shape)
        real += int((labels != PAD_ID).any(axis=1).sum())
    assert real == 2 * data.stats().kept_pairs
    assert len(shapes) <= few.bound(14)
    # Known before a batch is read (compiled ahead under JAX), as the text pipeline's.
    assert set(data.batch_shapes(TOKENS_PER_BATCH)) == shapes
    assert set(data.batch_shapes(TOKENS_PER_BATCH)) == set(pairs.batch_shapes(TOKENS_PER_BATCH))
    # Two readers at half the tokens each, rows a multiple of 2: each reads its rows of
    # the global batch.
    local = TOKENS_PER_BATCH // 2
    two = data.batches(seed=0, tokens_per_batch=local, part=(1, 2), rows_multiple=2)
    read = {(s.shape[0] * 2, s.shape[1]) for s, _, _ in itertools.islice(two, 2 * per_epoch)}
    assert read == set(data.batch_shapes(local, 2, rows_multiple=2))
    assert PreparedData(prepared).batch_shapes(TOKENS_PER_BATCH) == ()  # `fine`: not fixed


def test_a_rerun_on_a_prepared_directory_does_nothing(text, prepared):
    before = _shard_mtimes(prepared)
    manifest = prepare(text[0], text[1], prepared, SETTINGS, text[2], text[3], verbose=0)
    assert _shard_mtimes(prepared) == before
    assert manifest["stats"]["kept_pairs"] == PreparedData(prepared).stats().kept_pairs


def test_a_killed_run_resumes_keeping_its_finished_shards(text, prepared, tmp_path):
    out = str(tmp_path / "data")
    shutil.copytree(prepared, out)
    # As a kill leaves it: no manifest yet, a shard missing, one half written.
    os.remove(os.path.join(out, "manifest.json"))
    with open(os.path.join(prepared, "manifest.json"), encoding="utf-8") as f:
        identity = json.load(f)["identity"]
    with open(os.path.join(out, "prepare.json"), "w", encoding="utf-8") as f:
        json.dump(identity, f)
    shutil.move(os.path.join(out, "shard-00002"), os.path.join(out, ".shard-00002.half"))
    os.remove(os.path.join(out, ".shard-00002.half", "stats.json"))
    with pytest.raises(DataError, match="did not finish; rerun it to resume"):
        PreparedData(out)
    kept = _shard_mtimes(out)
    prepare(text[0], text[1], out, SETTINGS, text[2], text[3], verbose=0)
    now = _shard_mtimes(out)
    assert {k: now[k] for k in kept} == kept and "shard-00002" in now
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    for name in ("source.npy", "target.npy", "lengths.npy"):
        a = np.load(os.path.join(out, "shard-00002", name))
        np.testing.assert_array_equal(a, np.load(os.path.join(prepared, "shard-00002", name)))
    assert PreparedData(out).stats() == PreparedData(prepared).stats()


def test_other_settings_or_changed_inputs_are_refused(text, prepared, tmp_path):
    with pytest.raises(DataError, match="vocab_size.*400 there, 500 now"):
        other = PrepareSettings(vocab_size=500, max_length=14, pairs_per_shard=500)
        prepare(text[0], text[1], prepared, other, text[2], text[3], verbose=0)
    src, tgt = tmp_path / "a.src", tmp_path / "a.tgt"
    shutil.copy(text[0], src)
    shutil.copy(text[1], tgt)
    out = str(tmp_path / "data")
    prepare(str(src), str(tgt), out, SETTINGS, verbose=0)
    with open(src, "a", encoding="utf-8") as f:
        f.write("one more\n")
    with open(tgt, "a", encoding="utf-8") as f:
        f.write("noch einer\n")
    with pytest.raises(DataError, match="src_train"):
        prepare(str(src), str(tgt), out, SETTINGS, verbose=0)
    with pytest.raises(DataError, match="changed since"):
        PreparedData(out, check_inputs=True)


def test_a_truncated_or_corrupt_shard_is_named(prepared, tmp_path):
    out = str(tmp_path / "data")
    shutil.copytree(prepared, out)
    target = os.path.join(out, "shard-00001", "target.npy")
    with open(target, "r+b") as f:
        f.truncate(os.path.getsize(target) - 10)
    with pytest.raises(DataError, match="shard-00001/target.npy has .* bytes but the manifest"):
        PreparedData(out)


def test_bad_input_is_refused_before_anything_is_written(text, tmp_path):
    short = tmp_path / "short.tgt"
    short.write_text("one\ntwo\n")
    out = tmp_path / "data"
    with pytest.raises(DataError, match="differ in length.*2 lines"):
        prepare(text[0], str(short), str(out), SETTINGS, verbose=0)
    assert not os.path.exists(out / "manifest.json") and not os.path.exists(out / "spm.model")
    latin = tmp_path / "latin.src"
    latin.write_bytes(b"Gr\xfc\xdfe\n" * 5)
    with pytest.raises(DataError, match="not valid UTF-8"):
        prepare(str(latin), str(latin), str(tmp_path / "other"), SETTINGS, verbose=0)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(DataError, match="not empty and holds no prepared dataset"):
        prepare(text[0], text[1], str(tmp_path / "full"), SETTINGS, verbose=0)


def test_the_prepared_dataset_runs_without_tf_data_autotuning(prepared):
    dataset = PreparedData(prepared).dataset(0, TOKENS_PER_BATCH)
    assert dataset.options().autotune.enabled is False
