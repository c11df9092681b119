"""The settings of a training run: one definition per option.

Each `TrainSettings` field is one option of `keras-transformer train`: its
default, its help (`metadata["help"]`, where `%(default)s` stands for the
default) and its choices (`metadata["choices"]`) are written here once, and
the command's parser is generated from them (`keras_transformer.cli`). The
fields are grouped (`metadata["group"]`, one of `GROUPS`) as the help lists
them. The automatic values (batch size, warm-up, learning-rate scale, the
measure that ranks epochs) are resolved here too, by the code the help
describes them from.
"""

from __future__ import annotations

import dataclasses
import math
import os

from keras_transformer.checks import check_consistency
from keras_transformer.config import SHAPE_FIELDS, TransformerConfig, preset_config
from keras_transformer.data.pipeline import (
    BATCH_SHAPES,
    BatchShapes,
    DataError,
    SubwordSampling,
    check_batch_fits,
)
from keras_transformer.data.tokenizer import DEFAULT_VOCABULARY_SIZE, MIN_VOCABULARY_SIZE
from keras_transformer.distribute import STRATEGIES, check_strategy
from keras_transformer.precision import CHOICES as PRECISION_CHOICES
from keras_transformer.train.batch_size import automatic_batch_rule

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
    "compile_cache",
    # Where this process sits in a data-parallel run: differs between processes and starts.
    "coordinator",
    "num_processes",
    "process_id",
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

# Validation measure: history key, and whether larger is better.
MEASURES = {"loss": ("val_loss", False), "bleu": ("val_bleu", True)}

FINAL_CHOICES = ("auto", "last", "best")

# Epochs when no budget (epochs, max_steps, max_minutes) is given.
DEFAULT_EPOCHS = 10


def default_select_by(strategy: str) -> str:
    """The measure that ranks epochs when none is asked for: greedy validation
    BLEU, the one a translation is judged by, with every strategy."""
    return "bleu"


# The groups of options, in the order the help lists them: {group: title}.
GROUPS = {
    "data": "data",
    "model": "model: a preset, and the shape options that override it (default: the preset's)",
    "optimisation": "optimisation",
    "regularisation": "regularisation",
    "stopping": "when to stop (any that is reached first)",
    "selection": "choosing on the validation set",
    "devices": "precision and devices",
}


