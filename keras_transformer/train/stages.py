"""`train`, in stages: open the run directory, load the data, resolve the recipe,
build and fit, choose the final weights, validate and record."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
import time
import zlib

import keras

from keras_transformer.config import TransformerConfig
from keras_transformer.data.pipeline import (
    batch_pairs,
    duplicate_rows,
    encode_pairs,
    read_parallel,
)
from keras_transformer.data.shards import PreparedData
from keras_transformer.data.tokenizer import SentencePieceTokenizer
from keras_transformer.distribute import make_strategy
from keras_transformer.io_utils import atomic_save_model, atomic_write_json
from keras_transformer.precision import (
    check_backend_precision,
    gpu_compute_capabilities,
    resolve_precision,
    training_device,
    visible_gpus,
)
from keras_transformer.schedules import TransformerSchedule
from keras_transformer.startup import onednn_enabled
from keras_transformer.train.backup import AtomicBackupAndRestore
from keras_transformer.train.batch_size import automatic_batch_rule, automatic_tokens_per_batch
from keras_transformer.train.callbacks import (
    EpochProgress,
    RunRecorder,
    ValidationBleu,
    bleu_on,
    fit_verbosity,
)
from keras_transformer.train.checkpoints import (
    average_checkpoints,
    checkpoint_epoch,
    epoch_checkpoints,
    final_candidates,
    patience_spent,
    ranked_epochs,
    sort_key,
)
from keras_transformer.train.compile import build_and_compile
from keras_transformer.train.compile_cache import compile_cache
from keras_transformer.train.data_parallel import (
    SINGLE_PROCESS,
    share_backup,
    share_of_each_batch,
    start_data_parallel,
)
from keras_transformer.train.init_from import init_config, start_from
from keras_transformer.train.jax_step import ahead_of_fit
from keras_transformer.train.peers import lost_peer
from keras_transformer.train.preemption import PreemptionStop, restore_validation, stopped_result
from keras_transformer.train.run_dir import (
    finished_epochs,
    load_or_train_tokenizer,
    open_run,
    portable_identity,
    read_history,
    stream_seed,
)
from keras_transformer.train.settings import (
    KEEP_CHECKPOINTS,
    MEASURES,
    TrainSettings,
)
from keras_transformer.train.streamed import (
    DataPosition,
    PreparedBatches,
    check_prepared,
    streamed_inputs,
)


@dataclasses.dataclass
class _Data:
    tokenizer: SentencePieceTokenizer
    config: TransformerConfig
    train: object  # tf.data.Dataset: this process's share of the global batches
    valid: object
    valid_whole: object  # the global validation batches, for a one-device copy
    train_stats: object  # keras_transformer.data.pipeline.DataStats
    valid_stats: object
    valid_text: tuple  # (sources, targets): the validation files' lines
    tokens_per_batch: int  # as given, or as chosen automatically
    stream: object = None  # streamed.StreamPlan with --data: spans of the endless stream

    @functools.cached_property
    def valid_pairs(self) -> list[tuple[str, str]]:
        """The validation pairs the validation loss uses (non-empty, within max_length)."""
        encode, limit = self.tokenizer.encode, self.config.max_length
        target = self.tokenizer.encode_target
        return [
            (s, t)
            for s, t in zip(*self.valid_text, strict=True)
            if s.strip() and t.strip() and len(encode(s)) < limit and len(target(t)) < limit
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
            learning_rate=settings.learning_rate,
        )


def train(settings: TrainSettings, out_dir: str, verbose: int = 1, strategy=None) -> dict:
    """Trains (or resumes) the run in `out_dir` and returns its metrics.

    `strategy` (a `tf.distribute.Strategy`) overrides `settings.strategy`. In
    a data-parallel run of several processes only process 0 writes `out_dir`
    and returns the metrics; the others train, then remove their temporary
    folder and return `{}`.
    """
    strategy, processes = _strategy(settings, strategy)
    check_backend_precision(settings.precision)  # after JAX's runtime joined its group
    if settings.data is not None:
        # Checked before anything is written: complete, and its inputs unchanged.
        prepared = PreparedData(
            settings.data, check_inputs=True, shapes=settings.shapes(keras.backend.backend())
        )
        check_prepared(settings, prepared)
        run = open_run(settings, out_dir, verbose, strategy, processes)
        data = _load_prepared(run, settings, prepared)
    else:
        # Both pairs of files readable and parallel before anything is written.
        texts = (
            *read_parallel(settings.src_train, settings.tgt_train),
            *read_parallel(settings.src_valid, settings.tgt_valid),
        )
        run = open_run(settings, out_dir, verbose, strategy, processes)
        data = _load_data(run, settings, *texts)
    recipe = _recipe(run, settings, data)
    with compile_cache(run, settings, out_dir):
        return _train_model(run, settings, data, recipe)


def _train_model(run, settings, data, recipe) -> dict:
    """Builds, fits, chooses the final weights, validates and records (see `train`)."""
    processes = run.processes
    model = build_and_compile(data.config, run.strategy, **recipe.compile_args(settings))
    if settings.init_from is not None:
        # The starting weights; a resumed start then restores its own backup over them.
        run.log(start_from(model, settings.init_from))
    history, stop = _fit(run, settings, model, data, recipe)
    processes.leave()
    if not run.chief:
        shutil.rmtree(run.out_dir, ignore_errors=True)
        return {"stopped_by": stop.signal_name} if stop.stopped else {}
    if stop.stopped:
        return stopped_result(run, stop, history)
    if run.replicas > 1:
        # Choose, decode and save on a one-device copy: the distributed
        # model's variables belong to the strategy.
        trained = model
        model = build_and_compile(data.config, None, **recipe.compile_args(settings))
        model.set_weights(trained.get_weights())
        data = dataclasses.replace(data, valid=data.valid_whole)
    final, greedy = _choose_final(run, settings, model, data, history)
    atomic_save_model(model, os.path.join(run.out_dir, "model.keras"))
    atomic_write_json(os.path.join(run.out_dir, "config.json"), data.config.to_dict())
    return _validate_and_record(run, settings, model, data, history, recipe, final, greedy)


def _strategy(settings, strategy):
    """`(strategy, processes)`: the given one, the one `settings` names, or data parallel's."""
    if strategy is not None:
        return strategy, SINGLE_PROCESS
    if settings.strategy == "data-parallel":
        # First, before any JAX computation: joining the group starts JAX's runtime.
        processes = start_data_parallel(
            settings.coordinator, settings.num_processes, settings.process_id
        )
        return processes.distribution, processes
    if settings.strategy != "default" or keras.backend.backend() == "tensorflow":
        return make_strategy(settings.strategy), SINGLE_PROCESS
    return None, SINGLE_PROCESS


