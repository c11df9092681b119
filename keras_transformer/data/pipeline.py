"""The tf.data input pipeline: parallel text -> SentencePiece ids -> token-budget batches.

Tokenization runs inside tf.data with `tensorflow_text.SentencepieceTokenizer`.
Pairs are bucketed by length and each bucket is batched to about
`tokens_per_batch` padded tokens (section 5.1 of the paper batches by ~25k
source and ~25k target tokens). Training batches can re-segment every sentence
each epoch by sampling (`SubwordSampling`).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
import zlib

import numpy as np
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID
from keras_transformer_runtime.text import decode_lines, describe_undecodable, warn

from keras_transformer.checks import check_positive_int


class DataError(ValueError):
    """Input text that cannot be used: missing files, unequal line counts."""


# A file with more undecodable lines than this share is in another encoding:
# refused whole. Fewer are single bad lines: replaced, warned about, kept.
MAX_UNDECODABLE_SHARE = 0.01


def read_lines(path: str, warn=warn) -> list[str]:
    """Lines of a UTF-8 text file, gzipped (`.gz`) or not, without their newlines.

    A line that is not valid UTF-8 keeps its place, with each undecodable byte
    replaced by U+FFFD, and `warn` names it: one bad line does not cost the
    file. A file with more than `MAX_UNDECODABLE_SHARE` of such lines is not
    UTF-8 at all and raises a `DataError`.
    """
    if not os.path.isfile(path):
        raise DataError(f"File not found: {path}")
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"Cannot read {path}: {error}") from error
    lines, undecodable = decode_lines(data)
    if undecodable:
        counted = describe_undecodable(undecodable, len(lines))
        if len(undecodable) > MAX_UNDECODABLE_SHARE * len(lines):
            raise DataError(
                f"Cannot read {path} as UTF-8 text: {counted} are not valid UTF-8. "
                "Convert it first, e.g. iconv -f latin1 -t utf-8."
            )
        warn(f"{path}: {counted} not valid UTF-8; their undecodable bytes read as U+FFFD.")
    return lines


def read_parallel(source_path: str, target_path: str) -> tuple[list[str], list[str]]:
    """Reads two parallel files; unequal line counts raise a `DataError` naming both."""
    sources, targets = read_lines(source_path), read_lines(target_path)
    if len(sources) != len(targets):
        raise DataError(
            f"Parallel files differ in length: {source_path} has {len(sources)} lines but "
            f"{target_path} has {len(targets)} lines. Line N of one must translate line N "
            "of the other."
        )
    return sources, targets


@dataclasses.dataclass
class PipelineStats:
    """What the pipeline kept and what it left out, and why."""

    total_pairs: int
    empty_pairs: int  # a side was empty or only whitespace
    too_long_pairs: int  # a side needed more than max_length positions
    kept_pairs: int
    source_tokens: int  # of kept pairs, EOS included
    target_tokens: int  # of kept pairs, EOS included
    batches: int = 0  # per pass over the kept pairs
    # `(rows, positions)` of the batches of a pass, where they are fixed (`fixed_rows`, no
    # subword sampling): one per length bucket that holds a pair.
    batch_shapes: tuple = ()

    def describe(self, name: str = "data") -> str:
        return (
            f"{name}: kept {self.kept_pairs} of {self.total_pairs} sentence pairs "
            f"({self.empty_pairs} skipped as empty, {self.too_long_pairs} dropped as longer "
            f"than max_length); {self.source_tokens} source and {self.target_tokens} "
            "target tokens"
        )


def bucket_boundaries(max_length: int, min_boundary: int = 8, step: float = 1.1) -> list[int]:
    """Geometric length buckets: 8, 9, 10, ..., 16, 18, 20, 22, 24, 26, 29, ... up to
    `max_length` (inclusive).

    Each bucket is at most 10% longer than the one below, so a batch is mostly
    real tokens: on the benchmark's length distribution (log-normal, median 24)
    91-92% of the padded positions are real tokens, against 85-86% with 25%
    steps. The price is more distinct batch shapes (38 up to 256 positions,
    against 17), which matters only to a train step compiled per shape (XLA).
    """
    boundaries, b = [], min_boundary
    while b < max_length:
        boundaries.append(b)
        b = max(b + 1, int(round(b * step)))
    boundaries.append(max_length)
    return boundaries


@dataclasses.dataclass(frozen=True)
class BatchShapes:
    """How the batches of a run are shaped: length buckets, and rows per bucket.

    `fine` (a 1.1 step between buckets, the last batch of a bucket as long as
    it is) pads least. `few` (a 1.25 step, every batch of a bucket padded
    with empty rows to the bucket's full row count) bounds the distinct
    shapes to one per bucket, for a train step compiled per shape (JAX, or
    XLA on TensorFlow). On Multi30k de-en at 1,024 tokens a batch: `fine`
    gives at most 42 shapes at 91.8% real tokens, `few` at most 9 at 84.9%
    (docs/distributed.md). Empty rows change neither the loss nor the
    gradients.
    """

    bucket_step: float = 1.1
    fixed_rows: bool = False

    def boundaries(self, max_length: int) -> list[int]:
        return bucket_boundaries(max_length, step=self.bucket_step)

    def rows(self, boundaries, tokens_per_batch) -> list[int]:
        return bucket_rows(boundaries, tokens_per_batch)

    def evaluated(self) -> BatchShapes:
        """The shapes of batches that are only evaluated (the validation loss): with
        fixed rows, buckets twice as long as the one below, so that a program compiled
        per shape compiles three or four times instead of nine or ten. Evaluation is a
        small share of a run, so its extra padding costs less than the compiles."""
        return dataclasses.replace(self, bucket_step=2.0) if self.fixed_rows else self

    def bound(self, max_length: int) -> int | None:
        """The most distinct batch shapes a dataset of these shapes yields (None: unbounded
        by rows, the last batch of each bucket)."""
        return len(self.boundaries(max_length)) if self.fixed_rows else None


BATCH_SHAPES = {"fine": BatchShapes(), "few": BatchShapes(bucket_step=1.25, fixed_rows=True)}


def _encode_all(tokenizer, sources, targets):
    """Ids of every pair, tokenized inside tf.data by tensorflow-text, as numpy lists."""
    import tensorflow as tf

    if not sources:
        return [], []
    source_tokenizer = tokenizer.tf_tokenizer(side="source")
    target_tokenizer = tokenizer.tf_tokenizer(side="target")
    dataset = (
        tf.data.Dataset.from_tensor_slices(
            (tf.constant(sources, tf.string), tf.constant(targets, tf.string))
        )
        .batch(1024)
        .map(
            lambda s, t: (source_tokenizer.tokenize(s), target_tokenizer.tokenize(t)),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
    )
    source_ids, target_ids = [], []
    for s, t in dataset:
        source_ids.extend(np.split(s.flat_values.numpy(), s.row_splits.numpy()[1:-1]))
        target_ids.extend(np.split(t.flat_values.numpy(), t.row_splits.numpy()[1:-1]))
    return source_ids, target_ids


def _count_batches(lengths, boundaries, batch_sizes) -> int:
    """Batches that length bucketing makes of sequences of `lengths` (one pass, partial ones too)."""
    counts = np.bincount(np.searchsorted(boundaries, lengths), minlength=len(boundaries))
    return int(sum(-(-int(n) // size) for n, size in zip(counts, batch_sizes, strict=True)))


@dataclasses.dataclass(frozen=True)
class SubwordSampling:
    """Subword regularization (Kudo, 2018, "Subword Regularization"): every
    epoch, each training sentence of both sides is segmented anew by sampling
    from the unigram SentencePiece model, instead of taking its one best
    segmentation, so that the model sees many segmentations of the same words.

    Args:
        alpha: float > 0. Smoothing of the sampling distribution: the
            probability of a segmentation is raised to `alpha`, so a smaller
            alpha samples less likely segmentations more often.
        nbest: int. Sample among the `nbest` best segmentations (at least 2),
            or among all of them with -1 (the paper's l = infinity).
    """

    alpha: float
    nbest: int = 64

    def __post_init__(self):
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(f"subword sampling alpha must be positive. Received: {self.alpha}")
        if (
            not isinstance(self.nbest, int)
            or isinstance(self.nbest, bool)
            or (self.nbest != -1 and self.nbest < 2)
        ):
            raise ValueError(
                "subword sampling nbest must be -1 (all segmentations) or at least 2 "
                f"(1 and 0 would not sample). Received: {self.nbest}"
            )


@dataclasses.dataclass
class EncodedPairs:
    """Sentence pairs as SentencePiece ids, the kept ones only, before batching.

    Encode once, then count batches (`batches`) or build datasets
    (`batch_pairs`) for as many batch sizes as needed.
    """

    source_ids: list  # of int arrays, pieces only (no EOS)
    target_ids: list
    max_length: int
    stats: PipelineStats  # `batches` is left 0: it depends on the batch size
    # The kept pairs' text, for batches that re-segment it (`SubwordSampling`).
    source_texts: list | None = None
    target_texts: list | None = None
    shapes: BatchShapes = BATCH_SHAPES["fine"]

    @functools.cached_property
    def _lengths(self) -> np.ndarray:
        """Each pair's bucket key, EOS or BOS included: computed once for every batch size."""
        return np.asarray(
            [max(len(s), len(t)) + 1 for s, t in zip(self.source_ids, self.target_ids, strict=True)]
        )

    def batches(self, tokens_per_batch: int) -> int:
        """Batches of one pass at `tokens_per_batch` padded tokens per side."""
        boundaries = self.shapes.boundaries(self.max_length)
        rows = self.shapes.rows(boundaries, tokens_per_batch)
        return _count_batches(self._lengths, boundaries, rows)

    def batch_shapes(self, tokens_per_batch: int) -> tuple:
        """The `(rows, positions)` of the batches of a pass under fixed rows: one per length
        bucket that holds a pair; `()` where the rows are not fixed."""
        if not self.shapes.fixed_rows:
            return ()
        boundaries = self.shapes.boundaries(self.max_length)
        rows = self.shapes.rows(boundaries, tokens_per_batch)
        present = np.unique(np.searchsorted(boundaries, self._lengths))
        return tuple((rows[b], boundaries[b]) for b in present)


def bucket_rows(boundaries, tokens_per_batch) -> list[int]:
    return [max(1, tokens_per_batch // b) for b in boundaries]


def encode_pairs(
    sources, targets, tokenizer, max_length: int, shapes: BatchShapes = BATCH_SHAPES["fine"]
) -> EncodedPairs:
    """Tokenizes parallel text and keeps the pairs that fit `max_length`.

    Pairs with an empty side are skipped and pairs longer than `max_length`
    positions (EOS or BOS included) are dropped; both are counted in `stats`.
    `shapes` are the shapes the pairs will be batched in. Raises `DataError`
    when nothing is left.
    """
    check_positive_int("max_length", max_length)
    if len(sources) != len(targets):
        raise DataError(f"{len(sources)} source sentences but {len(targets)} target sentences.")
    total = len(sources)
    nonempty = [i for i in range(total) if sources[i].strip() and targets[i].strip()]
    source_ids, target_ids = _encode_all(
        tokenizer, [sources[i] for i in nonempty], [targets[i] for i in nonempty]
    )
    keep = [
        k
        for k in range(len(nonempty))
        if len(source_ids[k]) + 1 <= max_length and len(target_ids[k]) + 1 <= max_length
    ]
    stats = PipelineStats(
        total_pairs=total,
        empty_pairs=total - len(nonempty),
        too_long_pairs=len(nonempty) - len(keep),
        kept_pairs=len(keep),
        source_tokens=int(sum(len(source_ids[k]) + 1 for k in keep)),
        target_tokens=int(sum(len(target_ids[k]) + 1 for k in keep)),
    )
    if not keep:
        raise DataError(
            stats.describe() + ". Nothing is left to train on: check the files and max_length."
        )
    return EncodedPairs(
        [source_ids[k] for k in keep],
        [target_ids[k] for k in keep],
        max_length,
        stats,
        source_texts=[sources[nonempty[k]] for k in keep],
        target_texts=[targets[nonempty[k]] for k in keep],
        shapes=shapes,
    )


def make_dataset(
    sources,
    targets,
    tokenizer,
    max_length: int,
    tokens_per_batch: int = 4096,
    shuffle: bool = True,
    seed: int = 0,
    repeat_shapes: bool = True,
):
    """Builds the `(inputs, labels)` dataset that `model.fit` takes.

    Args:
        sources, targets: lists of str, parallel.
        tokenizer: `SentencePieceTokenizer`.
        max_length: int. Longest sequence, in positions (EOS or BOS included);
            longer pairs are dropped and counted.
        tokens_per_batch: int. Padded tokens per batch on each side; each length
            bucket gets `tokens_per_batch // bucket_length` sentences per batch.
        shuffle: bool. Reshuffle the pairs every epoch (training data).
        seed: int. Shuffle seed.
        repeat_shapes: bool. Pad every batch to its bucket's length, so that a
            compiled train step sees few distinct shapes.

    Returns:
        `(dataset, stats)`: a `tf.data.Dataset` of
        `({"source_ids": (B, S) int32, "target_ids": (B, T) int32}, labels (B, T) int32)`,
        with source = pieces + EOS, decoder input = BOS + target pieces,
        labels = target pieces + EOS; and a `PipelineStats`.
    """
    check_positive_int("tokens_per_batch", tokens_per_batch)
    check_batch_fits(tokens_per_batch, max_length)
    encoded = encode_pairs(sources, targets, tokenizer, max_length)
    return batch_pairs(encoded, tokens_per_batch, shuffle, seed, repeat_shapes)


def check_batch_fits(tokens_per_batch, max_length):
    """Refuses a batch budget that cannot hold one sentence of `max_length` positions."""
    if tokens_per_batch < max_length:
        raise ValueError(
            f"tokens_per_batch ({tokens_per_batch}) must be at least max_length "
            f"({max_length}) so that the longest sentence fits in a batch."
        )


def batch_pairs(
    encoded: EncodedPairs,
    tokens_per_batch: int,
    shuffle: bool = True,
    seed: int = 0,
    repeat_shapes: bool = True,
    sampling: SubwordSampling | None = None,
    tokenizer=None,
):
    """The dataset of `make_dataset` from pairs encoded once by `encode_pairs`.

    With `sampling` (and the `tokenizer` that encoded the pairs), each pass
    segments every sentence anew by sampling. A pair still goes to the length
    bucket of its best segmentation, so an epoch has the same number of
    batches as without sampling (the schedule's epochs stay exact); a batch is
    padded to its longest sampled sentence, so it may hold somewhat more than
    `tokens_per_batch` padded tokens. A sample longer than `max_length`
    positions is replaced by the best segmentation. SentencePiece draws the
    samples from its own random generator, which `seed` does not reach.
    """
    import tensorflow as tf

    check_positive_int("tokens_per_batch", tokens_per_batch)
    check_batch_fits(tokens_per_batch, encoded.max_length)
    if sampling is not None and (tokenizer is None or encoded.source_texts is None):
        raise ValueError(
            "Subword sampling needs the tokenizer and the pairs' text (from encode_pairs)."
        )
    stats = dataclasses.replace(
        encoded.stats,
        batches=encoded.batches(tokens_per_batch),
        batch_shapes=encoded.batch_shapes(tokens_per_batch)
        if repeat_shapes and sampling is None
        else (),
    )
    shapes = encoded.shapes
    boundaries = shapes.boundaries(encoded.max_length)
    batch_sizes = shapes.rows(boundaries, tokens_per_batch)
    source_ids, target_ids = encoded.source_ids, encoded.target_ids

    def ragged(ids):
        lengths = [len(x) for x in ids]
        values = np.concatenate(ids).astype(np.int32)
        return tf.RaggedTensor.from_row_lengths(values, np.asarray(lengths, np.int64))

    columns = (ragged(source_ids), ragged(target_ids))
    if sampling is not None:
        columns += (
            tf.constant(encoded.source_texts, tf.string),
            tf.constant(encoded.target_texts, tf.string),
        )
    dataset = tf.data.Dataset.from_tensor_slices(columns)
    if shuffle:
        dataset = dataset.shuffle(len(source_ids), seed=seed, reshuffle_each_iteration=True)

    eos = tf.constant([EOS_ID], tf.int32)
    bos = tf.constant([BOS_ID], tf.int32)

    def with_specials(s, t):
        # The bucket key is the best segmentation's length, EOS or BOS included.
        key = tf.maximum(tf.shape(s)[0], tf.shape(t)[0]) + 1
        return tf.concat([s, eos], 0), tf.concat([bos, t], 0), tf.concat([t, eos], 0), key

    if sampling is None:
        dataset = dataset.map(with_specials, num_parallel_calls=tf.data.AUTOTUNE)
    else:
        samplers = [
            tokenizer.tf_tokenizer(nbest_size=sampling.nbest, alpha=sampling.alpha, side=side)
            for side in ("source", "target")
        ]
        fits = encoded.max_length - 1  # pieces that fit beside EOS or BOS

        def resampled(best, text, side):
            sample = samplers[side].tokenize(text)
            return tf.cond(tf.shape(sample)[0] <= fits, lambda: sample, lambda: best)

        def with_samples(s, t, s_text, t_text):
            key = tf.maximum(tf.shape(s)[0], tf.shape(t)[0]) + 1
            s, dec, lab, _ = with_specials(resampled(s, s_text, 0), resampled(t, t_text, 1))
            return s, dec, lab, key

        dataset = dataset.map(with_samples, num_parallel_calls=tf.data.AUTOTUNE)
    dataset = dataset.bucket_by_sequence_length(
        element_length_func=lambda s, d, lab, key: key,
        # bucket_by_sequence_length's boundaries are exclusive upper bounds.
        bucket_boundaries=[b + 1 for b in boundaries[:-1]],
        bucket_batch_sizes=batch_sizes,
        padded_shapes=([None], [None], [None], []),
        padding_values=(PAD_ID, PAD_ID, PAD_ID, 0),
        pad_to_bucket_boundary=False,
    )
    dataset = dataset.map(lambda s, d, lab, key: (s, d, lab))
    if repeat_shapes:
        lengths = tf.constant(boundaries, tf.int32)
        full_rows = tf.constant(batch_sizes, tf.int32)

        def pad_to_bucket(s, d, lab):
            longest = tf.maximum(tf.shape(s)[1], tf.shape(d)[1])
            bucket = tf.argmax(tf.cast(lengths >= longest, tf.int32))
            width = lengths[bucket]
            # With fixed rows, the last batch of a bucket gains empty rows (a
            # sampled segmentation may be longer than its bucket: then it keeps its rows).
            rows = tf.shape(s)[0]
            if shapes.fixed_rows:
                rows = tf.maximum(rows, full_rows[bucket])
            pad_s = [[0, rows - tf.shape(s)[0]], [0, width - tf.shape(s)[1]]]
            pad_d = [[0, rows - tf.shape(d)[0]], [0, width - tf.shape(d)[1]]]
            return tf.pad(s, pad_s), tf.pad(d, pad_d), tf.pad(lab, pad_d)

        dataset = dataset.map(pad_to_bucket, num_parallel_calls=tf.data.AUTOTUNE)
    if shuffle:
        # Buckets fill at different rates; shuffle whole batches so that an
        # epoch does not end with all the long sentences.
        dataset = dataset.shuffle(64, seed=seed + 1, reshuffle_each_iteration=True)
    dataset = dataset.map(
        lambda s, d, lab: ({"source_ids": s, "target_ids": d}, lab),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    # A known length: Keras then counts an epoch's steps exactly (with an
    # unknown one it advances the optimizer's step counter once more per epoch,
    # which shifts gradient accumulation) and shows a progress bar with a total.
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(stats.batches))
    return without_autotuning(dataset.prefetch(tf.data.AUTOTUNE)), stats


def without_autotuning(dataset):
    """`dataset` with tf.data's autotuning thread off. That thread sleeps between
    optimizations for up to a minute, and an iterator's destructor waits out its
    sleep: training runs sat idle for up to 60 s after their work (docs/distributed.md).
    Off, Multi30k tiny's 500 updates took 29 s under TensorFlow (32-35 s with it on)
    and 77 s under JAX (75-83 s), on a 2-core Zen 5."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def duplicate_rows(dataset):
    """Every batch of `dataset` with each sentence twice, in adjacent rows.

    For R-Drop (`LabelSmoothedCrossEntropy(consistency=...)`): the two copies
    go through the model with different dropout masks in one step, so a batch
    of `tokens_per_batch` tokens computes as one of twice that; the number of
    updates an epoch does not change.
    """
    import tensorflow as tf

    def twice(inputs, labels):
        inputs = {name: tf.repeat(ids, 2, axis=0) for name, ids in inputs.items()}
        return inputs, tf.repeat(labels, 2, axis=0)

    return dataset.map(twice, num_parallel_calls=tf.data.AUTOTUNE)
