"""`keras-transformer prepare`: parallel text files -> SentencePiece ids in on-disk shards.

A corpus of any size is read as a stream, twice: the first pass checks the
files (parallel, UTF-8) and keeps a seeded reservoir sample of at most
`spm_pairs` pairs, on which the joint SentencePiece model is trained with the
settings of `train`; the second encodes the pairs in parallel processes and
writes them, with the length filter of `encode_pairs`, into shards of
`pairs_per_shard` input lines each.

The prepared directory:

- `spm.model`: the joint SentencePiece model.
- `shard-NNNNN/`: the kept pairs of input lines [N * pairs_per_shard,
  (N + 1) * pairs_per_shard): `source.npy` and `target.npy` (every pair's
  pieces, concatenated, uint16 when the vocabulary fits, else int32),
  `lengths.npy` ((pairs, 2) int32 pieces per side, EOS not included) and
  `stats.json` (the shard's `PipelineStats` counts and length histogram).
  Each is written into a temporary folder that is renamed when complete, so
  a killed run never leaves a half-written shard under a shard's name.
- `valid.src`, `valid.tgt`: the validation files' lines, as `train` reads them.
- `manifest.json`, written last: the format, the settings, a fingerprint of
  the inputs (size, modification time, SHA-256 of the first MiB), and every
  shard's counts and file sizes. Its presence means the directory is complete.

A rerun with the same inputs and settings on a complete directory does
nothing; on one whose run was killed, it keeps the finished shards (and the
SentencePiece model) and writes the rest. Other inputs or settings are
refused with what differs. See docs/data.md for the choice of format.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gzip
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
import zlib

import numpy as np
from keras_transformer_runtime.text import describe_undecodable, warn

from keras_transformer.checks import check_positive_int
from keras_transformer.data.pipeline import MAX_UNDECODABLE_SHARE, DataError, PipelineStats
from keras_transformer.data.tokenizer import (
    DEFAULT_VOCABULARY_SIZE,
    SentencePieceTokenizer,
    train_sentencepiece,
)
from keras_transformer.io_utils import atomic_write_json, atomic_write_text

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# The settings of an unfinished run, written first: a rerun must repeat them to resume.
PENDING = "prepare.json"
SPM_MODEL = "spm.model"
SHARD_FILES = ("source.npy", "target.npy", "lengths.npy", "stats.json")
DEFAULT_PAIRS_PER_SHARD = 100_000
# Pairs sampled for SentencePiece: two sentences each, train_sentencepiece's default.
DEFAULT_SPM_PAIRS = 1_000_000
# Lines a worker process encodes at a time.
CHUNK_LINES = 10_000
FINGERPRINT_HEAD_BYTES = 1 << 20


def _setting(default, help):
    return dataclasses.field(default=default, metadata={"group": "settings", "help": help})


@dataclasses.dataclass(frozen=True)
class PrepareSettings:
    """What defines a prepared directory; a rerun must repeat it to resume or reuse it.

    One field per option of `keras-transformer prepare`: the parser is
    generated from the fields, their defaults and help
    (`settings_parser.add_settings_arguments`).
    """

    vocab_size: int = _setting(
        DEFAULT_VOCABULARY_SIZE, "joint SentencePiece vocabulary size (default %(default)s)"
    )
    max_length: int = _setting(
        128,
        "drop pairs longer than this many positions, EOS or BOS included; at most the "
        "model's max_length (default %(default)s, the small preset's)",
    )
    seed: int = _setting(0, "seed of the reservoir sample and SentencePiece's training")
    spm_pairs: int = _setting(
        DEFAULT_SPM_PAIRS,
        "pairs sampled to train SentencePiece, two sentences each (default %(default)s)",
    )
    pairs_per_shard: int = _setting(
        DEFAULT_PAIRS_PER_SHARD, "input lines per shard (default %(default)s)"
    )
    tokenizer_from: str | None = _setting(
        None,
        "encode with this run's tokenizer (an imported Marian model, for train --init-from "
        "RUN --data) instead of training SentencePiece; its files are copied in",
    )

    def __post_init__(self):
        for name in ("vocab_size", "max_length", "spm_pairs", "pairs_per_shard"):
            check_positive_int(name, getattr(self, name))
        if self.tokenizer_from is not None:
            object.__setattr__(self, "tokenizer_from", os.path.abspath(self.tokenizer_from))


class LineReader:
    """The lines of a UTF-8 text file (gzipped or not) as a stream, as `read_lines` reads them.

    A line that is not valid UTF-8 keeps its place with its undecodable bytes
    read as U+FFFD; `check` (after the last line) raises a `DataError` when
    more than `MAX_UNDECODABLE_SHARE` of the lines were such, and otherwise
    warns with their numbers.
    """

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise DataError(f"File not found: {path}")
        self.path = path
        self.count = 0
        self.undecodable: list[int] = []

    def __iter__(self):
        opener = gzip.open if self.path.endswith(".gz") else open
        try:
            with opener(self.path, "rb") as f:
                for raw in f:
                    self.count += 1
                    raw = raw.rstrip(b"\n").rstrip(b"\r")
                    try:
                        yield raw.decode("utf-8")
                    except UnicodeDecodeError:
                        self.undecodable.append(self.count)
                        yield raw.decode("utf-8", errors="replace")
        except (OSError, EOFError, zlib.error) as error:
            raise DataError(f"Cannot read {self.path}: {error}") from error

    def check(self, warn=warn) -> None:
        if not self.undecodable:
            return
        counted = describe_undecodable(self.undecodable, self.count)
        if len(self.undecodable) > MAX_UNDECODABLE_SHARE * self.count:
            raise DataError(
                f"Cannot read {self.path} as UTF-8 text: {counted} are not valid UTF-8. "
                "Convert it first, e.g. iconv -f latin1 -t utf-8."
            )
        warn(f"{self.path}: {counted} not valid UTF-8; their undecodable bytes read as U+FFFD.")


def read_pairs(source_path: str, target_path: str):
    """Yields the pairs of two parallel files as a stream; unequal lengths raise a `DataError`.

    Undecodable lines are checked (and warned about) when the stream ends.
    """
    sources, targets = LineReader(source_path), LineReader(target_path)
    end = object()
    source_lines, target_lines = iter(sources), iter(targets)
    while True:
        s, t = next(source_lines, end), next(target_lines, end)
        if s is end or t is end:
            if s is not end or t is not end:
                for _ in source_lines if t is end else target_lines:
                    pass  # counted by the reader
                raise DataError(
                    f"Parallel files differ in length: {source_path} has {sources.count} "
                    f"lines but {target_path} has {targets.count} lines. Line N of one must "
                    "translate line N of the other."
                )
            break
        yield s, t
    sources.check()
    targets.check()


def fingerprint(path: str) -> dict:
    """Size, modification time and SHA-256 of the first MiB: enough to notice a changed file
    without reading a large one whole."""
    stat = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_HEAD_BYTES))
    return {
        "path": os.path.abspath(path),
        "bytes": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "head_sha256": digest.hexdigest(),
    }


def _inputs(src_train, tgt_train, src_valid, tgt_valid) -> dict:
    files = {"src_train": src_train, "tgt_train": tgt_train}
    if src_valid is not None or tgt_valid is not None:
        if src_valid is None or tgt_valid is None:
            raise DataError("Give both --src-valid and --tgt-valid, or neither.")
        files.update(src_valid=src_valid, tgt_valid=tgt_valid)
    for path in files.values():
        if not os.path.isfile(path):
            raise DataError(f"File not found: {path}")
    return {name: fingerprint(path) for name, path in files.items()}


def _identity(settings: PrepareSettings, inputs: dict) -> dict:
    # The path may move; the fingerprint says whether the content is the same.
    files = {name: {k: v for k, v in f.items() if k != "path"} for name, f in inputs.items()}
    return {"format_version": FORMAT_VERSION, **dataclasses.asdict(settings), **files}


def _differences(previous: dict, current: dict) -> str:
    changed = []
    for key in sorted(set(previous) | set(current)):
        if previous.get(key) != current.get(key):
            changed.append(f"{key}: {previous.get(key)!r} there, {current.get(key)!r} now")
    return "; ".join(changed)


def _read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _check_directory(out_dir: str, identity: dict) -> str:
    """'done', 'resume' or 'new' for `out_dir`; refuses another corpus's or settings' directory."""
    if not os.path.exists(out_dir):
        return "new"
    if not os.path.isdir(out_dir):
        raise DataError(f"{out_dir} exists and is not a directory.")
    for name, state in ((MANIFEST, "done"), (PENDING, "resume")):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            previous = _read_json(path)
            previous = previous.get("identity", previous)
            if previous != identity:
                what = "a prepared" if state == "done" else "an unfinished prepared"
                raise DataError(
                    f"{out_dir} holds {what} dataset of other inputs or settings "
                    f"({_differences(previous, identity)}). Use a new --out directory, or "
                    "repeat the original inputs and settings."
                )
            return state
    if os.listdir(out_dir):
        raise DataError(
            f"{out_dir} is not empty and holds no prepared dataset: refusing to write into it. "
            "Choose a new --out directory."
        )
    return "new"


def _sample_pairs(source_path, target_path, spm_pairs, seed):
    """One pass: the line count and a reservoir sample (Algorithm R) of at most `spm_pairs`
    pairs, in file order, so that a corpus that fits whole trains the model `train` would."""
    rng = random.Random(seed)
    sample, total = [], 0
    for index, pair in enumerate(read_pairs(source_path, target_path)):
        total += 1
        if len(sample) < spm_pairs:
            sample.append((index, pair))
        else:
            slot = rng.randrange(index + 1)
            if slot < spm_pairs:
                sample[slot] = (index, pair)
    sample.sort(key=lambda x: x[0])
    return total, [p for _, p in sample]


# The worker processes' encoders of each side, loaded once per process.
_worker_encoders = None


def _start_worker(model_proto: bytes, marian_folder: str | None = None):
    global _worker_encoders
    if marian_folder is not None:  # Marian's: a SentencePiece model and vocabulary per side
        from keras_transformer_runtime.marian_vocabulary import MarianVocabulary

        marian = MarianVocabulary.read(marian_folder)
        _worker_encoders = (
            marian.encode_batch,
            lambda texts: list(map(marian.encode_target, texts)),
        )
        return
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_proto=model_proto)
    _worker_encoders = (processor.encode, processor.encode)


def _encode_chunk(sources, targets, max_length, dtype):
    """Encodes one chunk of pairs: the kept pairs' pieces and lengths, and the counts."""
    nonempty = [i for i in range(len(sources)) if sources[i].strip() and targets[i].strip()]
    source_ids = _worker_encoders[0]([sources[i] for i in nonempty])
    target_ids = _worker_encoders[1]([targets[i] for i in nonempty])
    keep = [
        k
        for k in range(len(nonempty))
        if len(source_ids[k]) + 1 <= max_length and len(target_ids[k]) + 1 <= max_length
    ]
    lengths = np.array([(len(source_ids[k]), len(target_ids[k])) for k in keep], np.int32)
    lengths = lengths.reshape(-1, 2)

    def flat(ids):
        return np.fromiter((i for k in keep for i in ids[k]), dtype=dtype)

    return {
        "source": flat(source_ids),
        "target": flat(target_ids),
        "lengths": lengths,
        "total": len(sources),
        "empty": len(sources) - len(nonempty),
        "too_long": len(nonempty) - len(keep),
    }


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def _write_shard(out_dir, index, parts, max_length) -> dict:
    """Writes a shard's files into a temporary folder and renames it into place."""
    name = _shard_name(index)
    lengths = np.concatenate([p["lengths"] for p in parts]).reshape(-1, 2)
    keys = lengths.max(axis=1) + 1 if len(lengths) else np.zeros(0, np.int32)
    stats = {
        "total_pairs": sum(p["total"] for p in parts),
        "empty_pairs": sum(p["empty"] for p in parts),
        "too_long_pairs": sum(p["too_long"] for p in parts),
        "kept_pairs": int(len(lengths)),
        "source_tokens": int(lengths[:, 0].sum() + len(lengths)),
        "target_tokens": int(lengths[:, 1].sum() + len(lengths)),
        # Pairs per bucket key max(source, target) + 1: batch counts without reading the ids.
        "length_histogram": np.bincount(keys, minlength=max_length + 1).tolist(),
    }
    tmp = tempfile.mkdtemp(dir=out_dir, prefix=f".{name}.")
    try:
        np.save(os.path.join(tmp, "source.npy"), np.concatenate([p["source"] for p in parts]))
        np.save(os.path.join(tmp, "target.npy"), np.concatenate([p["target"] for p in parts]))
        np.save(os.path.join(tmp, "lengths.npy"), lengths)
        with open(os.path.join(tmp, "stats.json"), "w", encoding="utf-8") as f:
            json.dump(stats, f)
        os.replace(tmp, os.path.join(out_dir, name))
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    return stats


