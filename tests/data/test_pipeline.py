import gzip

import numpy as np
import pytest

from keras_transformer.data.pipeline import (
    BATCH_SHAPES,
    DataError,
    SubwordSampling,
    batch_pairs,
    bucket_boundaries,
    duplicate_rows,
    encode_pairs,
    make_dataset,
    read_lines,
    read_parallel,
)
from keras_transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_sentencepiece

WORDS = "a dog cat runs jumps over the red blue green field water ball man woman child".split()


def _sentences(count, seed, max_words=12):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(1, max_words + 1))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus():
    sources = _sentences(300, 0)
    targets = [s.upper() for s in sources]
    return sources, targets


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_sentencepiece(corpus[0] + corpus[1], vocabulary_size=320)


def _batches(dataset):
    return [(x["source_ids"].numpy(), x["target_ids"].numpy(), y.numpy()) for x, y in dataset]


def test_shapes_dtypes_and_the_bos_eos_shift(corpus, tokenizer):
    sources, targets = corpus
    dataset, stats = make_dataset(
        sources, targets, tokenizer, max_length=64, tokens_per_batch=256, shuffle=False
    )
    assert stats.kept_pairs == 300 and stats.empty_pairs == 0 and stats.too_long_pairs == 0
    expected = {
        tuple(tokenizer.encode(s) + [EOS_ID]): tokenizer.encode(t)
        for s, t in zip(sources, targets, strict=True)
    }
    seen = 0
    for src, dec, lab in _batches(dataset):
        assert src.dtype == dec.dtype == lab.dtype == np.int32
        assert src.ndim == 2 and dec.shape == lab.shape and src.shape[0] == dec.shape[0]
        assert src.size <= 256 and dec.size <= 256  # the token budget per side
        for s_row, d_row, l_row in zip(src, dec, lab, strict=True):
            source = s_row[s_row != PAD_ID].tolist()
            target = expected[tuple(source)]
            n = len(target) + 1
            assert d_row[:n].tolist() == [BOS_ID] + target  # decoder input = BOS + target
            assert l_row[:n].tolist() == target + [EOS_ID]  # labels = target + EOS
            assert not d_row[n:].any() and not l_row[n:].any()
            assert s_row[: len(source)].all()  # padding only at the end
            seen += 1
    assert seen == 300


def test_batches_are_bucketed_and_padded_to_bucket_lengths(corpus, tokenizer):
    dataset, stats = make_dataset(
        corpus[0], corpus[1], tokenizer, max_length=64, tokens_per_batch=512, seed=1
    )
    boundaries = bucket_boundaries(64)
    widths = set()
    batches = _batches(dataset)
    assert stats.batches == len(batches)  # counted before the first pass (the warm-up needs it)
    for src, dec, _ in batches:
        assert src.shape[1] == dec.shape[1] and src.shape[1] in boundaries
        widths.add(src.shape[1])
        # Bucketing keeps padding small: every row is longer than the bucket below.
        lower = max([b for b in boundaries if b < src.shape[1]], default=0)
        lengths = np.maximum((src != PAD_ID).sum(1), (dec != PAD_ID).sum(1))
        assert lengths.max() > lower and lengths.max() <= src.shape[1]
    assert len(widths) > 2


def test_few_shapes_give_one_shape_per_bucket_and_lose_no_pair(corpus, tokenizer):
    """`few`: every batch of a bucket has the bucket's full row count (the last one padded
    with empty rows), so the distinct shapes are at most the buckets, over every epoch."""
    few = BATCH_SHAPES["few"]
    fine_shapes = {
        s.shape for s, _, _ in _batches(batch_pairs(encode_pairs(*corpus, tokenizer, 64), 256)[0])
    }
    encoded = encode_pairs(*corpus, tokenizer, 64, shapes=few)
    dataset, stats = batch_pairs(encoded, 256, seed=3)
    boundaries = few.boundaries(64)
    rows = dict(zip(boundaries, few.rows(boundaries, 256), strict=True))
    shapes, pairs = set(), 0
    for _ in range(2):  # two epochs: no new shape in the second
        batches = _batches(dataset)
        assert len(batches) == stats.batches == encoded.batches(256)
        for src, dec, lab in batches:
            assert src.shape == dec.shape == lab.shape == (rows[src.shape[1]], src.shape[1])
            shapes.add(src.shape)
            real = (lab != PAD_ID).any(axis=1)
            assert not src[~real].any() and not dec[~real].any()  # empty rows are all padding
            pairs += int(real.sum())
    assert pairs == 2 * stats.kept_pairs == 600
    assert set(stats.batch_shapes) == shapes  # known before a batch is made
    assert len(shapes) <= few.bound(64) == len(boundaries)
    assert len(shapes) < len(fine_shapes)  # the point of it
    assert fine_shapes and BATCH_SHAPES["fine"].bound(64) is None
    assert batch_pairs(encode_pairs(*corpus, tokenizer, 64), 256)[1].batch_shapes == ()