def option(default=dataclasses.MISSING, *, group, help=None, choices=None, metavar=None):
    """A `TrainSettings` field and the command-line option it is: the field's default,
    and in its metadata the option's group (a key of `GROUPS`), help, choices and
    metavar. In `help`, `%(default)s` stands for the default."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {', '.join(GROUPS)}. Received: group={group!r}")
    metadata = {"group": group, "help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if metavar is not None:
        metadata["metavar"] = metavar
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class TrainSettings:
    """Everything that defines a training run (written to `train_config.json`).

    One field per option of `keras-transformer train` (`option`): the parser
    is generated from these fields, their defaults, help and choices.
    """

    # Data: the parallel text files (or a prepared directory) and the joint vocabulary.
    src_train: str | None = option(
        None, group="data", help="source side (plain or .gz); or give --data"
    )
    tgt_train: str | None = option(None, group="data", help="target side, parallel to --src-train")
    src_valid: str | None = option(
        None,
        group="data",
        help="validation source side (plain or .gz): ranks the epochs and gives the final BLEU "
        "(default with --data: the validation files prepare copied)",
    )
    tgt_valid: str | None = option(
        None, group="data", help="validation target side, parallel to --src-valid"
    )
    # A directory written by `keras-transformer prepare`: its shards are streamed
    # from disk and its SentencePiece model is the run's (keras_transformer.data.shards).
    data: str | None = option(
        None,
        group="data",
        metavar="DIR",
        help="train on a directory written by keras-transformer prepare, streamed from disk "
        "in bounded memory, instead of --src-train/--tgt-train",
    )
    vocab_size: int = option(
        DEFAULT_VOCABULARY_SIZE,
        group="data",
        help="joint SentencePiece vocabulary size (default %(default)s)",
    )
    # The model: a preset (TransformerConfig.from_preset), its shape fields
    # (SHAPE_FIELDS) overridable; None: the preset's.
    preset: str = option("small", group="model", help="model preset (default: %(default)s)")
    num_layers: int | None = option(
        None, group="model", help="encoder layers, and as many decoder layers"
    )
    num_encoder_layers: int | None = option(
        None, group="model", help="encoder layers (default: --num-layers, or the preset's)"
    )
    num_decoder_layers: int | None = option(
        None,
        group="model",
        help="decoder layers (default: --num-layers, or the preset's); a shallow decoder "
        "translates faster: the decoder runs once per output token",
    )
    hidden_dim: int | None = option(None, group="model", help="d_model")
    intermediate_dim: int | None = option(
        None, group="model", help="d_ff, the feed-forward inner width"
    )
    num_heads: int | None = option(
        None, group="model", help="attention heads; must divide --hidden-dim"
    )
    # None: the preset's; True: LayerNorm before each sublayer (pre-norm).
    normalize_first: bool | None = option(
        None,
        group="model",
        help="pre-norm: LayerNorm before each sublayer instead of after the residual sum "
        "(default: the preset's, post-norm as in the paper)",
    )
    # Fine-tuning: the model, its weights and its tokenizer from another run.
    init_from: str | None = option(
        None,
        group="model",
        metavar="RUN",
        help="start from RUN's weights and tokenizer (an imported Marian model, or any "
        "run): no SentencePiece model is trained and the shape is RUN's; fewer layers "
        "(--num-*-layers) start from RUN's spread out (a student)",
    )
    # Optimisation: batches, the learning-rate schedule (TransformerSchedule), the seed.
    # Padded tokens per batch on each side; None: automatic (automatic_tokens_per_batch).
    tokens_per_batch: int | None = option(
        None,
        group="optimisation",
        help=f"padded tokens per batch on each side (default: {automatic_batch_rule()})",
    )
    # Batches whose gradients are averaged into one update.
    accumulate_steps: int = option(
        1,
        group="optimisation",
        help="average the gradients of N batches per update: N times the batch on one device "
        "(default %(default)s)",
    )
    # None: WARMUP_EPOCHS epochs of updates, at most the paper's 4000.
    warmup_steps: int | None = option(
        None,
        group="optimisation",
        help=f"warm-up updates (default: {WARMUP_EPOCHS} epochs of updates, at most the "
        f"paper's {PAPER_WARMUP_STEPS})",
    )
    # None: sqrt(warmup_steps / 4000), the paper's peak learning rate for the width.
    learning_rate_scale: float | None = option(
        None,
        group="optimisation",
        help="multiplier on the paper's learning-rate curve (default: "
        f"sqrt(warmup / {PAPER_WARMUP_STEPS}), which keeps the paper's peak learning rate "
        "for the model width)",
    )
    # None: the paper's curve; a number: constant after the warm-up (fine-tuning).
    learning_rate: float | None = option(
        None,
        group="optimisation",
        help="a constant learning rate after the linear warm-up, for fine-tuning (e.g. 5e-5 "
        "with --warmup-steps 100), instead of the paper's inverse-square-root curve",
    )
    # The last fraction of the run's updates (epochs or max_steps) over which the
    # learning rate falls linearly to zero; None: none, the paper's curve.
    cooldown: float | None = option(
        None,
        group="optimisation",
        metavar="FRACTION",
        help="let the learning rate fall linearly to zero over this last fraction of the "
        "run's updates (needs --epochs or --max-steps; default: none, the paper's inverse "
        "square root to the end)",
    )
    seed: int = option(
        0,
        group="optimisation",
        help="seed of the initial weights, the data order, the dropout masks and the "
        "SentencePiece model (default %(default)s; a resumed start derives its own from it)",
    )
    # Regularisation.
    dropout: float | None = option(
        None, group="regularisation", help="override the preset's dropout"
    )
    attention_dropout: float | None = option(
        None,
        group="regularisation",
        help="dropout on the attention weights alone (default: --dropout; 0 as in the paper "
        "lets training use the fused attention kernel)",
    )
    label_smoothing: float = option(
        0.1,
        group="regularisation",
        help="label smoothing of the loss (default %(default)s, the paper's)",
    )
    # R-Drop's alpha: every training sentence goes through the model twice per
    # step, with different dropout masks, and the loss adds alpha times the
    # symmetric KL divergence between the two predictions; 0: off.
    rdrop_alpha: float = option(
        0.0,
        group="regularisation",
        metavar="ALPHA",
        help="R-Drop: run every training sentence twice per step (two dropout masks) and add "
        "ALPHA times the symmetric KL divergence of the two predictions to the loss; each "
        "step computes twice the sentences (default %(default)s: off)",
    )
    # Subword regularization: sample each training sentence's segmentation anew
    # every epoch with this alpha (SubwordSampling); None: the one best segmentation.
    subword_alpha: float | None = option(
        None,
        group="regularisation",
        metavar="ALPHA",
        help="subword regularization: segment every training sentence anew each epoch, "
        "sampling from the SentencePiece model with this smoothing (e.g. 0.1; smaller "
        "samples more freely). Default: the one best segmentation",
    )
    # Sample among this many best segmentations (-1: all); used with subword_alpha.
    subword_nbest: int = option(
        64,
        group="regularisation",
        metavar="L",
        help="with --subword-alpha, sample among the L best segmentations, or all with -1 "
        "(default %(default)s)",
    )
    # When to stop: whichever budget is reached first (also `patience`).
    epochs: int | None = option(
        None,
        group="stopping",
        help=f"epochs (default {DEFAULT_EPOCHS} when nothing else is set)",
    )
    max_steps: int | None = option(None, group="stopping", help="optimizer steps")
    max_minutes: float | None = option(
        None,
        group="stopping",
        help="training time; stops after the epoch where one more would exceed it",
    )
    # The validation measure that ranks epochs: "loss" or "bleu" (greedy); None:
    # "bleu", the measure a translation is judged by.
    select_by: str | None = option(
        None,
        group="selection",
        choices=MEASURES,
        help="the measure that ranks epochs: greedy BLEU, decoded after every epoch "
        "(default), or validation loss",
    )
    # Stop after this many epochs without a better validation measure.
    patience: int | None = option(
        None,
        group="selection",
        help="stop after K epochs without a better validation measure",
    )
    # Largest number of epoch checkpoints averaged into the final weights.
    average: int = option(
        KEEP_CHECKPOINTS,
        group="selection",
        help="average at most K epoch checkpoints into the final weights (default "
        "%(default)s, the checkpoints train keeps)",
    )
    # "auto": the candidate best on validation; "last" / "best": the mean of the
    # last / best `average` epochs.
    final: str = option(
        "auto",
        group="selection",
        choices=FINAL_CHOICES,
        help="final weights: auto tries the last and the best epoch and the means of the "
        "last k and best k for k <= --average, and keeps the best on validation; last / "
        "best: the mean of the last / best --average epochs (default: %(default)s)",
    )
    # Checkpoint (with the data position) and validate every N updates; None:
    # once per epoch. Needs `data`: only a prepared dataset resumes mid-epoch.
    save_every_steps: int | None = option(
        None,
        group="selection",
        metavar="N",
        help="with --data: validate and write a checkpoint every N updates instead of every "
        "epoch; a killed run resumes at the last one, at the same batch of its epoch. The "
        "checkpoints, history and --average then count these N-update spans",
    )
    # Validate every M updates, a multiple of save_every_steps; None: at every checkpoint.
    validate_every_steps: int | None = option(
        None,
        group="selection",
        metavar="M",
        help="with --save-every-steps N: validate every M updates only (a multiple of N); "
        "the checkpoints between are kept as the last ones but not ranked (default: M = N)",
    )
    valid_beam: int = option(
        1,
        group="selection",
        help="beam size for the final validation BLEU (default %(default)s: greedy)",
    )
    # Precision and devices.
    # "auto": bfloat16 where the hardware computes in it, else float32.
    precision: str = option(
        "auto",
        group="devices",
        choices=PRECISION_CHOICES,
        help="auto: mixed_bfloat16 on a GPU or CPU that computes in bfloat16 (AVX512_BF16, "
        "AMX), float32 elsewhere and on any CPU under JAX (default: %(default)s)",
    )
    jit_compile: bool = option(
        False,
        group="devices",
        help="TensorFlow: compile the train step with XLA (JAX always compiles it)",
    )
    # "auto": `few` where the train step is compiled per batch shape (JAX, --jit-compile).
    batch_shapes: str = option(
        "auto",
        group="devices",
        choices=("auto", *BATCH_SHAPES),
        help="fine: length buckets 10%% apart, the least padding; few: buckets 25%% apart and "
        "a fixed row count per bucket, one shape per bucket, for a train step compiled per "
        "shape; auto: few under JAX or --jit-compile, else fine (default: %(default)s)",
    )
    # No argparse choices: a retired name gets its own message (check_strategy).
    strategy: str = option(
        "default",
        group="devices",
        metavar="{" + ",".join(STRATEGIES) + "}",
        help="default, one device; mirrored, all GPUs of this machine (tf.distribute); "
        "data-parallel, the devices of every process of the run (KERAS_BACKEND=jax, "
        "keras.distribution; see --coordinator) (default: %(default)s)",
    )
    # JAX's persistent compilation cache; None: the run's own (`stages.compile_cache_folder`).
    compile_cache: str | None = option(
        None,
        group="devices",
        metavar="DIR",
        help="JAX: keep the compiled train and validation steps in DIR, so that a restart "
        "compiles nothing again (default: OUT/compile_cache on process 0, a folder of the "
        "system's temporary directory on the others)",
    )
    # A data-parallel run of several processes (hosts); None: Keras' environment
    # variables (keras_transformer.train.data_parallel), else one process.
    coordinator: str | None = option(
        None,
        group="devices",
        metavar="HOST:PORT",
        help="data-parallel: process 0's address, the same on every process (default: "
        "$KERAS_DISTRIBUTION_JOB_ADDRESSES)",
    )
    num_processes: int | None = option(
        None,
        group="devices",
        metavar="N",
        help="data-parallel: processes in the run (default: $KERAS_DISTRIBUTION_NUM_PROCESSES, "
        "else 1)",
    )
    process_id: int | None = option(
        None,
        group="devices",
        metavar="I",
        help="data-parallel: this process, 0 to N-1; process 0 writes --out (default: "
        "$KERAS_DISTRIBUTION_PROCESS_ID)",
    )

    def __post_init__(self):
        check_strategy(self.strategy)
        if self.strategy != "data-parallel" and (
            self.coordinator is not None
            or self.num_processes is not None
            or self.process_id is not None
        ):
            raise ValueError(
                "coordinator, num_processes and process_id place a process in a data-parallel "
                f"run; they need strategy='data-parallel'. Received: strategy={self.strategy!r}"
            )
        if self.select_by is None:
            self.select_by = default_select_by(self.strategy)
        for name, value, choices in (
            ("precision", self.precision, PRECISION_CHOICES),
            ("select_by", self.select_by, tuple(MEASURES)),
            ("final", self.final, FINAL_CHOICES),
            ("batch_shapes", self.batch_shapes, ("auto", *BATCH_SHAPES)),
        ):
            if value not in choices:
                raise ValueError(
                    f"{name} must be one of {', '.join(choices)}. Received: {name}={value!r}"
                )
        if self.epochs is None and self.max_steps is None and self.max_minutes is None:
            self.epochs = DEFAULT_EPOCHS
        for name in (
            "epochs",
            "max_steps",
            "tokens_per_batch",
            "warmup_steps",
            "accumulate_steps",
            "patience",
            "average",
            "save_every_steps",
            "validate_every_steps",
            *SHAPE_FIELDS,
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer. Received: {name}={value}")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive. Received: {self.learning_rate}")
        if self.init_from is not None:
            from keras_transformer.train.init_from import check_init_from

            check_init_from(self)
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
        if self.rdrop_alpha and self.strategy == "mirrored":
            raise ValueError(
                "rdrop_alpha pairs the two copies of a sentence within one device's batch; "
                "tf.distribute splits them over replicas. Use strategy='default', or "
                "'data-parallel', where the loss sees the whole global batch."
            )
        if self.init_from is None and self.data is None and self.vocab_size < MIN_VOCABULARY_SIZE:
            raise ValueError(  # checked before the run directory is written, not at training
                f"vocab_size must be at least {MIN_VOCABULARY_SIZE} (256 byte pieces and the "
                f"special tokens). Received: vocab_size={self.vocab_size}"
            )
        config = self.model_config(self.vocab_size)  # the preset and shape build, or say why not
        if self.tokens_per_batch is not None:
            check_batch_fits(self.tokens_per_batch, config.max_length)
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be positive. Received: {self.max_minutes}")
        if self.valid_beam < 1:
            raise ValueError(f"valid_beam must be a positive integer. Received: {self.valid_beam}")
        self._check_data_files()

    def _check_data_files(self):
        """Text files or a prepared directory, and validation files, all present."""
        if self.save_every_steps is not None and self.data is None:
            raise ValueError(
                "save_every_steps needs a prepared dataset (--data): only it resumes in the "
                "middle of an epoch. Run keras-transformer prepare first."
            )
        if self.validate_every_steps is not None and (
            self.save_every_steps is None or self.validate_every_steps % self.save_every_steps
        ):
            raise ValueError(
                "validate_every_steps must be a multiple of save_every_steps (validation "
                "comes with a checkpoint). Received: "
                f"validate_every_steps={self.validate_every_steps}, "
                f"save_every_steps={self.save_every_steps}"
            )
        if (self.src_valid is None) != (self.tgt_valid is None):
            raise ValueError("Give both --src-valid and --tgt-valid, or neither.")
        paths = [self.src_valid, self.tgt_valid]
        if self.data is None:
            for name in ("src_train", "tgt_train", "src_valid", "tgt_valid"):
                if getattr(self, name) is None:
                    raise ValueError(
                        f"{name} is required (--{name.replace('_', '-')}), or train on a "
                        "prepared directory with --data."
                    )
            paths += [self.src_train, self.tgt_train]
        else:
            if self.src_train is not None or self.tgt_train is not None:
                raise ValueError(
                    "Give either --data or --src-train/--tgt-train: the prepared directory "
                    "holds the training pairs."
                )
            if not os.path.isdir(self.data):
                raise DataError(f"Prepared data directory not found: {self.data}")
        for path in paths:
            if path is not None and not os.path.isfile(path):
                raise DataError(f"File not found: {path}")

    def identity(self) -> dict:
        """The settings that must match to resume (file paths made absolute)."""
        values = dataclasses.asdict(self)
        for name in RESUMABLE_FIELDS:
            values.pop(name)
        for name in ("src_train", "tgt_train", "src_valid", "tgt_valid", "data", "init_from"):
            if values[name] is not None:
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

    def shapes(self, backend: str) -> BatchShapes:
        """The `BatchShapes` of the run's batches under Keras backend `backend`."""
        name = self.batch_shapes
        if name == "auto":
            name = "few" if backend == "jax" or self.jit_compile else "fine"
        return BATCH_SHAPES[name]

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
