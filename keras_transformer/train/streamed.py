"""`train --data`: training on a prepared dataset streamed from disk, resumable mid-epoch.

`model.fit` runs over an endless stream of batches (`PreparedData.dataset`),
in spans of `save_every_steps` updates (one epoch of data without it): each
Keras epoch is one span, so the run's per-epoch machinery (validation,
`history.json`, checkpoints and their ranking and averaging, the backup that
resuming restores) works per span unchanged. The `--epochs` budget still
counts passes over the data.

The data position is the number of batches consumed since the start of the
run. `DataPosition` records it for every span in `data_position.json` before
the backup of that span is written, so that whatever the backup restores
(span k), the position of span k is known: the next start streams from that
batch of that epoch, in the same order (a function of the seed and the
epoch alone), and neither replays nor skips a batch. A kill loses at most the
updates of one span.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import keras

from keras_transformer.data.pipeline import DataError, batch_pairs, encode_pairs, read_parallel
from keras_transformer.data.shards import PreparedData
from keras_transformer.io_utils import atomic_write_json
from keras_transformer.train.init_from import check_prepared_for

POSITIONS = "data_position.json"
READERS = "readers"  # the key of `data_position.json` that is not a span


@dataclasses.dataclass
class StreamPlan:
    """How `model.fit` walks the stream: spans of batches, and where this start begins."""

    batches_per_epoch: int  # one pass over the data
    span_batches: int  # batches per Keras epoch (a span)
    keras_epochs: int  # spans to run, the restored ones included
    start_batches: int  # batches consumed before this start
    max_batches: int | None  # the --epochs budget in batches
    readers: int = 1  # processes that each read their own part of the data
    batch_shapes: tuple = ()  # the global batches' `(rows, positions)`, where fixed

    @property
    def start(self) -> tuple[int, int]:
        """(epoch, batch) of the data where this start begins."""
        return divmod(self.start_batches, self.batches_per_epoch)


def restored_spans(out_dir: str) -> int:
    """The spans the run's backup holds (Keras' `BackupAndRestore` metadata), 0 without one."""
    path = os.path.join(out_dir, "backup", "training_metadata.json")
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return int(json.load(f)["epoch"])


def _positions(out_dir: str) -> dict:
    path = os.path.join(out_dir, POSITIONS)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def consumed_batches(out_dir: str, spans: int) -> int:
    """Batches consumed by the end of span `spans` (0 for none), from `data_position.json`."""
    if spans == 0:
        return 0
    positions = _positions(out_dir)
    if str(spans) not in positions:
        raise DataError(
            f"{out_dir}/backup holds span {spans} but {os.path.join(out_dir, POSITIONS)} has no "
            "data position for it: the run cannot resume at the right batch. Start a new --out "
            "directory."
        )
    return int(positions[str(spans)])


def check_readers(out_dir: str, recorded: int, readers: int) -> None:
    """Refuses to resume a run whose data was read by `recorded` processes with `readers`."""
    if recorded != readers:
        raise DataError(
            f"{out_dir} was trained with {recorded} process(es), each reading its own part of "
            f"the data, and this start has {readers}: the order of the batches depends on it, "
            f"so the run cannot resume at the right batch. Resume it with {recorded} "
            "process(es), or start a new --out directory."
        )


class DataPosition(keras.callbacks.Callback):
    """Records the batches consumed at the end of each span (before the backup is written),
    and stops the run when the `--epochs` budget (`max_batches`) is spent."""

    def __init__(
        self, out_dir, start_batches, batches_per_epoch, max_batches=None, chief=True, readers=1
    ):
        super().__init__()
        self.readers = readers
        self.batches_per_epoch = batches_per_epoch
        self.path = os.path.join(out_dir, POSITIONS)
        self.consumed = start_batches
        self.max_batches = max_batches
        self.chief = chief
        self.positions = _positions(out_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self.in_span = 0

    def on_train_batch_end(self, batch, logs=None):
        self.in_span = batch + 1
        if self.max_batches is not None and self.consumed + self.in_span >= self.max_batches:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.consumed += self.in_span
        self.positions[str(epoch + 1)] = self.consumed
        # Later spans of an earlier start were not kept by the backup: forget them.
        self.positions = {
            k: v for k, v in self.positions.items() if k.isdigit() and int(k) <= epoch + 1
        }
        self.positions[READERS] = self.readers
        if logs is not None:  # runs before the recorder: history.json says it per span
            logs["data_epochs"] = round(self.consumed / self.batches_per_epoch, 4)
        if self.chief:
            atomic_write_json(self.path, self.positions)


def streamed_inputs(run, settings, prepared: PreparedData, tokenizer, config, tokens_per_batch):
    """The training stream from this start's position, the validation batches and the plan."""
    processes = run.processes
    readers, local_tokens = processes.count, tokens_per_batch // processes.count
    if readers > 1 and local_tokens < prepared.max_length:
        raise ValueError(
            f"--tokens-per-batch {tokens_per_batch} is shared by {readers} processes, "
            f"{local_tokens} each, fewer than max_length ({prepared.max_length}): give at least "
            f"{readers * prepared.max_length}."
        )
    per_epoch = prepared.steps_per_epoch(local_tokens, readers)
    span = (settings.save_every_steps or 0) * settings.accumulate_steps or per_epoch
    # Process 0's run directory says where every process of a data-parallel run resumes.
    spans_done = processes.first_value(restored_spans(run.out_dir) if run.resume else 0)
    if spans_done:
        recorded = int(_positions(run.out_dir).get(READERS, 1)) if run.chief else 0
        check_readers(run.out_dir, processes.first_value(recorded), readers)
    start = processes.first_value(consumed_batches(run.out_dir, spans_done) if run.chief else 0)
    max_batches = None if settings.epochs is None else settings.epochs * per_epoch
    keras_epochs = 10_000_000 if max_batches is None else math.ceil(max_batches / span)
    rows_multiple = processes.devices // readers
    shapes = prepared.batch_shapes(local_tokens, readers, rows_multiple)
    plan = StreamPlan(per_epoch, span, keras_epochs, start, max_batches, readers, shapes)
    epoch, batch = plan.start
    # Each process reads its own part; its batches are its rows of the global batch.
    train = prepared.dataset(
        settings.seed,
        local_tokens,
        epoch,
        batch,
        part=(processes.index, readers),
        rows_multiple=rows_multiple,
    )
    if start:
        run.log(
            f"Data position: epoch {epoch + 1}, batch {batch} of {per_epoch} "
            f"({start} batches consumed by the {spans_done} spans restored)."
        )
    src_valid, tgt_valid = settings.src_valid, settings.tgt_valid
    if src_valid is None:
        copied = prepared.valid_files()
        if copied is None:
            raise DataError(
                f"{settings.data} holds no validation files: give --src-valid and --tgt-valid "
                "(or prepare it with them)."
            )
        src_valid, tgt_valid = copied
    valid_text = read_parallel(src_valid, tgt_valid)
    valid, valid_stats = batch_pairs(
        encode_pairs(*valid_text, tokenizer, config.max_length, prepared.shapes.evaluated()),
        tokens_per_batch,
        shuffle=False,
    )
    return train, valid, valid_stats, valid_text, plan


class PreparedBatches:
    """A prepared dataset seen as `EncodedPairs` is by `automatic_tokens_per_batch`."""

    def __init__(self, prepared: PreparedData):
        self.prepared = prepared

    def batches(self, tokens_per_batch: int) -> int:
        return self.prepared.batches_per_epoch(tokens_per_batch)


def check_prepared(settings, prepared) -> None:
    """Refuses settings that the prepared directory cannot serve, before the run is written."""
    if settings.init_from is not None:
        check_prepared_for(settings, prepared)
        return
    requested = prepared.manifest["identity"]["vocab_size"]
    if settings.vocab_size != requested:
        raise DataError(
            f"{settings.data} was prepared with vocab_size {requested}, not {settings.vocab_size}: "
            "its SentencePiece model is the run's. Omit --vocab-size or give that value."
        )
    limit = settings.model_config(settings.vocab_size).max_length
    if prepared.max_length > limit:
        raise DataError(
            f"{settings.data} was prepared with max_length {prepared.max_length}, longer than "
            f"the model's {limit}: prepare it again with --max-length {limit} or less."
        )
    if settings.subword_sampling() is not None:
        raise ValueError("subword_alpha re-segments text, which --data does not hold.")
