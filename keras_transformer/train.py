"""Training on parallel text files: the `keras-transformer train` command.

A run directory holds everything a run needs and produces:

- `train_config.json`: the settings that define the run; a rerun with other
  settings is refused (the settings that only say when to stop or how to
  finish, `RESUMABLE_FIELDS`, may change: a finished run can be extended or
  finished another way).
- `spm.model`: the joint SentencePiece model, trained on the first start.
- `backup/`: Keras `BackupAndRestore` state (weights and optimizer) of the last
  completed epoch; rerunning the same command resumes from it, with data
  order and dropout masks drawn anew (`stream_seed`), not replayed.
- `checkpoints/epoch-NNN.weights.h5`: the weights after the last epochs and
  after the best ones on validation, for choosing and averaging.
- `history.json`: per-epoch losses, validation measures, seconds and steps,
  and the precision and device (GPU, or CPU model) each epoch trained on.
- `model.keras`, `config.json`, `metrics.json`, and TensorBoard logs in `logs/`.

Choosing on validation: every epoch is scored on the validation set by loss
or by BLEU (`select_by`); `patience` stops a run that has not improved for
that many epochs; at the end the saved weights are the candidate that scores
best on validation among the last epoch, the best epoch, and the means of the
last k and of the best k epochs for k up to `average` (`final="auto"`), or
the one kind asked for (`final="last"` or `"best"`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import re
import sys
import time
import zlib

import keras
import numpy as np

from keras_transformer.config import TransformerConfig
from keras_transformer.data.pipeline import (
    DataError,
    SubwordSampling,
    batch_pairs,
    check_batch_fits,
    duplicate_rows,
    encode_pairs,
    read_parallel,
)
from keras_transformer.data.tokenizer import (
    DEFAULT_VOCABULARY_SIZE,
    SentencePieceTokenizer,
    train_sentencepiece,
)
from keras_transformer.distribute import (
    SyncWithChief,
    check_workers_agree,
    chief_value,
    enable_multi_worker_fit,
    is_chief,
    make_strategy,
    share_global_batches,
    working_directory,
)
from keras_transformer.io_utils import atomic_path, atomic_save_model, atomic_write_json
from keras_transformer.model import build_transformer
from keras_transformer.precision import CHOICES as PRECISION_CHOICES
from keras_transformer.precision import (
    gpu_compute_capabilities,
    resolve_precision,
    training_device,
    visible_gpus,
)
from keras_transformer.startup import onednn_enabled
from keras_transformer.training import (
    LabelSmoothedCrossEntropy,
    MaskedAccuracy,
    TransformerSchedule,
    transformer_optimizer,
)
from keras_transformer.validation import check_consistency

# Settings that only say when to stop or how to finish; changing them resumes the run.
RESUMABLE_FIELDS = (
    "epochs",
    "max_steps",
    "max_minutes",
    "patience",
    "average",
    "final",
    "valid_beam",
    "strategy",
)
# Epoch checkpoints kept, and the most that the final weights average (`average`).
# On Multi30k en->de the mean of the best 8 of 20 epochs beat every mean of
# at most 5 on val by 0.3 BLEU (benchmarks/results/multi30k/); fairseq
# averages the last 10.
KEEP_CHECKPOINTS = 10
# The paper's warm-up; the automatic learning-rate scale keeps its peak for any warm-up.
PAPER_WARMUP_STEPS = 4000
# The automatic warm-up, in epochs of updates (at most PAPER_WARMUP_STEPS). On
# Multi30k one epoch (258 updates) left the post-norm `small` model on the
# plateau where it ignores the source (benchmarks/results/multi30k/).
WARMUP_EPOCHS = 3
# The automatic batch size (`tokens_per_batch=None`): the largest of these that
# still gives an epoch MIN_UPDATES_PER_EPOCH optimizer updates. On Multi30k,
# 4096-token batches (134 updates an epoch) were far behind 2048-token ones
# (258) at every epoch of a 10-epoch budget, and 1024-token ones (507) ahead of
# 2048 in both directions (benchmarks/results/multi30k/); a large corpus keeps
# 4096.
AUTO_TOKENS_PER_BATCH = (4096, 2048, 1024)
MIN_UPDATES_PER_EPOCH = 400
# The shape settings a run may override on its preset (TransformerConfig fields).
SHAPE_FIELDS = ("num_layers", "hidden_dim", "intermediate_dim", "num_heads")
# Validation measure: history key, and whether larger is better.
MEASURES = {"loss": ("val_loss", False), "bleu": ("val_bleu", True)}
FINAL_CHOICES = ("auto", "last", "best")


class RunDirectoryError(ValueError):
    """The run directory belongs to another configuration or is not a run directory."""


def default_select_by(strategy: str) -> str:
    """The measure that ranks epochs when none is asked for: greedy validation
    BLEU, the one a translation is judged by; validation loss under
    multi-worker training, where BLEU is not decoded."""
    return "loss" if strategy == "multi-worker" else "bleu"


@dataclasses.dataclass
class TrainSettings:
    """Everything that defines a training run (written to `train_config.json`)."""

    src_train: str
    tgt_train: str
    src_valid: str
    tgt_valid: str
    preset: str = "small"
    epochs: int | None = None
    max_steps: int | None = None
    max_minutes: float | None = None
    # Padded tokens per batch on each side; None: automatic (AUTO_TOKENS_PER_BATCH).
    tokens_per_batch: int | None = None
    # "auto": bfloat16 where the hardware computes in it, else float32.
    precision: str = "auto"
    label_smoothing: float = 0.1
    # None: WARMUP_EPOCHS epochs of updates, at most the paper's 4000.
    warmup_steps: int | None = None
    # None: sqrt(warmup_steps / 4000), the paper's peak learning rate for the width.
    learning_rate_scale: float | None = None
    # The last fraction of the run's updates (epochs or max_steps) over which the
    # learning rate falls linearly to zero; None: none, the paper's curve.
    cooldown: float | None = None
    # Batches whose gradients are averaged into one update.
    accumulate_steps: int = 1
    vocab_size: int = DEFAULT_VOCABULARY_SIZE
    # Subword regularization: sample each training sentence's segmentation anew
    # every epoch with this alpha (SubwordSampling); None: the one best segmentation.
    subword_alpha: float | None = None
    # Sample among this many best segmentations (-1: all); used with subword_alpha.
    subword_nbest: int = 64
    # R-Drop's alpha: every training sentence goes through the model twice per
    # step, with different dropout masks, and the loss adds alpha times the
    # symmetric KL divergence between the two predictions; 0: off.
    rdrop_alpha: float = 0.0
    # The model's shape; None: the preset's (SHAPE_FIELDS).
    num_layers: int | None = None
    hidden_dim: int | None = None
    intermediate_dim: int | None = None
    num_heads: int | None = None
    dropout: float | None = None
    attention_dropout: float | None = None
    # None: the preset's; True: LayerNorm before each sublayer (pre-norm).
    normalize_first: bool | None = None
    seed: int = 0
    # The validation measure that ranks epochs: "loss" or "bleu" (greedy); None:
    # "bleu", the measure a translation is judged by, or "loss" with multi-worker.
    select_by: str | None = None
    # Stop after this many epochs without a better validation measure.
    patience: int | None = None
    # Largest number of epoch checkpoints averaged into the final weights.
    average: int = KEEP_CHECKPOINTS
    # "auto": the candidate best on validation; "last" / "best": the mean of the
    # last / best `average` epochs.
    final: str = "auto"
    valid_beam: int = 1
    jit_compile: bool = False
    strategy: str = "default"

    def __post_init__(self):
        from keras_transformer.distribute import STRATEGIES

        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {', '.join(STRATEGIES)}. "
                f"Received: strategy={self.strategy!r}"
            )
        if self.select_by is None:
            self.select_by = default_select_by(self.strategy)
        for name, value, choices in (
            ("precision", self.precision, PRECISION_CHOICES),
            ("select_by", self.select_by, tuple(MEASURES)),
            ("final", self.final, FINAL_CHOICES),
        ):
            if value not in choices:
                raise ValueError(
                    f"{name} must be one of {', '.join(choices)}. Received: {name}={value!r}"
                )
        if self.select_by == "bleu" and self.strategy == "multi-worker":
            raise ValueError(
                "select_by='bleu' decodes on one process and is not available with "
                "strategy='multi-worker'; use select_by='loss'."
            )
        if self.epochs is None and self.max_steps is None and self.max_minutes is None:
            self.epochs = 10
        for name in (
            "epochs",
            "max_steps",
            "tokens_per_batch",
            "warmup_steps",
            "accumulate_steps",
            "patience",
            "average",
            *SHAPE_FIELDS,
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer. Received: {name}={value}")
        if self.learning_rate_scale is not None and not self.learning_rate_scale > 0:
            raise ValueError(
                "learning_rate_scale must be positive. "
                f"Received: learning_rate_scale={self.learning_rate_scale}"
            )
        if self.cooldown is not None:
            if not 0 < self.cooldown <= 1:
                raise ValueError(
                    f"cooldown must be a fraction in (0, 1]. Received: cooldown={self.cooldown}"
                )
            if self.epochs is None and self.max_steps is None:
                raise ValueError(
                    "cooldown needs the run's length in updates: give epochs or max_steps "
                    "(a budget in minutes alone does not say when the run ends)."
                )
        self.subword_sampling()  # a valid alpha and nbest, or say why not
        check_consistency(self.rdrop_alpha)
        if self.rdrop_alpha and self.strategy != "default":
            raise ValueError(
                "rdrop_alpha pairs the two copies of a sentence within one device's batch; "
                f"it is available with strategy='default' only. Received: "
                f"strategy={self.strategy!r}"
            )
        config = self.model_config(self.vocab_size)  # the preset and shape build, or say why not
        if self.tokens_per_batch is not None:
            check_batch_fits(self.tokens_per_batch, config.max_length)
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be positive. Received: {self.max_minutes}")
        if self.valid_beam < 1:
            raise ValueError(f"valid_beam must be a positive integer. Received: {self.valid_beam}")
        for path in (self.src_train, self.tgt_train, self.src_valid, self.tgt_valid):
            if not os.path.isfile(path):
                raise DataError(f"File not found: {path}")

    def identity(self) -> dict:
        """The settings that must match to resume (file paths made absolute)."""
        values = dataclasses.asdict(self)
        for name in RESUMABLE_FIELDS:
            values.pop(name)
        for name in ("src_train", "tgt_train", "src_valid", "tgt_valid"):
            values[name] = os.path.abspath(values[name])
        return values

    def schedule(self, updates_per_epoch: int) -> tuple[int, float]:
        """`(warmup_steps, learning_rate_scale)`, the automatic ones filled in.

        The automatic warm-up is `WARMUP_EPOCHS` epochs of updates (at most
        the paper's 4000), so that a small corpus does not spend its run
        warming up; the automatic scale `sqrt(warmup / 4000)` keeps the
        paper's peak learning rate, `d_model^-0.5 * 4000^-0.5`, whatever the
        warm-up.
        """
        automatic = WARMUP_EPOCHS * max(1, updates_per_epoch)
        warmup = self.warmup_steps or min(PAPER_WARMUP_STEPS, automatic)
        scale = self.learning_rate_scale or math.sqrt(warmup / PAPER_WARMUP_STEPS)
        return warmup, scale

    def run_length(self, updates_per_epoch: int) -> tuple[int | None, int | None]:
        """`(total_steps, cooldown_steps)` of the schedule's cool-down; `(None, None)` without one.

        The run's length is the smaller of `epochs` of updates and `max_steps`.
        """
        if self.cooldown is None:
            return None, None
        lengths = [self.max_steps] if self.max_steps is not None else []
        if self.epochs is not None:
            lengths.append(self.epochs * max(1, updates_per_epoch))
        total = min(lengths)
        return total, max(1, round(self.cooldown * total))

    def subword_sampling(self) -> SubwordSampling | None:
        """The training batches' `SubwordSampling`, or None for the best segmentation."""
        if self.subword_alpha is None:
            return None
        return SubwordSampling(self.subword_alpha, self.subword_nbest)

    def budget(self) -> str:
        """The stopping budget in words, e.g. "budget 30 min or 5000 steps"."""
        limits = []
        if self.max_minutes is not None:
            limits.append(f"{self.max_minutes:g} min")
        if self.max_steps is not None:
            limits.append(f"{self.max_steps} step{'s' * (self.max_steps != 1)}")
        if self.epochs is not None:
            limits.append(f"{self.epochs} epoch{'s' * (self.epochs != 1)}")
        return "budget " + " or ".join(limits)

    def model_config(self, vocabulary_size: int) -> TransformerConfig:
        return preset_config(
            self.preset,
            vocabulary_size,
            self.dropout,
            self.attention_dropout,
            self.normalize_first,
            **{name: getattr(self, name) for name in SHAPE_FIELDS},
        )


def preset_config(
    preset, vocabulary_size, dropout=None, attention_dropout=None, normalize_first=None, **shape
):
    """The `TransformerConfig` of a run: the preset with the run's vocabulary and overrides.

    `shape` takes `SHAPE_FIELDS`; a None value keeps the preset's.
    """
    unknown = set(shape) - set(SHAPE_FIELDS)
    if unknown:
        raise ValueError(f"Unknown shape fields: {', '.join(sorted(unknown))}")
    overrides = {"vocabulary_size": vocabulary_size}
    for name, value in (
        ("dropout", dropout),
        ("attention_dropout", attention_dropout),
        ("normalize_first", normalize_first),
        *shape.items(),
    ):
        if value is not None:
            overrides[name] = value
    return TransformerConfig.from_preset(preset, **overrides)


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


class _EpochProgress(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, under an epoch line that states the real budget.

    Keras would print "Epoch 3/10000" for a run bounded by minutes or steps.
    """

    def __init__(self, budget):
        super().__init__()
        self.budget = budget

    def on_epoch_begin(self, epoch, logs=None):
        epochs, self.epochs = self.epochs, 1  # Keras prints its own line only when epochs > 1
        super().on_epoch_begin(epoch, logs)
        self.epochs = epochs
        if self.verbose:
            print(f"Epoch {epoch + 1} ({self.budget})")


def fit_verbosity(verbose: int, terminal: bool) -> int:
    """`model.fit`'s verbosity: the live progress bar (1) only on a terminal.

    Redirected to a file (`nohup`, CI logs), the bar's carriage-return
    updates would write megabytes an epoch; one line per epoch (2) is kept.
    """
    return 2 if verbose == 1 and not terminal else verbose


def ranked_epochs(history, select_by) -> list[int]:
    """The epochs of `history`, best first by the validation measure `select_by`.

    Of equal scores the earlier epoch ranks first: a later epoch counts as an
    improvement only when it is strictly better. Epochs without the measure
    are left out.
    """
    key = MEASURES[select_by][0]
    scored = [(e[key], e["epoch"]) for e in history if e.get(key) is not None]
    return [epoch for _, epoch in sorted(scored, key=lambda x: (_worse(select_by, x[0]), x[1]))]


def _worse(select_by, value) -> float:
    """`value` of the measure `select_by` as a key that sorts the best first."""
    return -value if MEASURES[select_by][1] else value


def patience_spent(history, select_by, patience) -> bool:
    """True when the last `patience` epochs brought no better validation measure."""
    if patience is None or not history:
        return False
    ranked = ranked_epochs(history, select_by)
    return bool(ranked) and history[-1]["epoch"] - ranked[0] >= patience


class _RunRecorder(keras.callbacks.Callback):
    """Keeps `history.json` (per-epoch metrics and seconds), epoch checkpoints, and stops.

    Each epoch's entry adds `epoch_fields` (the precision and device of this
    start). Keeps the checkpoints of the last `keep` epochs and of the best `keep` by
    `select_by`. Stops at the end of an epoch when `max_minutes` of training
    (summed over restarts) would be exceeded by one more epoch like the last,
    after `max_steps` optimizer updates, and when `patience` epochs passed
    without a better validation measure.
    """

    def __init__(
        self,
        out_dir,
        history,
        max_steps=None,
        max_minutes=None,
        keep=KEEP_CHECKPOINTS,
        strategy=None,
        select_by="loss",
        patience=None,
        epoch_fields=None,
    ):
        super().__init__()
        self.epoch_fields = dict(epoch_fields or {})
        self.strategy = strategy
        self.out_dir = out_dir
        self.history = history
        self.max_steps = max_steps
        self.max_seconds = None if max_minutes is None else 60.0 * max_minutes
        self.keep = keep
        self.select_by = select_by
        self.patience = patience
        self.checkpoint_dir = os.path.join(out_dir, "checkpoints")
        os.makedirs(self.checkpoint_dir, exist_ok=True)

    def _trained_seconds(self):
        return sum(entry["seconds"] for entry in self.history)

    def budget_spent(self) -> bool:
        """True when another epoch like the last one would exceed `max_minutes`."""
        if self.max_seconds is None or not self.history:
            return False
        return self._trained_seconds() + self.history[-1]["seconds"] > self.max_seconds

    def on_epoch_begin(self, epoch, logs=None):
        # Epochs after the restored backup are redone: forget what they logged.
        del self.history[epoch:]
        self.epoch_started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.max_steps is not None:
            if int(self.model.optimizer.iterations.numpy()) >= self.max_steps:
                self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self.epoch_started
        entry = {"epoch": epoch + 1, "seconds": round(seconds, 2)}
        entry["steps"] = int(self.model.optimizer.iterations.numpy())
        entry.update({k: float(v) for k, v in (logs or {}).items()})
        entry.update(self.epoch_fields)
        self.history.append(entry)
        path = os.path.join(self.checkpoint_dir, f"epoch-{epoch + 1:03d}.weights.h5")
        with atomic_path(path, suffix=".weights.h5") as tmp:
            self.model.save_weights(tmp)
        wanted = set(ranked_epochs(self.history, self.select_by)[: self.keep])
        checkpoints = _epoch_checkpoints(self.out_dir)
        wanted.update(_checkpoint_epoch(p) for p in checkpoints[-self.keep :])
        for old in checkpoints:
            if _checkpoint_epoch(old) not in wanted:
                os.remove(old)
        atomic_write_json(os.path.join(self.out_dir, "history.json"), self.history)
        # Each worker times itself; all stop when the chief does.
        spent = self.budget_spent() or patience_spent(self.history, self.select_by, self.patience)
        if chief_value(self.strategy, spent):
            self.model.stop_training = True


class _ValidationBleu(keras.callbacks.Callback):
    """Adds `val_bleu` and `val_bleu_lowercase` (greedy, sacreBLEU) to each epoch's logs.

    Runs before the recorder, so the scores reach `history.json`, the
    checkpoint ranking and TensorBoard.
    """

    def __init__(self, tokenizer, pairs):
        super().__init__()
        self.tokenizer = tokenizer
        self.pairs = pairs

    def on_epoch_end(self, epoch, logs=None):
        scores = _bleu_on(self.model, self.tokenizer, self.pairs, beam_size=1)
        if logs is not None:
            logs["val_bleu"] = scores["bleu"]
            logs["val_bleu_lowercase"] = scores["bleu_lowercase"]


def _bleu_on(model, tokenizer, pairs, beam_size, progress=False) -> dict:
    from keras_transformer.evaluation import score_translations
    from keras_transformer.translation import translate_lines

    hypotheses = translate_lines(
        model, tokenizer, [s for s, _ in pairs], beam_size=beam_size, batch_size=64,
        progress=progress,
    )  # fmt: skip
    return score_translations(hypotheses, [t for _, t in pairs])


def _checkpoint_epoch(path) -> int:
    return int(re.search(r"epoch-(\d+)", os.path.basename(path)).group(1))


def _epoch_checkpoints(out_dir):
    paths = glob.glob(os.path.join(out_dir, "checkpoints", "epoch-*.weights.h5"))
    return sorted(paths, key=_checkpoint_epoch)


def average_checkpoints(model, paths) -> None:
    """Sets `model`'s weights to the element-wise mean of the weight files `paths`."""
    if not paths:
        raise ValueError("No checkpoints to average.")
    total = None
    for path in paths:
        model.load_weights(path)
        weights = [np.asarray(w, np.float64) for w in model.get_weights()]
        total = weights if total is None else [t + w for t, w in zip(total, weights, strict=True)]
    model.set_weights([t / len(paths) for t in total])


def _portable_identity(settings) -> bytes:
    """The settings that every worker of a run must share, without machine-specific file paths."""
    values = settings.identity()
    for name in ("src_train", "tgt_train", "src_valid", "tgt_valid"):
        values.pop(name)
    return json.dumps(values, sort_keys=True).encode()


def _load_or_train_tokenizer(out_dir, settings, resume, sources, targets):
    path = os.path.join(out_dir, "spm.model")
    if resume and os.path.isfile(path):
        return SentencePieceTokenizer.load(path)
    tokenizer = train_sentencepiece(
        sources + targets, vocabulary_size=settings.vocab_size, seed=settings.seed
    )
    tokenizer.save(path)
    return tokenizer


def build_and_compile(
    config: TransformerConfig,
    strategy=None,
    precision: str = "float32",
    warmup_steps: int = 4000,
    learning_rate_scale: float = 1.0,
    label_smoothing: float = 0.1,
    jit_compile=False,
    accumulate_steps: int = 1,
    total_steps: int | None = None,
    cooldown_steps: int | None = None,
    rdrop_alpha: float = 0.0,
) -> keras.Model:
    """Builds `config` under `strategy`'s scope in `precision` and compiles it for training.

    Adam with the paper's schedule, `LabelSmoothedCrossEntropy` and
    `MaskedAccuracy`; `mixed_float16` gets Keras' loss scaling; "auto"
    precision is resolved by `keras_transformer.precision.resolve_precision`.
    `accumulate_steps` > 1 averages that many batches' gradients per update.
    `cooldown_steps` of `total_steps` end the schedule with a linear fall to
    zero (`TransformerSchedule`). `rdrop_alpha` > 0 adds R-Drop's consistency
    term to the loss; the batches must then hold each sentence twice
    (`keras_transformer.data.pipeline.duplicate_rows`).
    `strategy` None is the default (one-device) strategy.

    Example:

    >>> strategy = make_strategy("mirrored")  # keras_transformer.distribute
    >>> model = build_and_compile(TransformerConfig.from_preset("small"), strategy)
    >>> model.fit(dataset, epochs=10)  # doctest: +SKIP
    """
    precision, _ = resolve_precision(precision)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    previous_policy = keras.config.dtype_policy()
    with scope:
        keras.config.set_dtype_policy(precision)
        try:
            model = build_transformer(config)
        finally:
            keras.config.set_dtype_policy(previous_policy)
        model.compile(
            optimizer=transformer_optimizer(
                config.hidden_dim,
                warmup_steps,
                learning_rate_scale,
                accumulate_steps,
                total_steps,
                cooldown_steps,
            ),
            loss=LabelSmoothedCrossEntropy(label_smoothing, consistency=rdrop_alpha),
            metrics=[MaskedAccuracy()],
            jit_compile=jit_compile,
        )
        # The optimizer's slots now, not on first use: built inside the first
        # trace of the training step, they make TensorFlow trace it twice.
        model.optimizer.build(model.trainable_variables)
    return enable_multi_worker_fit(model, strategy)


@dataclasses.dataclass
class _Run:
    """What the stages of `train` share: where the run lives and who writes it."""

    out_dir: str
    resume: bool
    strategy: object
    chief: bool
    verbose: int

    @property
    def replicas(self) -> int:
        return self.strategy.num_replicas_in_sync if self.strategy is not None else 1

    def log(self, *args, **kwargs):
        if self.verbose:
            print(*args, **kwargs)


@dataclasses.dataclass
class _Data:
    tokenizer: SentencePieceTokenizer
    config: TransformerConfig
    train: object  # tf.data.Dataset
    valid: object
    train_stats: object  # keras_transformer.data.pipeline.DataStats
    valid_stats: object
    valid_text: tuple  # (sources, targets): the validation files' lines
    tokens_per_batch: int  # as given, or as chosen automatically

    @functools.cached_property
    def valid_pairs(self) -> list[tuple[str, str]]:
        """The validation pairs the validation loss uses (non-empty, within max_length)."""
        encode, limit = self.tokenizer.encode, self.config.max_length
        return [
            (s, t)
            for s, t in zip(*self.valid_text, strict=True)
            if s.strip() and t.strip() and len(encode(s)) < limit and len(encode(t)) < limit
        ]


@dataclasses.dataclass
class _Recipe:
    """The optimization settings with the automatic ones resolved for this machine and data."""

    precision: str
    precision_reason: str
    warmup_steps: int
    learning_rate_scale: float
    updates_per_epoch: int
    total_steps: int | None = None
    cooldown_steps: int | None = None
    device: str = ""

    def compile_args(self, settings) -> dict:
        return dict(
            precision=self.precision,
            warmup_steps=self.warmup_steps,
            learning_rate_scale=self.learning_rate_scale,
            total_steps=self.total_steps,
            cooldown_steps=self.cooldown_steps,
            label_smoothing=settings.label_smoothing,
            jit_compile=settings.jit_compile,
            accumulate_steps=settings.accumulate_steps,
            rdrop_alpha=settings.rdrop_alpha,
        )


def train(settings: TrainSettings, out_dir: str, verbose: int = 1, strategy=None) -> dict:
    """Trains (or resumes) the run in `out_dir` and returns its metrics.

    `strategy` (a `tf.distribute.Strategy`) overrides `settings.strategy`. In
    a multi-worker run only the chief writes `out_dir`; the other workers keep
    their files in a private temporary folder (see
    `keras_transformer.distribute.working_directory`) and return `{}`.
    """
    strategy = _strategy(settings, strategy)
    # Both pairs of files readable and parallel before anything is written.
    texts = (
        *read_parallel(settings.src_train, settings.tgt_train),
        *read_parallel(settings.src_valid, settings.tgt_valid),
    )
    run = _open_run(settings, out_dir, verbose, strategy)
    data = _load_data(run, settings, *texts)
    recipe = _recipe(run, settings, data)
    model = build_and_compile(data.config, run.strategy, **recipe.compile_args(settings))
    history = _fit(run, settings, model, data, recipe)
    if not run.chief:
        return {}
    if run.replicas > 1:
        # Choose, decode and save on a one-device copy: the distributed
        # model's variables belong to the strategy.
        trained = model
        model = build_and_compile(data.config, None, **recipe.compile_args(settings))
        model.set_weights(trained.get_weights())
    final, greedy = _choose_final(run, settings, model, data, history)
    atomic_save_model(model, os.path.join(run.out_dir, "model.keras"))
    atomic_write_json(os.path.join(run.out_dir, "config.json"), data.config.to_dict())
    return _validate_and_record(run, settings, model, data, history, recipe, final, greedy)


def _strategy(settings, strategy):
    """The given strategy, or the one `settings` names (None: Keras' default, off TensorFlow)."""
    if strategy is None and (
        settings.strategy != "default" or keras.backend.backend() == "tensorflow"
    ):
        # First, before other TensorFlow work: multi-worker setup needs a fresh runtime.
        strategy = make_strategy(settings.strategy)
    return strategy


def _open_run(settings, out_dir, verbose, strategy) -> _Run:
    """The run directory: checked against an earlier run, created, and its settings written."""
    chief = is_chief()
    out_dir = working_directory(out_dir)  # a private folder on non-chief workers
    resume = _check_run_directory(out_dir, settings)
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_json(
        os.path.join(out_dir, "train_config.json"),
        {**settings.identity(), **{k: getattr(settings, k) for k in RESUMABLE_FIELDS}},
    )
    return _Run(out_dir, resume, strategy, chief, verbose if chief else 0)


def automatic_tokens_per_batch(pairs, accumulate_steps=1):
    """The largest of `AUTO_TOKENS_PER_BATCH` whose epoch over `pairs` (`EncodedPairs`)
    has at least `MIN_UPDATES_PER_EPOCH` optimizer updates, else the smallest."""
    for tokens_per_batch in AUTO_TOKENS_PER_BATCH:
        if pairs.batches(tokens_per_batch) // accumulate_steps >= MIN_UPDATES_PER_EPOCH:
            return tokens_per_batch
    return AUTO_TOKENS_PER_BATCH[-1]


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


def _read_history(run) -> list:
    """The epochs recorded in the run's `history.json` (none for a new run)."""
    path = os.path.join(run.out_dir, "history.json")
    if not (run.resume and os.path.isfile(path)):
        return []
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _epochs_done(run) -> int:
    """The epochs in the chief's `history.json` (0 for a new run), the same on every worker."""
    return chief_value(run.strategy, len(_read_history(run)))


def _load_data(run, settings, src_train, tgt_train, src_valid, tgt_valid) -> _Data:
    """The tokenizer (trained on the first start), the model config and the datasets."""
    epochs_done = _epochs_done(run)
    seed = stream_seed(settings.seed, epochs_done)
    keras.utils.set_random_seed(seed)
    tokenizer = _load_or_train_tokenizer(run.out_dir, settings, run.resume, src_train, tgt_train)
    config = settings.model_config(tokenizer.vocabulary_size)
    run.log(
        f"SentencePiece vocabulary: {tokenizer.vocabulary_size} pieces (asked for "
        f"{settings.vocab_size})"
    )
    given = settings.tokens_per_batch
    # Encoded once; the automatic batch size only counts each candidate's batches.
    train_pairs = encode_pairs(src_train, tgt_train, tokenizer, config.max_length)
    tokens_per_batch = given or automatic_tokens_per_batch(train_pairs, settings.accumulate_steps)
    if not given:
        run.log(
            f"Batches: {tokens_per_batch} tokens per side (auto: the largest of "
            f"{', '.join(map(str, AUTO_TOKENS_PER_BATCH))} that gives at least "
            f"{MIN_UPDATES_PER_EPOCH} updates an epoch, or the smallest)."
        )
    sampling = settings.subword_sampling()
    train_data, train_stats = batch_pairs(
        train_pairs,
        tokens_per_batch,
        shuffle=True,
        seed=seed,
        sampling=sampling,
        tokenizer=tokenizer,
    )
    if sampling is not None:
        run.log(
            "Subword sampling: every epoch re-segments the training sentences (alpha "
            f"{sampling.alpha:g}, among "
            + ("all segmentations" if sampling.nbest == -1 else f"the {sampling.nbest} best")
            + "); validation keeps the best segmentation."
        )
    valid_data, valid_stats = batch_pairs(
        encode_pairs(src_valid, tgt_valid, tokenizer, config.max_length),
        tokens_per_batch,
        shuffle=False,
    )
    check_workers_agree(
        run.strategy,
        **{
            "SentencePiece model (CRC-32)": zlib.crc32(tokenizer.model_proto),
            "training settings (CRC-32)": zlib.crc32(_portable_identity(settings)),
            "training pairs": train_stats.kept_pairs,
            "training target tokens": train_stats.target_tokens,
            "validation pairs": valid_stats.kept_pairs,
        },
    )
    run.log(train_stats.describe("train"))
    run.log(valid_stats.describe("valid"))
    if epochs_done:
        run.log(
            f"Data order and dropout masks of this start: seed {seed} (from --seed "
            f"{settings.seed} and the {epochs_done} epochs done), not the first start's again."
        )
    if settings.rdrop_alpha:
        # The validation batches too: the loss reads its pairs, and without
        # dropout the two copies agree, so the validation loss is unchanged.
        train_data, valid_data = duplicate_rows(train_data), duplicate_rows(valid_data)
        run.log(
            f"R-Drop: every sentence twice per batch, consistency alpha {settings.rdrop_alpha:g}."
        )
    if run.replicas > 1:
        train_data = share_global_batches(train_data)
        valid_data = share_global_batches(valid_data)
        run.log(f"Training on {run.replicas} replicas ({type(run.strategy).__name__}).")
    return _Data(
        tokenizer,
        config,
        train_data,
        valid_data,
        train_stats,
        valid_stats,
        (src_valid, tgt_valid),
        tokens_per_batch,
    )


def _recipe(run, settings, data) -> _Recipe:
    """Resolves the automatic precision, warm-up and learning-rate scale, and says what they are."""
    gpus = visible_gpus()
    precision, reason = resolve_precision(settings.precision, gpus=gpu_compute_capabilities(gpus))
    # Every replica takes its share of each global batch: one update per batch.
    updates_per_epoch = max(1, data.train_stats.batches // settings.accumulate_steps)
    warmup, scale = settings.schedule(updates_per_epoch)
    total, cooldown = settings.run_length(updates_per_epoch)
    device = training_device(gpus)
    recipe = _Recipe(precision, reason, warmup, scale, updates_per_epoch, total, cooldown, device)
    peak = TransformerSchedule(data.config.hidden_dim, warmup, scale).peak()
    run.log(f"Precision: {precision} ({reason}), on {device}.")
    run.log(
        f"Learning rate: warm-up {warmup} updates ({updates_per_epoch} per epoch"
        + (f", {settings.accumulate_steps} batches each" if settings.accumulate_steps > 1 else "")
        + f"), peak {peak:.3g} (scale {scale:.3g})"
        + (
            f", falling linearly to 0 over updates {total - cooldown + 1}-{total}."
            if cooldown
            else "."
        )
    )
    return recipe


def _fit(run, settings, model, data, recipe) -> list:
    """`model.fit` with the run's callbacks, unless the budget is spent; returns the history."""
    history = _read_history(run)
    recorder = _RunRecorder(
        run.out_dir,
        history,
        settings.max_steps,
        settings.max_minutes,
        keep=max(KEEP_CHECKPOINTS, settings.average),
        strategy=run.strategy,
        select_by=settings.select_by,
        patience=settings.patience,
        # A resumed run may continue on another machine: each epoch says where it ran.
        epoch_fields={"precision": recipe.precision, "device": recipe.device},
    )
    callbacks = [
        # The recorder writes its checkpoint before the backup is taken: a
        # kill in between makes the resumed run redo that epoch, never skip it.
        recorder,
        keras.callbacks.BackupAndRestore(
            os.path.join(run.out_dir, "backup"), delete_checkpoint=False
        ),
        # Multi-worker: everyone resumes from the chief's backup, whatever its own holds.
        SyncWithChief(run.strategy),
        keras.callbacks.TensorBoard(os.path.join(run.out_dir, "logs"), update_freq="epoch"),
        _EpochProgress(settings.budget()),
    ]
    if settings.select_by == "bleu":
        callbacks.insert(0, _ValidationBleu(data.tokenizer, data.valid_pairs))
    steps_done = history[-1]["steps"] if history else 0
    spent = (
        recorder.budget_spent()
        or bool(settings.max_steps and steps_done >= settings.max_steps)
        or patience_spent(history, settings.select_by, settings.patience)
    )
    if chief_value(run.strategy, spent):  # the workers follow the chief's history
        run.log(f"{run.out_dir}: the training budget is already spent; finishing the run.")
    else:
        if run.resume and history:
            run.log(f"Resuming {run.out_dir} after epoch {len(history)}.")
        model.fit(
            data.train,
            validation_data=data.valid,
            epochs=settings.epochs if settings.epochs is not None else 10_000,
            callbacks=callbacks,
            verbose=fit_verbosity(run.verbose, sys.stdout.isatty()),
            shuffle=False,  # the dataset shuffles itself, each epoch
        )
    if run.chief and not history:
        raise RuntimeError("Training stopped before completing an epoch; nothing to save.")
    return history


def final_candidates(history, checkpoint_epochs, select_by, average, final="auto"):
    """The epoch sets the final weights may average, as `{name: [epochs]}`.

    `final="last"` / `"best"`: the last / best `average` epochs. `"auto"`:
    the last epoch, the best epoch, and the last k and best k epochs for
    k = 2 .. `average`; a set already listed is not repeated. Only epochs whose checkpoint still
    exists (`checkpoint_epochs`) take part.

    Example:

    >>> history = [{"epoch": e, "val_loss": v} for e, v in [(1, 3.0), (2, 2.0), (3, 2.5)]]
    >>> final_candidates(history, [1, 2, 3], "loss", 2)
    {'last epoch': [3], 'best epoch': [2], 'mean of last 2': [2, 3]}
    >>> final_candidates(history, [1, 2, 3], "loss", 3, final="best")
    {'mean of best 3': [1, 2, 3]}
    """
    available = set(checkpoint_epochs)
    last = [e["epoch"] for e in history if e["epoch"] in available]
    best = [e for e in ranked_epochs(history, select_by) if e in available] or last[::-1]

    def named(kind, epochs):
        k = len(epochs)
        return (f"{kind} epoch" if k == 1 else f"mean of {kind} {k}"), sorted(epochs)

    if final == "last":
        pairs = [named("last", last[-average:])]
    elif final == "best":
        pairs = [named("best", best[:average])]
    else:
        pairs = []
        for k in range(1, min(average, len(last)) + 1):
            pairs += [named("last", last[-k:]), named("best", best[:k])]
    candidates, seen = {}, set()
    for name, epochs in pairs:
        if tuple(epochs) not in seen:
            seen.add(tuple(epochs))
            candidates[name] = epochs
    return candidates


def _choose_final(run, settings, model, data, history) -> tuple[dict, dict | None]:
    """Sets `model` to the final weights (see `final_candidates`); says how they were chosen.

    A single epoch's score is the one its epoch end recorded in `history`;
    only means of checkpoints are scored here. Returns the choice and, when
    it was decoded here, the chosen weights' greedy validation scores.
    """
    paths = {_checkpoint_epoch(p): p for p in _epoch_checkpoints(run.out_dir)}
    candidates = final_candidates(
        history, paths, settings.select_by, settings.average, settings.final
    )
    key = MEASURES[settings.select_by][0]
    recorded = {e["epoch"]: e.get(key) for e in history}
    scored, decoded = [], {}
    for name, epochs in candidates.items():
        if len(candidates) == 1:
            scored.append({"name": name, "epochs": epochs})
            break
        value = recorded.get(epochs[0]) if len(epochs) == 1 else None
        if value is None:
            average_checkpoints(model, [paths[e] for e in epochs])
            if settings.select_by == "bleu":
                decoded[name] = _bleu_on(model, data.tokenizer, data.valid_pairs, beam_size=1)
                value = decoded[name]["bleu"]
            else:
                value = float(model.evaluate(data.valid, verbose=0, return_dict=True)["loss"])
        scored.append({"name": name, "epochs": epochs, key: value})
        run.log(f"  {name} (epochs {', '.join(map(str, epochs))}): {key} {value:.4g}")
    # The first of equals: the earlier candidate in `final_candidates`' order.
    chosen = min(scored, key=lambda c: _worse(settings.select_by, c.get(key, 0.0)))
    average_checkpoints(model, [paths[e] for e in chosen["epochs"]])
    run.log(f"Final weights: {chosen['name']} (epochs {', '.join(map(str, chosen['epochs']))}).")
    final = {"chosen": chosen["name"], "epochs": chosen["epochs"], "candidates": scored}
    return final, decoded.get(chosen["name"])


def _validate_and_record(run, settings, model, data, history, recipe, final, greedy) -> dict:
    """Validation BLEU of the saved model (`greedy`: its greedy scores, if known), `metrics.json`."""
    started = time.perf_counter()
    valid_scores = (
        greedy
        if greedy is not None and settings.valid_beam == 1
        else _bleu_on(
            model, data.tokenizer, data.valid_pairs, settings.valid_beam, progress=bool(run.verbose)
        )
    )
    decode_seconds = time.perf_counter() - started

    train_seconds = float(sum(e["seconds"] for e in history))
    epochs_done = len(history)
    stats = data.train_stats
    ranked = ranked_epochs(history, settings.select_by)
    metrics = {
        "epochs": epochs_done,
        "steps": history[-1]["steps"],
        "history": history,
        "train_seconds": round(train_seconds, 1),
        "target_tokens_per_second": round(stats.target_tokens * epochs_done / train_seconds),
        "tokens_per_second": round(
            (stats.source_tokens + stats.target_tokens) * epochs_done / train_seconds
        ),
        "train_data": dataclasses.asdict(stats),
        "valid_data": dataclasses.asdict(data.valid_stats),
        "select_by": settings.select_by,
        "best_epoch": ranked[0] if ranked else None,
        "stopped_by_patience": patience_spent(history, settings.select_by, settings.patience),
        "final": final,
        "averaged_checkpoints": [f"epoch-{e:03d}.weights.h5" for e in final["epochs"]],
        "valid_bleu": valid_scores["bleu"],
        "valid_bleu_lowercase": valid_scores["bleu_lowercase"],
        "valid_chrf": valid_scores["chrf"],
        "valid_bleu_signature": valid_scores["bleu_signature"],
        "valid_beam": settings.valid_beam,
        "valid_bleu_sentences": len(data.valid_pairs),
        "valid_decode_seconds": round(decode_seconds, 1),
        "precision": recipe.precision,
        "precision_setting": settings.precision,
        "precision_reason": recipe.precision_reason,
        "device": recipe.device,  # of this start; history.json says it per epoch
        "tensorflow_onednn": onednn_enabled(),  # keras_transformer.startup.prefer_onednn
        "warmup_steps": recipe.warmup_steps,
        "learning_rate_scale": recipe.learning_rate_scale,
        "total_steps": recipe.total_steps,
        "cooldown_steps": recipe.cooldown_steps,
        "updates_per_epoch": recipe.updates_per_epoch,
        "tokens_per_batch": data.tokens_per_batch,
        "accumulate_steps": settings.accumulate_steps,
        "config": data.config.to_dict(),
        "backend": keras.backend.backend(),
    }
    atomic_write_json(os.path.join(run.out_dir, "metrics.json"), metrics)
    run.log(
        f"{epochs_done} epochs, {train_seconds:.0f} s of training; validation BLEU "
        f"{valid_scores['bleu']} (lower-cased {valid_scores['bleu_lowercase']}), "
        f"chrF {valid_scores['chrf']}. Wrote {run.out_dir}"
    )
    return metrics