def test_evaluated_batches_take_fewer_shapes_under_few_and_the_same_under_fine():
    """Validation and decoding batches of `few`: buckets twice as long as the one below
    (fewer compiled programs), rows still fixed; `fine` is left as it is."""
    few = BATCH_SHAPES["few"]
    assert few.evaluated().boundaries(128) == [8, 16, 32, 64, 128]
    assert few.evaluated().fixed_rows
    assert few.evaluated().bound(128) < few.bound(128)
    assert BATCH_SHAPES["fine"].evaluated() == BATCH_SHAPES["fine"]


def test_one_encoding_counts_and_batches_every_batch_size(corpus, tokenizer):
    encoded = encode_pairs(corpus[0], corpus[1], tokenizer, max_length=64)
    counts = {}
    for tokens in (128, 256, 1024):
        dataset, stats = batch_pairs(encoded, tokens, shuffle=False)
        batches = _batches(dataset)
        counts[tokens] = encoded.batches(tokens)
        assert stats.batches == counts[tokens] == len(batches)
        assert sum(s.shape[0] for s, _, _ in batches) == stats.kept_pairs == 300
        # The same batches as encoding again for this size alone.
        again, _ = make_dataset(
            corpus[0], corpus[1], tokenizer, max_length=64, tokens_per_batch=tokens, shuffle=False
        )
        for (a, b, c), (x, y, z) in zip(batches, _batches(again), strict=True):
            assert (a == x).all() and (b == y).all() and (c == z).all()
    assert counts[128] > counts[256] > counts[1024]
    assert encoded.stats.batches == 0  # the encoding itself has no batch size


def test_shuffling_changes_the_order_between_epochs_but_keeps_every_pair(corpus, tokenizer):
    dataset, _ = make_dataset(
        corpus[0], corpus[1], tokenizer, max_length=64, tokens_per_batch=256, seed=3
    )

    def epoch():
        return [tuple(r[r != 0]) for s, _, _ in _batches(dataset) for r in s]

    first, second = epoch(), epoch()
    assert first != second and sorted(first) == sorted(second) and len(first) == 300


def _pairs_seen(dataset, tokenizer):
    """(source text, target text, source pieces, target pieces) of every row of one pass."""
    rows = []
    for src, dec, lab in _batches(dataset):
        for s_row, d_row, l_row in zip(src, dec, lab, strict=True):
            source = s_row[s_row != PAD_ID].tolist()
            target = l_row[l_row != PAD_ID].tolist()
            assert source[-1] == EOS_ID and target[-1] == EOS_ID
            assert d_row[d_row != PAD_ID].tolist() == [BOS_ID] + target[:-1]
            source, target = source[:-1], target[:-1]
            rows.append((tokenizer.decode(source), tokenizer.decode(target), source, target))
    return rows


