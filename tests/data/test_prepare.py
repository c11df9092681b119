import itertools
import json
import os
import shutil

import numpy as np
import pytest

from keras_transformer.data.pipeline import DataError, encode_pairs, read_parallel
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


def test_readers_split_the_shards_and_together_read_every_pair(prepared):
    data = PreparedData(prepared)
    halves = [data.own_shards(i, 2) for i in range(2)]
    assert sorted(halves[0] + halves[1]) == list(range(len(data.shard_names)))
    assert data.stats(halves[0]).kept_pairs + data.stats(halves[1]).kept_pairs == (
        data.stats().kept_pairs
    )
    with pytest.raises(DataError, match="fewer than the 99 readers"):
        data.own_shards(0, 99)


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
