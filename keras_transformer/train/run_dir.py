"""The run directory: whether `--out` holds this run (resume) or is new, and what a start
reads back from it (history, tokenizer, the seed of its random streams)."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

from keras_transformer.data.tokenizer import SentencePieceTokenizer, train_sentencepiece
from keras_transformer.io_utils import atomic_write_json
from keras_transformer.train.backup import settle_backup
from keras_transformer.train.data_parallel import SINGLE_PROCESS, Processes
from keras_transformer.train.settings import RESUMABLE_FIELDS, TrainSettings


class RunDirectoryError(ValueError):
    """The run directory belongs to another configuration or is not a run directory."""


def _check_run_directory(out_dir: str, settings: TrainSettings) -> bool:
    """Returns True when `out_dir` holds this run already (resume), False when it is new."""
    config_path = os.path.join(out_dir, "train_config.json")
    if not os.path.exists(out_dir):
        return False
    if not os.path.isdir(out_dir):
        raise RunDirectoryError(f"{out_dir} exists and is not a directory.")
    if not os.path.isfile(config_path):
        if os.listdir(out_dir):
            raise RunDirectoryError(
                f"{out_dir} is not empty and has no train_config.json: refusing to write a "
                "run into it. Choose a new --out directory."
            )
        return False
    with open(config_path, encoding="utf-8") as f:
        previous = json.load(f)
    current = settings.identity()
    # A setting added since the run was written counts as its default there;
    # one since removed is ignored.
    defaults = {f.name: f.default for f in dataclasses.fields(TrainSettings)}
    previous_identity = {k: previous.get(k, defaults.get(k)) for k in current}
    changed = sorted(
        k
        for k in set(previous_identity) | set(current)
        if previous_identity.get(k) != current.get(k)
    )
    if changed:
        details = "; ".join(
            f"{k}: {previous_identity.get(k)!r} there, {current.get(k)!r} now" for k in changed
        )
        raise RunDirectoryError(
            f"{out_dir} holds a run with a different configuration ({details}). "
            "Use a new --out directory, or repeat the original settings to resume it."
        )
    return True


@dataclasses.dataclass
class _Run:
    """What the stages of `train` share: where the run lives and who writes it.

    `strategy` is a `tf.distribute.Strategy`, or the `keras.distribution`
    of a data-parallel run (`processes.distribution`), or None.
    """

    out_dir: str
    resume: bool
    strategy: object
    processes: Processes
    verbose: int

    @property
    def chief(self) -> bool:
        """True on the process that writes the run directory (process 0)."""
        return self.processes.first

    @property
    def replicas(self) -> int:
        """Devices that share each global batch."""
        if self.processes.distribution is not None:
            return self.processes.devices
        return self.strategy.num_replicas_in_sync if self.strategy is not None else 1

    def log(self, *args, **kwargs):
        if self.verbose:
            print(*args, **kwargs)


def open_run(settings, out_dir, verbose, strategy, processes=SINGLE_PROCESS) -> _Run:
    """The run directory: checked against an earlier run, created, and its settings written.

    Only process 0 opens `out_dir`; every other process of a data-parallel run
    writes to a new temporary folder of its own (its tokenizer, its settings),
    and takes process 0's history and state: nothing there outlives the start.
    """
    if not processes.first:
        out_dir = tempfile.mkdtemp(prefix=f"keras-transformer-process-{processes.index}-")
        atexit.register(shutil.rmtree, out_dir, ignore_errors=True)  # after an error too
        if processes.watch is not None:
            processes.watch.add_cleanup(out_dir)  # removed too when a peer dies
    resume = _check_run_directory(out_dir, settings)
    if resume:
        # Before anything reads the backup: finish or discard a commit a kill cut short.
        settle_backup(os.path.join(out_dir, "backup"))
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_json(
        os.path.join(out_dir, "train_config.json"),
        {**settings.identity(), **{k: getattr(settings, k) for k in RESUMABLE_FIELDS}},
    )
    return _Run(out_dir, resume, strategy, processes, verbose if processes.first else 0)


def read_history(run) -> list:
    """The epochs recorded in the run's `history.json` (none for a new run)."""
    path = os.path.join(run.out_dir, "history.json")
    if not (run.resume and os.path.isfile(path)):
        return []
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def finished_epochs(run) -> int:
    """The epochs in process 0's `history.json` (0 for a new run), the same on every process."""
    return run.processes.first_value(len(read_history(run)))


def stream_seed(seed: int, epochs_done: int) -> int:
    """The seed of one start's random streams: `seed` itself for a new run.

    Every start of `train` seeds the data order (tf.data's shuffles) and the
    dropout masks (each layer's `SeedGenerator`, whose state no checkpoint
    keeps) afresh. Seeded with `seed` again, a run resumed after k epochs
    would replay the first start's epochs 1, 2, ...: the same batches with the
    same masks, which the model partly memorizes. A resumed start draws
    instead from a seed derived from `seed` and `epochs_done`: other streams
    than every earlier start's, and the same ones if that start is repeated.

    >>> stream_seed(0, 0), stream_seed(0, 16) != stream_seed(0, 0)
    (0, True)
    """
    if epochs_done == 0:
        return seed
    entropy = [seed % 2**32, seed // 2**32 % 2**32, epochs_done]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)


def portable_identity(settings) -> bytes:
    """The settings that every process of a run must share, without machine-specific file paths."""
    values = settings.identity()
    for name in ("src_train", "tgt_train", "src_valid", "tgt_valid", "data", "init_from"):
        values.pop(name, None)
    return json.dumps(values, sort_keys=True).encode()


def load_or_train_tokenizer(out_dir, settings, resume, sources, targets):
    if settings.init_from is not None:
        # Fine-tuning keeps the model's own tokenizer, copied into the run once.
        import shutil

        from keras_transformer.io_utils import atomic_path
        from keras_transformer.translation import TOKENIZER_FILES, load_tokenizer

        for name in TOKENIZER_FILES:
            origin = os.path.join(settings.init_from, name)
            if os.path.isfile(origin) and not (
                resume and os.path.isfile(os.path.join(out_dir, name))
            ):
                with atomic_path(os.path.join(out_dir, name)) as tmp:
                    shutil.copyfile(origin, tmp)
        return load_tokenizer(out_dir)
    path = os.path.join(out_dir, "spm.model")
    if resume and os.path.isfile(path):
        return SentencePieceTokenizer.load(path)
    tokenizer = train_sentencepiece(
        sources + targets, vocabulary_size=settings.vocab_size, seed=settings.seed
    )
    tokenizer.save(path)
    return tokenizer
