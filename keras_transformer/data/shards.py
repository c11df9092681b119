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
    DataError,
    PipelineStats,
    _batch_sizes,
    bucket_boundaries,
    check_batch_fits,
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
    """

    def __init__(self, directory: str, check_inputs: bool = False):
        self.directory = directory
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
        from keras_transformer.data.tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer.load(os.path.join(self.directory, SPM_MODEL))

    def valid_files(self) -> tuple[str, str] | None:
        """The validation files copied in by prepare, or None."""
        if not self.manifest.get("valid"):
            return None
        return os.path.join(self.directory, "valid.src"), os.path.join(self.directory, "valid.tgt")

    def own_shards(self, shard_index: int = 0, shard_count: int = 1) -> list[int]:
        """The shards that reader `shard_index` of `shard_count` reads: every shard_count-th."""
        if not 0 <= shard_index < shard_count:
            raise ValueError(
                f"shard_index must be in [0, shard_count). Received: shard_index={shard_index}, "
                f"shard_count={shard_count}"
            )
        if shard_count > len(self.manifest["shards"]):
            raise DataError(
                f"{self.directory} has {len(self.manifest['shards'])} shards, fewer than the "
                f"{shard_count} readers: prepare it with a smaller --pairs-per-shard."
            )
        return list(range(shard_index, len(self.manifest["shards"]), shard_count))

    def stats(self, shards=None) -> PipelineStats:
        """The `PipelineStats` of `shards` (default: all); `batches` left 0."""
        records = self._records(shards)
        keys = (
            "total_pairs",
            "empty_pairs",
            "too_long_pairs",
            "kept_pairs",
            "source_tokens",
            "target_tokens",
        )
        return PipelineStats(**{k: sum(r[k] for r in records) for k in keys})

    def _records(self, shards=None):
        records = self.manifest["shards"]
        return records if shards is None else [records[i] for i in shards]

    def batches_per_epoch(self, tokens_per_batch: int, shards=None) -> int:
        """The batches of one epoch over `shards` at `tokens_per_batch` padded tokens a side."""
        boundaries = bucket_boundaries(self.max_length)
        histogram = np.sum([r["length_histogram"] for r in self._records(shards)], axis=0)
        keys = np.arange(len(histogram))
        buckets = np.searchsorted(boundaries, keys)
        counts = np.bincount(buckets, weights=histogram, minlength=len(boundaries))
        sizes = _batch_sizes(boundaries, tokens_per_batch)
        return int(sum(-(-int(n) // size) for n, size in zip(counts, sizes, strict=True)))

    def _lengths(self, shard: int) -> np.ndarray:
        name = self.manifest["shards"][shard]["name"]
        return _load(os.path.join(self.directory, name, "lengths.npy"))

    def epoch_plan(self, epoch, seed, tokens_per_batch, shards=None, interleave=DEFAULT_INTERLEAVE):
        """Yields the batches of one epoch as `(bucket, refs)`: `refs` an int64 array of
        `shard * 2**32 + row`. Reads only the shards' lengths, never their ids."""
        check_batch_fits(tokens_per_batch, self.max_length)
        shards = list(range(len(self.manifest["shards"]))) if shards is None else list(shards)
        boundaries = bucket_boundaries(self.max_length)
        sizes = _batch_sizes(boundaries, tokens_per_batch)
        rng = np.random.default_rng([seed % 2**32, epoch])
        order = [shards[i] for i in rng.permutation(len(shards))]
        waiting = [np.zeros(0, np.int64) for _ in boundaries]  # refs in unfilled buckets
        for start in range(0, len(order), interleave):
            window = order[start : start + interleave]
            refs, keys = [], []
            for shard in window:
                lengths = self._lengths(shard)
                refs.append((shard << 32) + np.arange(len(lengths), dtype=np.int64))
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

    def batches(
        self,
        seed: int,
        tokens_per_batch: int,
        start_epoch: int = 0,
        start_batch: int = 0,
        shards=None,
        interleave: int = DEFAULT_INTERLEAVE,
        repeat_shapes: bool = True,
    ):
        """Yields `(source, decoder_input, labels)` int32 batches, epoch after epoch, endlessly.

        Starts at batch `start_batch` of epoch `start_epoch` (0-based): the
        batches before it are planned but never read. Source = pieces + EOS,
        decoder input = BOS + target pieces, labels = target pieces + EOS;
        with `repeat_shapes` every batch is padded to its bucket's length.
        """
        boundaries = bucket_boundaries(self.max_length)
        open_shards = collections.OrderedDict()
        epoch, skip = start_epoch, start_batch
        while True:
            for bucket, refs in self.epoch_plan(epoch, seed, tokens_per_batch, shards, interleave):
                if skip:
                    skip -= 1
                    continue
                yield self._materialize(refs, boundaries[bucket], repeat_shapes, open_shards)
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

    def _materialize(self, refs, width, repeat_shapes, open_shards):
        pairs = [self._shard(int(r >> 32), open_shards).pair(int(r & 0xFFFFFFFF)) for r in refs]
        if not repeat_shapes:
            width = max(max(len(s), len(t)) for s, t in pairs) + 1
        source = np.full((len(pairs), width), PAD_ID, np.int32)
        decoder = np.full((len(pairs), width), PAD_ID, np.int32)
        labels = np.full((len(pairs), width), PAD_ID, np.int32)
        decoder[:, 0] = BOS_ID
        for i, (s, t) in enumerate(pairs):
            source[i, : len(s)] = s
            source[i, len(s)] = EOS_ID
            decoder[i, 1 : len(t) + 1] = t
            labels[i, : len(t)] = t
            labels[i, len(t)] = EOS_ID
        return source, decoder, labels

    def dataset(self, seed, tokens_per_batch, start_epoch=0, start_batch=0, shards=None):
        """`batches` as an endless `tf.data.Dataset` of `({"source_ids", "target_ids"}, labels)`."""
        import tensorflow as tf

        def generate():
            yield from self.batches(seed, tokens_per_batch, start_epoch, start_batch, shards)

        spec = tf.TensorSpec((None, None), tf.int32)
        dataset = tf.data.Dataset.from_generator(generate, output_signature=(spec, spec, spec))
        dataset = dataset.map(lambda s, d, lab: ({"source_ids": s, "target_ids": d}, lab))
        return dataset.prefetch(4)
