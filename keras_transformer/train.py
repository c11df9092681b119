"""Training on parallel text files: the `keras-transformer train` command.

A run directory holds everything a run needs and produces:

- `train_config.json`: the settings that define the run; a rerun with other
  settings is refused (the stopping criteria `epochs`, `max_steps`,
  `max_minutes` and `average_last` may change, so a finished run can be
  extended).
- `spm.model`: the joint SentencePiece model, trained on the first start.
- `backup/`: Keras `BackupAndRestore` state (weights and optimizer) of the last
  completed epoch; rerunning the same command resumes from it.
- `checkpoints/epoch-NNN.weights.h5`: the weights after each of the last epochs,
  for checkpoint averaging.
- `model.keras`, `config.json`, `metrics.json`, and TensorBoard logs in `logs/`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import time
import zlib

import keras
import numpy as np

from keras_transformer.config import TransformerConfig
from keras_transformer.data.pipeline import DataError, make_dataset, read_parallel
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
from keras_transformer.training import (
    LabelSmoothedCrossEntropy,
    MaskedAccuracy,
    transformer_optimizer,
)

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
# Settings that only say when to stop or how to finish; changing them resumes the run.
RESUMABLE_FIELDS = (
    "epochs",
    "max_steps",
    "max_minutes",
    "average_last",
    "valid_beam",
    "strategy",
)
KEEP_CHECKPOINTS = 5


class RunDirectoryError(ValueError):
    """The run directory belongs to another configuration or is not a run directory."""


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
    tokens_per_batch: int = 4096
    precision: str = "float32"
    label_smoothing: float = 0.1
    warmup_steps: int = 4000
    learning_rate_scale: float = 1.0
    vocab_size: int = DEFAULT_VOCABULARY_SIZE
    dropout: float | None = None
    attention_dropout: float | None = None
    seed: int = 0
    average_last: int | None = None
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
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {', '.join(PRECISIONS)}. "
                f"Received: precision={self.precision!r}"
            )
        if self.epochs is None and self.max_steps is None and self.max_minutes is None:
            self.epochs = 10
        for name in ("epochs", "max_steps", "average_last", "tokens_per_batch", "warmup_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer. Received: {name}={value}")
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
        overrides = {"vocabulary_size": vocabulary_size}
        if self.dropout is not None:
            overrides["dropout"] = self.dropout
        if self.attention_dropout is not None:
            overrides["attention_dropout"] = self.attention_dropout
        return TransformerConfig.from_preset(self.preset, **overrides)


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
    previous_identity = {k: v for k, v in previous.items() if k not in RESUMABLE_FIELDS}
    current = settings.identity()
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


class _RunRecorder(keras.callbacks.Callback):
    """Keeps `history.json` (per-epoch metrics and seconds), epoch checkpoints, and stops.

    Stops at the end of an epoch when `max_minutes` of training (summed over
    restarts) would be exceeded by one more epoch like the last, and after
    `max_steps` optimizer steps.
    """

    def __init__(
        self,
        out_dir,
        history,
        max_steps=None,
        max_minutes=None,
        keep=KEEP_CHECKPOINTS,
        strategy=None,
    ):
        super().__init__()
        self.strategy = strategy
        self.out_dir = out_dir
        self.history = history
        self.max_steps = max_steps
        self.max_seconds = None if max_minutes is None else 60.0 * max_minutes
        self.keep = keep
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
        self.history.append(entry)
        path = os.path.join(self.checkpoint_dir, f"epoch-{epoch + 1:03d}.weights.h5")
        with atomic_path(path, suffix=".weights.h5") as tmp:
            self.model.save_weights(tmp)
        for old in _epoch_checkpoints(self.out_dir)[: -self.keep]:
            os.remove(old)
        atomic_write_json(os.path.join(self.out_dir, "history.json"), self.history)
        # Each worker times itself; all stop when the chief does.
        if chief_value(self.strategy, self.budget_spent()):
            self.model.stop_training = True


def _epoch_checkpoints(out_dir):
    paths = glob.glob(os.path.join(out_dir, "checkpoints", "epoch-*.weights.h5"))
    return sorted(paths, key=lambda p: int(re.search(r"epoch-(\d+)", p).group(1)))


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
) -> keras.Model:
    """Builds `config` under `strategy`'s scope in `precision` and compiles it for training.

    Adam with the paper's schedule, `LabelSmoothedCrossEntropy` and
    `MaskedAccuracy`; `mixed_float16` gets Keras' loss scaling. `strategy`
    None is the default (one-device) strategy.

    Example:

    >>> strategy = make_strategy("mirrored")  # keras_transformer.distribute
    >>> model = build_and_compile(TransformerConfig.from_preset("small"), strategy)
    >>> model.fit(dataset, epochs=10)  # doctest: +SKIP
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(PRECISIONS)}. Received: {precision!r}"
        )
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    previous_policy = keras.config.dtype_policy()
    with scope:
        keras.config.set_dtype_policy(precision)
        try:
            model = build_transformer(config)
        finally:
            keras.config.set_dtype_policy(previous_policy)
        model.compile(
            optimizer=transformer_optimizer(config.hidden_dim, warmup_steps, learning_rate_scale),
            loss=LabelSmoothedCrossEntropy(label_smoothing),
            metrics=[MaskedAccuracy()],
            jit_compile=jit_compile,
        )
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
    compile_args = dict(
        precision=settings.precision,
        warmup_steps=settings.warmup_steps,
        learning_rate_scale=settings.learning_rate_scale,
        label_smoothing=settings.label_smoothing,
        jit_compile=settings.jit_compile,
    )
    model = build_and_compile(data.config, run.strategy, **compile_args)
    history = _fit(run, settings, model, data)
    if not run.chief:
        return {}
    if run.replicas > 1:
        # Decode and save a one-device copy: the distributed model's variables
        # belong to the strategy.
        trained = model
        model = build_and_compile(data.config, None, **compile_args)
        model.set_weights(trained.get_weights())
    averaged = _save_model(run, settings, model, data.config)
    return _validate_and_record(run, settings, model, data, history, averaged)


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