def test_subword_sampling_resegments_every_epoch_with_the_same_batches(corpus, tokenizer):
    encoded = encode_pairs(corpus[0], corpus[1], tokenizer, max_length=64)
    dataset, stats = batch_pairs(
        encoded, 256, seed=2, sampling=SubwordSampling(0.1, -1), tokenizer=tokenizer
    )
    pairs = list(zip(corpus[0], corpus[1], strict=True))
    epochs = []
    for _ in range(2):
        rows = _pairs_seen(dataset, tokenizer)
        assert len(rows) == 300 and sum(1 for _ in dataset) == stats.batches
        # Every sampled segmentation spells its sentence, so every pair is still there.
        assert sorted((s, t) for s, t, _, _ in rows) == sorted(pairs)
        best = [(p, q) == (tokenizer.encode(s), tokenizer.encode(t)) for s, t, p, q in rows]
        assert sum(best) < 150  # most sentences are segmented otherwise than the best
        epochs.append({(s, t): (p, q) for s, t, p, q in rows})
    # A new sample every epoch, not one drawn once.
    assert sum(epochs[0][k] != epochs[1][k] for k in epochs[0]) > 150
    # Without sampling, every row is the best segmentation.
    plain, _ = batch_pairs(encoded, 256, seed=2)
    for s, t, p, q in _pairs_seen(plain, tokenizer):
        assert (p, q) == (tokenizer.encode(s), tokenizer.encode(t))


def test_subword_samples_longer_than_max_length_fall_back_to_the_best(corpus, tokenizer):
    longest = max(
        len(tokenizer.encode(text)) for pair in zip(*corpus, strict=True) for text in pair
    )
    encoded = encode_pairs(corpus[0], corpus[1], tokenizer, max_length=longest + 1)
    assert encoded.stats.kept_pairs == 300
    dataset, stats = batch_pairs(
        encoded, 4 * (longest + 1), sampling=SubwordSampling(0.1, -1), tokenizer=tokenizer
    )
    rows = _pairs_seen(dataset, tokenizer)
    assert len(rows) == 300
    assert all(len(p) <= longest and len(q) <= longest for _, _, p, q in rows)
    # The longest sentences have no room to sample a longer segmentation.
    at_limit = [
        (pieces, tokenizer.encode(text))
        for s, t, p, q in rows
        for text, pieces in ((s, p), (t, q))
        if len(tokenizer.encode(text)) == longest
    ]
    assert at_limit and all(pieces == best for pieces, best in at_limit)


@pytest.mark.parametrize(
    "alpha, nbest, message",
    [(0, 64, "alpha must be positive"), (-0.5, 64, "alpha"), (0.1, 1, "nbest"), (0.1, 0, "nbest")],
)
def test_bad_subword_sampling_settings_are_refused(alpha, nbest, message):
    with pytest.raises(ValueError, match=message):
        SubwordSampling(alpha, nbest)


def test_subword_sampling_needs_the_tokenizer(corpus, tokenizer):
    encoded = encode_pairs(corpus[0], corpus[1], tokenizer, max_length=64)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        batch_pairs(encoded, 256, sampling=SubwordSampling(0.1))


def test_empty_and_over_length_pairs_are_counted(corpus, tokenizer):
    sources = list(corpus[0][:50]) + ["", "a dog", "   ", " ".join(["water"] * 80)]
    targets = list(corpus[1][:50]) + ["A CAT", "", "X", "WATER"]
    dataset, stats = make_dataset(sources, targets, tokenizer, max_length=40, tokens_per_batch=200)
    assert stats.total_pairs == 54
    assert stats.empty_pairs == 3
    assert stats.too_long_pairs == 1
    assert stats.kept_pairs == 50 == sum(s.shape[0] for s, _, _ in _batches(dataset))
    assert "3 skipped as empty" in stats.describe() and "1 dropped as longer" in stats.describe()


def test_nothing_left_is_an_error(tokenizer):
    with pytest.raises(DataError, match="Nothing is left"):
        make_dataset(["", " "], ["a", ""], tokenizer, max_length=16, tokens_per_batch=64)


def test_token_budget_must_hold_the_longest_sentence(corpus, tokenizer):
    with pytest.raises(ValueError, match="tokens_per_batch"):
        make_dataset(corpus[0], corpus[1], tokenizer, max_length=64, tokens_per_batch=32)