def _shard_record(out_dir, name) -> dict:
    directory = os.path.join(out_dir, name)
    record = {"name": name, **_read_json(os.path.join(directory, "stats.json"))}
    record["bytes"] = {f: os.path.getsize(os.path.join(directory, f)) for f in SHARD_FILES}
    return record


def _chunks(source_path, target_path, pairs_per_shard, done):
    """(shard, sources, targets) of at most CHUNK_LINES lines, never across shards;
    the lines of the shards in `done` are read past, not encoded."""
    sources, targets, shard = [], [], 0
    for index, (s, t) in enumerate(read_pairs(source_path, target_path)):
        shard = index // pairs_per_shard
        if shard in done:
            continue
        sources.append(s)
        targets.append(t)
        if len(sources) == CHUNK_LINES or (index + 1) % pairs_per_shard == 0:
            yield shard, sources, targets
            sources, targets = [], []
    if sources:
        yield shard, sources, targets


def _encode_shards(out_dir, source_path, target_path, tokenizer, settings, total, workers, log):
    """The second pass: encodes the shards not yet written, in `workers` processes."""
    shards = max(1, -(-total // settings.pairs_per_shard))
    done = {i for i in range(shards) if os.path.isdir(os.path.join(out_dir, _shard_name(i)))}
    if done:
        log(f"Keeping {len(done)} of {shards} shards written by an earlier run.")
    dtype = np.uint16 if tokenizer.vocabulary_size <= 1 << 16 else np.int32
    expected = {
        i: min(settings.pairs_per_shard, total - i * settings.pairs_per_shard)
        for i in range(shards)
    }
    parts = collections.defaultdict(list)
    pending = collections.deque()
    started = time.perf_counter()

    def finish(future):
        shard, part = future.shard, future.result()
        parts[shard].append(part)
        if sum(p["total"] for p in parts[shard]) == expected[shard]:
            _write_shard(out_dir, shard, parts.pop(shard), settings.max_length)
            log(
                f"  {_shard_name(shard)} written ({shard + 1}/{shards}, "
                f"{time.perf_counter() - started:.0f} s)"
            )

    # A bounded queue: the text is never read much ahead of the encoders.
    marian = out_dir if os.path.isfile(os.path.join(out_dir, "vocab.json")) else None
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=workers, initializer=_start_worker, initargs=(tokenizer.model_proto, marian)
    ) as pool:
        for shard, sources, targets in _chunks(
            source_path, target_path, settings.pairs_per_shard, done
        ):
            future = pool.submit(_encode_chunk, sources, targets, settings.max_length, dtype)
            future.shard = shard
            pending.append(future)
            while len(pending) > 2 * workers:
                finish(pending.popleft())
        while pending:
            finish(pending.popleft())
    return [_shard_name(i) for i in range(shards)]


def prepare(
    src_train: str,
    tgt_train: str,
    out_dir: str,
    settings: PrepareSettings | None = None,
    src_valid: str | None = None,
    tgt_valid: str | None = None,
    workers: int | None = None,
    verbose: int = 1,
) -> dict:
    """Prepares (or finishes, or finds finished) the dataset in `out_dir`; returns its manifest.

    Args:
        src_train, tgt_train: parallel text files (plain or `.gz`), any size.
        out_dir: the prepared directory (created).
        settings: `PrepareSettings`.
        src_valid, tgt_valid: optional validation files, copied into `out_dir`
            so that `train --data` needs nothing else.
        workers: encoding processes (default: the CPU count).
        verbose: 0 silences the progress lines.
    """
    settings = settings or PrepareSettings()
    workers = workers or os.cpu_count() or 1
    check_positive_int("workers", workers)
    inputs = _inputs(src_train, tgt_train, src_valid, tgt_valid)
    identity = _identity(settings, inputs)
    log = print if verbose else (lambda *a, **k: None)
    state = _check_directory(out_dir, identity)
    if state == "done":
        log(f"{out_dir} is prepared already for these inputs and settings; nothing to do.")
        return _read_json(os.path.join(out_dir, MANIFEST))
    os.makedirs(out_dir, exist_ok=True)
    if state == "new":
        atomic_write_json(os.path.join(out_dir, PENDING), identity)
    for leftover in os.listdir(out_dir):  # a killed run's half-written shard or file
        if leftover.startswith(".shard-"):
            shutil.rmtree(os.path.join(out_dir, leftover), ignore_errors=True)
    started = time.perf_counter()
    log(f"Reading {src_train} and {tgt_train}; sampling up to {settings.spm_pairs} pairs.")
    total, sample = _sample_pairs(src_train, tgt_train, settings.spm_pairs, settings.seed)
    if total == 0:
        raise DataError(f"{src_train} and {tgt_train} are empty: nothing to prepare.")
    spm_path = os.path.join(out_dir, SPM_MODEL)
    if settings.tokenizer_from is not None:
        tokenizer = _copied_tokenizer(settings.tokenizer_from, out_dir)
        del sample
    elif os.path.isfile(spm_path):
        tokenizer = SentencePieceTokenizer.load(spm_path)
        del sample
    else:
        log(f"Training SentencePiece on {len(sample)} of {total} pairs.")
        texts = [s for s, _ in sample] + [t for _, t in sample]
        del sample
        tokenizer = train_sentencepiece(
            texts, vocabulary_size=settings.vocab_size, seed=settings.seed
        )
        del texts
        tokenizer.save(spm_path)
    log(f"SentencePiece vocabulary: {tokenizer.vocabulary_size} pieces.")
    log(f"Encoding {total} pairs in {workers} processes.")
    names = _encode_shards(out_dir, src_train, tgt_train, tokenizer, settings, total, workers, log)
    shards = [_shard_record(out_dir, name) for name in names]
    if src_valid is not None:
        from keras_transformer.data.pipeline import read_parallel

        valid_sources, valid_targets = read_parallel(src_valid, tgt_valid)
        atomic_write_text(
            os.path.join(out_dir, "valid.src"), "".join(f"{s}\n" for s in valid_sources)
        )
        atomic_write_text(
            os.path.join(out_dir, "valid.tgt"), "".join(f"{t}\n" for t in valid_targets)
        )
    counts = {
        key: sum(s[key] for s in shards)
        for key in ("total_pairs", "empty_pairs", "too_long_pairs", "kept_pairs")
        + ("source_tokens", "target_tokens")
    }
    stats = PipelineStats(**counts)
    if not stats.kept_pairs:
        raise DataError(
            stats.describe() + ". Nothing is left to train on: check the files and max_length."
        )
    manifest = {
        "identity": identity,
        "inputs": inputs,
        "vocabulary_size": tokenizer.vocabulary_size,
        "max_length": settings.max_length,
        "dtype": "uint16" if tokenizer.vocabulary_size <= 1 << 16 else "int32",
        "stats": counts,
        "valid": src_valid is not None,
        "shards": shards,
    }
    atomic_write_json(os.path.join(out_dir, MANIFEST), manifest)
    os.remove(os.path.join(out_dir, PENDING))
    log(stats.describe("prepared"))
    log(f"Prepared {out_dir} in {time.perf_counter() - started:.0f} s ({len(shards)} shards).")
    return manifest


def _copied_tokenizer(run_dir, out_dir):
    """The tokenizer of the run `run_dir`, its files copied into `out_dir`."""
    from keras_transformer.translation import TOKENIZER_FILES, load_tokenizer

    tokenizer = load_tokenizer(run_dir)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(run_dir, name)):
            shutil.copyfile(os.path.join(run_dir, name), os.path.join(out_dir, name))
    return tokenizer


def prepare_command(args) -> int:
    """The `keras-transformer prepare` command's body."""
    from keras_transformer.settings_parser import settings_values

    settings = PrepareSettings(**settings_values(args, PrepareSettings))
    prepare(
        args.src_train,
        args.tgt_train,
        args.out,
        settings,
        src_valid=args.src_valid,
        tgt_valid=args.tgt_valid,
        workers=args.workers,
    )
    return 0


def add_prepare_arguments(parser) -> None:
    """`prepare`'s options: the files, one per `PrepareSettings` field, and `--workers`."""
    from keras_transformer.settings_parser import add_settings_arguments

    parser.add_argument("--src-train", required=True, help="source side (plain or .gz)")
    parser.add_argument("--tgt-train", required=True, help="target side, parallel to it")
    parser.add_argument("--src-valid", help="validation source side, copied for train --data")
    parser.add_argument("--tgt-valid", help="validation target side")
    parser.add_argument("--out", required=True, help="the prepared directory")
    add_settings_arguments(
        parser, PrepareSettings, {"settings": "what defines the prepared directory"}
    )
    parser.add_argument(
        "--workers", type=int, help="encoding processes (default: the number of CPUs)"
    )
