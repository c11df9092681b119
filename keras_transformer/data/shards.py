"""Reading a prepared dataset (`keras_transformer.data.prepare`) as a stream of batches.

`PreparedData` opens the manifest and checks every shard's files; its
`batches` stream is the training input of `train --data`, and
`dataset` wraps it in tf.data for `model.fit`.

The order of an epoch is a function of `(seed, epoch)` alone: the shards are
permuted, taken `interleave` at a time (a window), and the window's pairs
permuted; each pair joins the length bucket of `bucket_boundaries`, and a
bucket gives a batch of `tokens_per_batch // bucket_length` pairs when full.
The batches a window completes are emitted in a permuted order; the pairs a
window leaves in unfilled buckets wait for the next window, and the epoch
ends with the partial buckets. So an epoch has exactly the batches that the
in-memory pipeline counts (`EncodedPairs.batches`), every pair once, and a
stream can start at any `(epoch, batch)` without reading the ids of the
batches before it: resuming neither replays nor skips a batch.

Several readers (the processes of a data-parallel run) split the pairs into
contiguous runs (`part_pieces`): each reads only its own ~1/N of the shards,
with its own windows. A shared `schedule` of length buckets (from the
manifest's length histograms, the same on every reader) makes every
reader's batch of a step the same shape; a reader short of batches of a
bucket answers with empty rows. Its look-ahead holds only pair references.

Memory is bounded by one window: the pairs' lengths and positions of
`interleave` shards, and memory maps of the few shards whose pairs are in the
current batches (closed when the window moves on), whatever the corpus size.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID

from keras_transformer.data.pipeline import (
    BATCH_SHAPES,
    BatchShapes,
    DataError,
    PipelineStats,
    check_batch_fits,
    without_autotuning,
)
from keras_transformer.data.prepare import FORMAT_VERSION, MANIFEST, SHARD_FILES, SPM_MODEL

# Shards whose pairs one window shuffles together.
DEFAULT_INTERLEAVE = 4
# Shard memory maps kept open at once (a window's, and the ones that the
# pairs carried over from earlier windows still need).
OPEN_SHARDS = 8


class _Shard:
    """One shard's ids as memory maps, and its pairs' offsets."""

    def __init__(self, directory: str):
        self.directory = directory
        lengths = _load(os.path.join(directory, "lengths.npy"))
        self.source = _load(os.path.join(directory, "source.npy"), mmap_mode="r")
        self.target = _load(os.path.join(directory, "target.npy"), mmap_mode="r")
        self.source_offsets = np.concatenate([[0], np.cumsum(lengths[:, 0], dtype=np.int64)])
        self.target_offsets = np.concatenate([[0], np.cumsum(lengths[:, 1], dtype=np.int64)])
        for name, ids, offsets in (
            ("source.npy", self.source, self.source_offsets),
            ("target.npy", self.target, self.target_offsets),
        ):
            if len(ids) != offsets[-1]:
                raise DataError(
                    f"{os.path.join(directory, name)} holds {len(ids)} ids but lengths.npy "
                    f"counts {offsets[-1]}: the shard is corrupt. Prepare the dataset again."
                )

    def pair(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        s = self.source[self.source_offsets[row] : self.source_offsets[row + 1]]
        t = self.target[self.target_offsets[row] : self.target_offsets[row + 1]]
        return s, t


def _load(path, mmap_mode=None):
    try:
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise DataError(
            f"Cannot read {path}: {error}. The shard is corrupt; prepare the dataset again."
        ) from error


class PreparedData:
    """A prepared directory: its manifest, SentencePiece model and shards.

    Opening checks the manifest's format and that every shard file exists
    with the size the manifest recorded; a missing, truncated or grown file
    raises a `DataError` naming it. With `check_inputs`, the text files it
    was prepared from must still match their fingerprint.

    Args:
        directory: str. The `--out` of `keras-transformer prepare`.
        check_inputs: bool. Check the text files' fingerprints too.
        shapes: `BatchShapes`. The length buckets and row counts of the batches.
    """

    def __init__(
        self, directory: str, check_inputs: bool = False, shapes: BatchShapes = BATCH_SHAPES["fine"]
    ):
        self.directory = directory
        self.shapes = shapes
        self._steps = {}  # (tokens_per_batch, readers) -> global steps per bucket
        path = os.path.join(directory, MANIFEST)
        if not os.path.isfile(path):
            pending = os.path.isfile(os.path.join(directory, "prepare.json"))
            raise DataError(
                f"{directory} is not a prepared dataset (no {MANIFEST})"
                + (": its prepare run did not finish; rerun it to resume." if pending else ".")
                + " Run keras-transformer prepare first."
            )
        with open(path, encoding="utf-8") as f:
            self.manifest = json.load(f)
        version = self.manifest.get("identity", {}).get("format_version")
        if version != FORMAT_VERSION:
            raise DataError(
                f"{path} has format_version {version}; this version reads {FORMAT_VERSION}. "
                "Prepare the dataset again."
            )
        for shard in self.manifest["shards"]:
            for name in SHARD_FILES:
                file = os.path.join(directory, shard["name"], name)
                if not os.path.isfile(file):
                    raise DataError(f"{file} is missing. Prepare the dataset again.")
                size, recorded = os.path.getsize(file), shard["bytes"][name]
                if size != recorded:
                    raise DataError(
                        f"{file} has {size} bytes but the manifest recorded {recorded}: it is "
                        "truncated or was changed. Prepare the dataset again."
                    )
        if check_inputs:
            self.check_inputs()

    def check_inputs(self) -> None:
        """Refuses the directory when a text file it was prepared from changed since."""
        from keras_transformer.data.prepare import fingerprint

        for name, recorded in self.manifest["inputs"].items():
            path = recorded["path"]
            if not os.path.isfile(path):
                continue  # moved away: the prepared shards stand on their own
            now = fingerprint(path)
            if now != recorded:
                raise DataError(
                    f"{path} ({name}) changed since {self.directory} was prepared: fingerprint "
                    f"{recorded} then, {now} now. Prepare it again into a new directory."
                )

    @property
    def max_length(self) -> int:
        return self.manifest["max_length"]

    @property
    def vocabulary_size(self) -> int:
        return self.manifest["vocabulary_size"]

    @property
    def shard_names(self) -> list[str]:
        return [s["name"] for s in self.manifest["shards"]]

    def tokenizer(self):
        """The tokenizer the shards were encoded with: SentencePiece's, or Marian's
        (`prepare --tokenizer-from`)."""
        if os.path.isfile(os.path.join(self.directory, "vocab.json")):
            from keras_transformer.data.marian_tokenizer import MarianTokenizer

            return MarianTokenizer.load(self.directory)
        from keras_transformer.data.tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer.load(os.path.join(self.directory, SPM_MODEL))

    def valid_files(self) -> tuple[str, str] | None:
        """The validation files copied in by prepare, or None."""
        if not self.manifest.get("valid"):
            return None
        return os.path.join(self.directory, "valid.src"), os.path.join(self.directory, "valid.tgt")

    def part_pieces(self, part=(0, 1)) -> list[tuple[int, int, int]]:
        """`(shard, first_row, end_row)` runs that reader `index` of `count` reads (`part`).

        The dataset's pairs, in shard order, cut into `count` contiguous runs
        of equal size (to one pair): a reader's run is whole shards but for
        at most one at each end, so it opens only its own ~1/count of the
        shards, and the readers together read every pair once.
        """
        index, count = part
        if not 0 <= index < count:
            raise ValueError(
                f"A reader's index must be in [0, count). Received: index={index}, count={count}"
            )
        kept = [int(record["kept_pairs"]) for record in self.manifest["shards"]]
        total = sum(kept)
        if count > total:
            raise DataError(f"{self.directory} holds {total} pairs, fewer than {count} readers.")
        low, high = index * total // count, (index + 1) * total // count
        pieces, start = [], 0
        for shard, pairs in enumerate(kept):
            first, end = max(low, start), min(high, start + pairs)
            if first < end:
                pieces.append((shard, first - start, end - start))
            start += pairs
        return pieces

    def _bucket_pairs(self, pieces, boundaries) -> np.ndarray:
        """Pairs per length bucket in `pieces`: from the manifest's histograms for whole
        shards, from `lengths.npy` for the cut ones."""
        counts = np.zeros(len(boundaries), np.int64)
        for shard, first, end in pieces:
            record = self.manifest["shards"][shard]
            if first == 0 and end == record["kept_pairs"]:
                histogram = np.asarray(record["length_histogram"], np.int64)
                buckets = np.searchsorted(boundaries, np.arange(len(histogram)))
                counts += np.bincount(buckets, weights=histogram, minlength=len(boundaries)).astype(
                    np.int64
                )
            else:
                keys = self._lengths(shard)[first:end].max(axis=1) + 1
                counts += np.bincount(
                    np.searchsorted(boundaries, keys), minlength=len(boundaries)
                ).astype(np.int64)
        return counts

    def bucket_steps(self, tokens_per_batch: int, count: int) -> np.ndarray:
        """Global steps per length bucket in an epoch read by `count` readers at
        `tokens_per_batch` tokens each: the most batches any reader has of that bucket."""
        key = (tokens_per_batch, count)
        if key not in self._steps:
            boundaries = self.shapes.boundaries(self.max_length)
            sizes = np.asarray(self.shapes.rows(boundaries, tokens_per_batch))
            batches = [
                -(-self._bucket_pairs(self.part_pieces((i, count)), boundaries) // sizes)
                for i in range(count)
            ]
            self._steps[key] = np.max(batches, axis=0)
        return self._steps[key]

    def batch_shapes(self, tokens_per_batch: int, count: int = 1, rows_multiple: int = 1) -> tuple:
        """The global `(rows, positions)` of the batches of an epoch that `count` readers
        read at `tokens_per_batch` tokens each (rows a multiple of `rows_multiple` per
        reader), where those are fixed (`fixed_rows`, or several readers): one per length
        bucket that has a step; `()` otherwise."""
        if count == 1 and not self.shapes.fixed_rows:
            return ()
        boundaries = self.shapes.boundaries(self.max_length)
        sizes = self.shapes.rows(boundaries, tokens_per_batch)
        steps = self.bucket_steps(tokens_per_batch, count)
        return tuple(
            (-(-sizes[b] // rows_multiple) * rows_multiple * count, boundaries[b])
            for b in np.flatnonzero(steps)
        )

    def steps_per_epoch(self, tokens_per_batch: int, count: int = 1) -> int:
        """Global steps of one epoch read by `count` readers (`batches_per_epoch` for one)."""
        return int(self.bucket_steps(tokens_per_batch, count).sum())

    def schedule(self, epoch: int, seed: int, tokens_per_batch: int, count: int) -> np.ndarray:
        """The length bucket of every global step of an epoch read by `count` readers:
        the same on every reader, so that their batches of one step have one shape."""
        steps = self.bucket_steps(tokens_per_batch, count)
        rng = np.random.default_rng([seed % 2**32, epoch, count])
        return rng.permutation(np.repeat(np.arange(len(steps)), steps))

    def stats(self) -> PipelineStats:
        """The dataset's `PipelineStats`; `batches` left 0."""
        records = self.manifest["shards"]
        keys = (
            "total_pairs",
            "empty_pairs",
            "too_long_pairs",
            "kept_pairs",
            "source_tokens",
            "target_tokens",
        )
        return PipelineStats(**{k: sum(r[k] for r in records) for k in keys})

    def batches_per_epoch(self, tokens_per_batch: int) -> int:
        """The batches of one epoch at `tokens_per_batch` padded tokens a side."""
        return self.steps_per_epoch(tokens_per_batch, 1)

    def _lengths(self, shard: int) -> np.ndarray:
        name = self.manifest["shards"][shard]["name"]
        return _load(os.path.join(self.directory, name, "lengths.npy"))

    def epoch_plan(self, epoch, seed, tokens_per_batch, part=(0, 1), interleave=DEFAULT_INTERLEAVE):
        """Yields the batches of one epoch of reader `part` (`(index, count)`, default: the one
        reader of everything) as `(bucket, refs)`: `refs` an int64 array of `shard * 2**32 +
        row`. Reads only the lengths of the reader's shards, never their ids."""
        check_batch_fits(tokens_per_batch, self.max_length)
        pieces = self.part_pieces(part)
        boundaries = self.shapes.boundaries(self.max_length)
        sizes = self.shapes.rows(boundaries, tokens_per_batch)
        rng = np.random.default_rng([seed % 2**32, epoch])
        order = [pieces[i] for i in rng.permutation(len(pieces))]
        waiting = [np.zeros(0, np.int64) for _ in boundaries]  # refs in unfilled buckets
        for start in range(0, len(order), interleave):
            window = order[start : start + interleave]
            refs, keys = [], []
            for shard, first, end in window:
                lengths = self._lengths(shard)[first:end]
                refs.append((shard << 32) + np.arange(first, end, dtype=np.int64))
                keys.append(lengths.max(axis=1) + 1 if len(lengths) else np.zeros(0, np.int32))
            refs, keys = np.concatenate(refs), np.concatenate(keys)
            permutation = rng.permutation(len(refs))
            refs, keys = refs[permutation], keys[permutation]
            buckets = np.searchsorted(boundaries, keys)
            ready = []  # (position of the pair that completed it, bucket, refs)
            for b, size in enumerate(sizes):
                positions = np.flatnonzero(buckets == b)
                members = np.concatenate([waiting[b], refs[positions]])
                full = len(members) // size
                for k in range(full):
                    last = (k + 1) * size - len(waiting[b]) - 1
                    ready.append((positions[last], b, members[k * size : (k + 1) * size]))
                waiting[b] = members[full * size :]
            ready.sort(key=lambda x: x[0])
            for i in rng.permutation(len(ready)):
                yield ready[i][1], ready[i][2]
        rest = [(b, refs) for b, refs in enumerate(waiting) if len(refs)]
        for i in rng.permutation(len(rest)):
            yield rest[i]

    def reader_steps(self, epoch, seed, tokens_per_batch, part):
        """Yields reader `part`'s batch of every global step of an epoch as `(bucket, refs)`.

        Every reader takes the buckets in `schedule`'s order and answers each
        step with its next batch of that bucket from its own `epoch_plan`
        (looking ahead in its plan when needed), or with no pairs once it has
        none left of that bucket: those rows are all padding.
        """
        plan = self.epoch_plan(epoch, seed, tokens_per_batch, part)
        if part[1] == 1:
            yield from plan
            return
        waiting = collections.defaultdict(collections.deque)
        for bucket in self.schedule(epoch, seed, tokens_per_batch, part[1]):
            while not waiting[bucket]:
                found = next(plan, None)
                if found is None:
                    break
                waiting[found[0]].append(found[1])
            refs = waiting[bucket].popleft() if waiting[bucket] else np.zeros(0, np.int64)
            yield int(bucket), refs

    def batches(
        self,
        seed: int,
        tokens_per_batch: int,
        start_epoch: int = 0,
        start_batch: int = 0,
        part=(0, 1),
        rows_multiple: int = 1,
        repeat_shapes: bool = True,
    ):
        """Yields `(source, decoder_input, labels)` int32 batches, epoch after epoch, endlessly.

        Starts at batch `start_batch` of epoch `start_epoch` (0-based): the
        batches before it are planned but never read. Source = pieces + EOS,
        decoder input = BOS + target pieces, labels = target pieces + EOS;
        with `repeat_shapes` every batch is padded to its bucket's length.

        With `part` = `(index, count)` and count > 1 this is reader `index`'s
        share of the global steps (`reader_steps`): every reader's batch of
        one step has the same shape, its bucket's length and row count (a
        multiple of `rows_multiple`), padded with empty rows; so has every
        batch with `shapes.fixed_rows`.
        """
        boundaries = self.shapes.boundaries(self.max_length)
        sizes = self.shapes.rows(boundaries, tokens_per_batch)
        if part[1] > 1 and not repeat_shapes:
            raise ValueError("Several readers pad every batch to its bucket: repeat_shapes=True.")
        open_shards = collections.OrderedDict()
        epoch, skip = start_epoch, start_batch
        while True:
            for bucket, refs in self.reader_steps(epoch, seed, tokens_per_batch, part):
                if skip:
                    skip -= 1
                    continue
                rows = 0
                if part[1] > 1 or self.shapes.fixed_rows:
                    rows = -(-sizes[bucket] // rows_multiple) * rows_multiple
                yield self._materialize(refs, boundaries[bucket], repeat_shapes, open_shards, rows)
            epoch += 1

    def _shard(self, index, open_shards) -> _Shard:
        if index in open_shards:
            open_shards.move_to_end(index)
        else:
            name = self.manifest["shards"][index]["name"]
            open_shards[index] = _Shard(os.path.join(self.directory, name))
            while len(open_shards) > OPEN_SHARDS:
                open_shards.popitem(last=False)  # unmapped once its arrays are gone
        return open_shards[index]

    def _materialize(self, refs, width, repeat_shapes, open_shards, rows=0):
        pairs = [self._shard(int(r >> 32), open_shards).pair(int(r & 0xFFFFFFFF)) for r in refs]
        if not repeat_shapes:
            width = max(max(len(s), len(t)) for s, t in pairs) + 1
        rows = max(rows, len(pairs))
        source = np.full((rows, width), PAD_ID, np.int32)
        decoder = np.full((rows, width), PAD_ID, np.int32)
        labels = np.full((rows, width), PAD_ID, np.int32)
        decoder[: len(pairs), 0] = BOS_ID
        for i, (s, t) in enumerate(pairs):
            source[i, : len(s)] = s
            source[i, len(s)] = EOS_ID
            decoder[i, 1 : len(t) + 1] = t
            labels[i, : len(t)] = t
            labels[i, len(t)] = EOS_ID
        return source, decoder, labels

    def dataset(
        self, seed, tokens_per_batch, start_epoch=0, start_batch=0, part=(0, 1), rows_multiple=1
    ):
        """`batches` as an endless `tf.data.Dataset` of `({"source_ids", "target_ids"}, labels)`."""
        import tensorflow as tf

        def generate():
            yield from self.batches(
                seed, tokens_per_batch, start_epoch, start_batch, part, rows_multiple
            )

        spec = tf.TensorSpec((None, None), tf.int32)
        dataset = tf.data.Dataset.from_generator(generate, output_signature=(spec, spec, spec))
        dataset = dataset.map(lambda s, d, lab: ({"source_ids": s, "target_ids": d}, lab))
        return without_autotuning(dataset.prefetch(4))