def test_read_plain_and_gzipped_files(tmp_path):
    lines = ["Ein Hund läuft.", "", "Zwei Kinder\tspielen."]
    plain = tmp_path / "a.de"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    zipped = tmp_path / "a.de.gz"
    with gzip.open(zipped, "wt", encoding="utf-8") as f:
        f.write("\r\n".join(lines) + "\r\n")
    assert read_lines(str(plain)) == lines
    assert read_lines(str(zipped)) == lines


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    src, tgt = tmp_path / "train.de", tmp_path / "train.en"
    src.write_text("a\nb\nc\n", encoding="utf-8")
    tgt.write_text("a\nb\n", encoding="utf-8")
    with pytest.raises(DataError) as error:
        read_parallel(str(src), str(tgt))
    message = str(error.value)
    assert str(src) in message and str(tgt) in message
    assert "3 lines" in message and "2 lines" in message


def test_missing_and_undecodable_files(tmp_path):
    with pytest.raises(DataError, match="not found.*nope.txt"):
        read_lines(str(tmp_path / "nope.txt"))
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("Müller\nZwei Hunde\nGrüße\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt as UTF-8 text: 2 of 3 lines \(line 1, 3\)"):
        read_lines(str(binary))
    broken = tmp_path / "broken.de.gz"
    broken.write_bytes(gzip.compress(b"Ein Hund.\n")[:-6])  # cut short
    with pytest.raises(DataError, match="Cannot read .*broken.de.gz"):
        read_lines(str(broken))
    corrupt = bytearray(gzip.compress("Ein Hund läuft.\n".encode() * 200))
    corrupt[20:40] = bytes(b ^ 0xFF for b in corrupt[20:40])  # zlib's "invalid ..." errors
    broken.write_bytes(bytes(corrupt))
    with pytest.raises(DataError, match="Cannot read .*broken.de.gz"):
        read_lines(str(broken))


def test_one_undecodable_line_keeps_its_place_and_is_named(tmp_path):
    """One bad line in a UTF-8 file costs neither the file nor the line's place:
    line N still pairs with line N of the other side."""
    lines = [f"Ein Hund läuft {i}." for i in range(300)]
    data = bytearray("\n".join(lines).encode() + b"\n")
    start = data.index(b"Hund l\xc3\xa4uft 41.")
    data[start + 6 : start + 8] = "ä".encode("latin-1") + b"!"  # line 42: a latin-1 byte
    path = tmp_path / "train.de"
    path.write_bytes(bytes(data))
    warnings = []
    read = read_lines(str(path), warn=warnings.append)
    assert len(read) == 300 and read[:41] == lines[:41] and read[42:] == lines[42:]
    assert read[41] == "Ein Hund l\ufffd!uft 41."
    assert warnings == [
        f"{path}: 1 of 300 lines (line 42) not valid UTF-8; their undecodable bytes read as U+FFFD."
    ]
    assert read_lines(str(tmp_path / "train.de"), warn=lambda message: None) == read


def test_bucket_boundaries_cover_max_length():
    boundaries = bucket_boundaries(128)
    assert boundaries[0] == 8 and boundaries[-1] == 128
    assert all(a < b for a, b in zip(boundaries, boundaries[1:], strict=False))


def test_duplicate_rows_repeats_each_sentence_in_adjacent_rows(corpus, tokenizer):
    dataset, stats = batch_pairs(
        encode_pairs(*corpus, tokenizer, 48), tokens_per_batch=256, shuffle=False
    )
    plain, doubled = _batches(dataset), _batches(duplicate_rows(dataset))
    assert len(doubled) == len(plain) == stats.batches
    assert int(duplicate_rows(dataset).cardinality()) == stats.batches
    for once, twice in zip(plain, doubled, strict=True):
        for a, b in zip(once, twice, strict=True):
            assert b.shape == (2 * a.shape[0], a.shape[1])
            np.testing.assert_array_equal(b[0::2], a)
            np.testing.assert_array_equal(b[1::2], a)


def test_training_datasets_run_without_tf_data_autotuning(corpus, tokenizer):
    """Its thread sleeps up to a minute between optimizations, and an iterator's
    destructor waits out that sleep (docs/distributed.md)."""
    dataset, _ = batch_pairs(encode_pairs(*corpus, tokenizer, 64), 256)
    assert dataset.options().autotune.enabled is False
    assert duplicate_rows(dataset).options().autotune.enabled is False