def _load_data(run, settings, src_train, tgt_train, src_valid, tgt_valid) -> _Data:
    """The tokenizer (trained on the first start), the model config and the datasets."""
    keras.utils.set_random_seed(settings.seed)
    tokenizer = _load_or_train_tokenizer(run.out_dir, settings, run.resume, src_train, tgt_train)
    config = settings.model_config(tokenizer.vocabulary_size)
    run.log(
        f"SentencePiece vocabulary: {tokenizer.vocabulary_size} pieces (asked for "
        f"{settings.vocab_size})"
    )
    batching = (tokenizer, config.max_length, settings.tokens_per_batch)
    train_data, train_stats = make_dataset(
        src_train, tgt_train, *batching, shuffle=True, seed=settings.seed
    )
    valid_data, valid_stats = make_dataset(src_valid, tgt_valid, *batching, shuffle=False)
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
    if run.replicas > 1:
        train_data = share_global_batches(train_data)
        valid_data = share_global_batches(valid_data)
        run.log(f"Training on {run.replicas} replicas ({type(run.strategy).__name__}).")
    return _Data(
        tokenizer, config, train_data, valid_data, train_stats, valid_stats, (src_valid, tgt_valid)
    )


def _fit(run, settings, model, data) -> list:
    """`model.fit` with the run's callbacks, unless the budget is spent; returns the history."""
    history_path = os.path.join(run.out_dir, "history.json")
    history = []
    if run.resume and os.path.isfile(history_path):
        with open(history_path, encoding="utf-8") as f:
            history = json.load(f)
    recorder = _RunRecorder(
        run.out_dir,
        history,
        settings.max_steps,
        settings.max_minutes,
        keep=max(KEEP_CHECKPOINTS, settings.average_last or 0),
        strategy=run.strategy,
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
    steps_done = history[-1]["steps"] if history else 0
    spent = recorder.budget_spent() or bool(settings.max_steps and steps_done >= settings.max_steps)
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
            verbose=run.verbose,
            shuffle=False,  # the dataset shuffles itself, each epoch
        )
    if run.chief and not history:
        raise RuntimeError("Training stopped before completing an epoch; nothing to save.")
    return history


def _save_model(run, settings, model, config) -> list:
    """Loads the last (or the average of the last K) epoch weights and saves the model."""
    checkpoints = _epoch_checkpoints(run.out_dir)
    if settings.average_last and settings.average_last > 1:
        chosen = checkpoints[-settings.average_last :]
        average_checkpoints(model, chosen)
        averaged = [os.path.basename(p) for p in chosen]
        run.log(f"Averaged {len(chosen)} checkpoints: {', '.join(averaged)}")
    else:
        model.load_weights(checkpoints[-1])
        averaged = [os.path.basename(checkpoints[-1])]
    atomic_save_model(model, os.path.join(run.out_dir, "model.keras"))
    atomic_write_json(os.path.join(run.out_dir, "config.json"), config.to_dict())
    return averaged


def _validate_and_record(run, settings, model, data, history, averaged) -> dict:
    """Validation BLEU of the saved model, and `metrics.json`."""
    from keras_transformer.evaluation import score_translations
    from keras_transformer.translation import translate_lines

    # The same pairs the validation loss used: non-empty, within max_length.
    tokenizer, max_length = data.tokenizer, data.config.max_length
    pairs = [
        (s, t)
        for s, t in zip(*data.valid_text, strict=True)
        if s.strip()
        and t.strip()
        and len(tokenizer.encode(s)) < max_length
        and len(tokenizer.encode(t)) < max_length
    ]
    started = time.perf_counter()
    hypotheses = translate_lines(
        model,
        tokenizer,
        [s for s, _ in pairs],
        beam_size=settings.valid_beam,
        batch_size=64,
        progress=bool(run.verbose),
    )
    valid_scores = score_translations(hypotheses, [t for _, t in pairs])
    decode_seconds = time.perf_counter() - started

    train_seconds = float(sum(e["seconds"] for e in history))
    epochs_done = len(history)
    stats = data.train_stats
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
        "averaged_checkpoints": averaged,
        "valid_bleu": valid_scores["bleu"],
        "valid_bleu_lowercase": valid_scores["bleu_lowercase"],
        "valid_chrf": valid_scores["chrf"],
        "valid_bleu_signature": valid_scores["bleu_signature"],
        "valid_beam": settings.valid_beam,
        "valid_bleu_sentences": len(pairs),
        "valid_decode_seconds": round(decode_seconds, 1),
        "precision": settings.precision,
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