def _load_data(run, settings, src_train, tgt_train, src_valid, tgt_valid) -> _Data:
    """The tokenizer (trained on the first start), the model config and the datasets."""
    epochs_done = finished_epochs(run)
    seed = stream_seed(settings.seed, epochs_done)
    keras.utils.set_random_seed(seed)
    tokenizer = load_or_train_tokenizer(run.out_dir, settings, run.resume, src_train, tgt_train)
    if settings.init_from is not None:
        config = init_config(settings)
        run.log(
            f"Fine-tuning {settings.init_from}: its weights and tokenizer "
            f"({tokenizer.vocabulary_size} target pieces)."
        )
    else:
        config = settings.model_config(tokenizer.vocabulary_size)
        run.log(
            f"SentencePiece vocabulary: {tokenizer.vocabulary_size} pieces (asked for "
            f"{settings.vocab_size})"
        )
    given = settings.tokens_per_batch
    shapes = settings.shapes(keras.backend.backend())
    # Encoded once; the automatic batch size only counts each candidate's batches.
    train_pairs = encode_pairs(src_train, tgt_train, tokenizer, config.max_length, shapes)
    tokens_per_batch = given or automatic_tokens_per_batch(train_pairs, settings.accumulate_steps)
    if not given:
        run.log(f"Batches: {tokens_per_batch} tokens per side (auto: {automatic_batch_rule()}).")
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
        encode_pairs(src_valid, tgt_valid, tokenizer, config.max_length, shapes.evaluated()),
        tokens_per_batch,
        shuffle=False,
    )
    run.processes.check_agree(
        **{
            "SentencePiece model (CRC-32)": zlib.crc32(tokenizer.model_proto),
            "training settings (CRC-32)": zlib.crc32(portable_identity(settings)),
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
        # Validation too: the loss reads pairs; without dropout the copies agree.
        train_data, valid_data = duplicate_rows(train_data), duplicate_rows(valid_data)
        run.log(
            f"R-Drop: every sentence twice per batch, consistency alpha {settings.rdrop_alpha:g}."
        )
    train_data, valid_data, valid_whole = _shared(run, settings, train_data, valid_data)
    return _Data(
        tokenizer,
        config,
        train_data,
        valid_data,
        valid_whole,
        train_stats,
        valid_stats,
        (src_valid, tgt_valid),
        tokens_per_batch,
    )


def _load_prepared(run, settings, prepared) -> _Data:
    """`_load_data` for `--data`: the prepared tokenizer, the stream from this start's position."""
    tokenizer = prepared.tokenizer()
    if settings.init_from is not None:
        load_or_train_tokenizer(run.out_dir, settings, run.resume, [], [])  # its files copied
        config = init_config(settings)
    else:
        tokenizer.save(os.path.join(run.out_dir, "spm.model"))
        config = settings.model_config(tokenizer.vocabulary_size)
    run.log(f"SentencePiece vocabulary: {tokenizer.vocabulary_size} pieces (from {settings.data})")
    tokens_per_batch = settings.tokens_per_batch or automatic_tokens_per_batch(
        PreparedBatches(prepared), settings.accumulate_steps
    )
    if not settings.tokens_per_batch:
        run.log(f"Batches: {tokens_per_batch} tokens per side (auto: {automatic_batch_rule()}).")
    train_data, valid_data, valid_stats, valid_text, plan = streamed_inputs(
        run, settings, prepared, tokenizer, config, tokens_per_batch
    )
    # Dropout masks drawn anew each start; the data order depends on the seed alone.
    keras.utils.set_random_seed(stream_seed(settings.seed, plan.start_batches))
    train_stats = dataclasses.replace(prepared.stats(), batches=plan.batches_per_epoch)
    run.processes.check_agree(
        **{
            "SentencePiece model (CRC-32)": zlib.crc32(tokenizer.model_proto),
            "training settings (CRC-32)": zlib.crc32(portable_identity(settings)),
            "training pairs": train_stats.kept_pairs,
            "data position (batches)": plan.start_batches,
        },
    )
    run.log(train_stats.describe(f"train ({settings.data}, streamed)"))
    run.log(valid_stats.describe("valid"))
    if plan.span_batches != plan.batches_per_epoch:
        run.log(
            f"Checkpoints and validation every {settings.save_every_steps} updates "
            f"({plan.span_batches} batches; an epoch is {plan.batches_per_epoch})."
        )
    if settings.rdrop_alpha:
        train_data, valid_data = duplicate_rows(train_data), duplicate_rows(valid_data)
    if plan.readers > 1:
        run.log(
            f"Each of the {plan.readers} processes reads its own 1/{plan.readers} of the pairs "
            f"(contiguous runs of the shards), {tokens_per_batch // plan.readers} tokens a side "
            f"per batch; {plan.batches_per_epoch} global batches an epoch (one process reading "
            f"everything: {prepared.batches_per_epoch(tokens_per_batch)})."
        )
    train_data, valid_data, valid_whole = _shared(
        run, settings, train_data, valid_data, train_is_local=plan.readers > 1
    )
    return _Data(
        tokenizer,
        config,
        train_data,
        valid_data,
        valid_whole,
        train_stats,
        valid_stats,
        valid_text,
        tokens_per_batch,
        stream=plan,
    )


def _shared(run, settings, train_data, valid_data, train_is_local=False):
    """`(train, valid, valid_whole)`: this process's share of the global batches, and the
    whole validation batches for a one-device copy. `train_is_local`: the training
    batches are already this process's own (`streamed_inputs`)."""
    valid_whole = valid_data
    processes = run.processes
    if processes.distribution is not None:
        paired = bool(settings.rdrop_alpha)
        if not train_is_local:
            train_data = share_of_each_batch(train_data, processes, paired_rows=paired)
        valid_data = share_of_each_batch(valid_data, processes, paired_rows=paired)
        run.log(
            f"Training on {processes.devices} devices of {processes.count} "
            f"process{'es' * (processes.count > 1)} (keras.distribution.DataParallel); "
            "process 0 writes the run directory."
        )
    elif run.replicas > 1:
        run.log(f"Training on {run.replicas} replicas ({type(run.strategy).__name__}).")
    return train_data, valid_data, valid_whole


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
    schedule = TransformerSchedule(
        data.config.hidden_dim, warmup, scale, constant=settings.learning_rate
    )
    peak = schedule.peak()
    run.log(f"Precision: {precision} ({reason}), on {device}.")
    run.log(
        f"Learning rate: warm-up {warmup} updates ({updates_per_epoch} per epoch"
        + (f", {settings.accumulate_steps} batches each" if settings.accumulate_steps > 1 else "")
        + (
            f"), then constant at {peak:.3g}"
            if settings.learning_rate
            else f"), peak {peak:.3g} (scale {scale:.3g})"
        )
        + (
            f", falling linearly to 0 over updates {total - cooldown + 1}-{total}."
            if cooldown
            else "."
        )
    )
    return recipe


def _fit(run, settings, model, data, recipe) -> tuple[list, PreemptionStop]:
    """`model.fit` with the run's callbacks, unless the budget is spent; returns the history
    and the `PreemptionStop` that says whether a signal stopped it."""
    history = read_history(run)
    stop = PreemptionStop(run.processes, resumes_mid_epoch=data.stream is not None)
    recorder = RunRecorder(
        run.out_dir,
        history,
        settings.max_steps,
        settings.max_minutes,
        keep=max(KEEP_CHECKPOINTS, settings.average),
        processes=run.processes,
        select_by=settings.select_by,
        patience=settings.patience,
        # A resumed run may continue on another machine: each epoch says where it ran.
        epoch_fields={"precision": recipe.precision, "device": recipe.device},
        stop=stop,
    )
    # Several processes: every one restores process 0's backup (restoring is a collective).
    backup = os.path.join(run.out_dir, "backup")
    share_backup(run.processes, backup)
    callbacks = [
        # The recorder writes its checkpoint before the backup is taken: a
        # kill in between makes the resumed run redo that epoch, never skip it.
        recorder,
        AtomicBackupAndRestore(backup, stop=stop, delete_checkpoint=False),
        keras.callbacks.TensorBoard(os.path.join(run.out_dir, "logs"), update_freq="epoch"),
        EpochProgress(settings.budget()),
    ]
    # Validate every `every` spans (`--validate-every-steps`), else at each one.
    every = 1
    if settings.validate_every_steps:
        every = settings.validate_every_steps // settings.save_every_steps
    callbacks += [stop, *ahead_of_fit(data, settings, run.log)]
    if settings.select_by == "bleu":
        callbacks.insert(
            0, ValidationBleu(data.tokenizer, data.valid_pairs, every, run.processes, stop)
        )
    fit_args = {"epochs": settings.epochs if settings.epochs is not None else 10_000}
    if data.stream is not None:
        plan = data.stream
        fit_args = {
            "epochs": plan.keras_epochs,
            "steps_per_epoch": plan.span_batches,
            "validation_freq": every,
        }
        # Before the recorder's checkpoint and the backup: see `streamed`.
        position = DataPosition(
            run.out_dir,
            plan.start_batches,
            plan.batches_per_epoch,
            plan.max_batches,
            run.chief,
            plan.readers,
        )
        callbacks.insert(0, position)
    steps_done = history[-1]["steps"] if history else 0
    spent = (
        recorder.budget_spent()
        or bool(settings.max_steps and steps_done >= settings.max_steps)
        or patience_spent(history, settings.select_by, settings.patience)
    )
    if run.processes.first_value(spent):  # the others follow process 0's history
        run.log(f"{run.out_dir}: the training budget is already spent; finishing the run.")
    else:
        if run.resume and history:
            run.log(f"Resuming {run.out_dir} after epoch {len(history)}.")
        with run.processes.scope():
            try:
                _fit_model(run, settings, model, data, callbacks, fit_args)
            except Exception as error:
                if run.processes.watch is not None:
                    lost_peer(run.processes.watch, error)  # ends the process if a peer died
                raise
            finally:
                restore_validation(model)
    if run.chief and not history and not stop.stopped:
        raise RuntimeError("Training stopped before completing an epoch; nothing to save.")
    return history, stop


def _fit_model(run, settings, model, data, callbacks, fit_args):
    model.fit(
        data.train,
        validation_data=data.valid,
        callbacks=callbacks,
        verbose=fit_verbosity(run.verbose, sys.stdout.isatty()),
        shuffle=False,  # the dataset shuffles itself, each epoch
        **fit_args,
    )


def _choose_final(run, settings, model, data, history) -> tuple[dict, dict | None]:
    """Sets `model` to the final weights (see `final_candidates`); says how they were chosen.

    A single epoch's score is the one its epoch end recorded in `history`;
    only means of checkpoints are scored here. Returns the choice and, when
    it was decoded here, the chosen weights' greedy validation scores.
    """
    paths = {checkpoint_epoch(p): p for p in epoch_checkpoints(run.out_dir)}
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
                decoded[name] = bleu_on(model, data.tokenizer, data.valid_pairs, beam_size=1)
                value = decoded[name]["bleu"]
            else:
                value = float(model.evaluate(data.valid, verbose=0, return_dict=True)["loss"])
        scored.append({"name": name, "epochs": epochs, key: value})
        run.log(f"  {name} (epochs {', '.join(map(str, epochs))}): {key} {value:.4g}")
    # The first of equals: the earlier candidate in `final_candidates`' order.
    chosen = min(scored, key=lambda c: sort_key(settings.select_by, c.get(key, 0.0)))
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
        else bleu_on(
            model, data.tokenizer, data.valid_pairs, settings.valid_beam, progress=bool(run.verbose)
        )
    )
    decode_seconds = time.perf_counter() - started

    train_seconds = float(sum(e["seconds"] for e in history))
    epochs_done = len(history)
    stats = data.train_stats
    # Passes over the data: epochs, or with --data the spans' share of one (`streamed`).
    passes = history[-1].get("data_epochs", epochs_done)
    ranked = ranked_epochs(history, settings.select_by)
    metrics = {
        "epochs": epochs_done,
        "steps": history[-1]["steps"],
        "history": history,
        "train_seconds": round(train_seconds, 1),
        "target_tokens_per_second": round(stats.target_tokens * passes / train_seconds),
        "tokens_per_second": round(
            (stats.source_tokens + stats.target_tokens) * passes / train_seconds
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
