"""The train / evaluate / translate commands end to end on a generated corpus."""

import io
import json
import os
import platform
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from keras_transformer import cli
from keras_transformer.config import TransformerConfig
from keras_transformer.model import build_transformer
from keras_transformer.train.data_parallel import SINGLE_PROCESS
from tests.conftest import train_args as _train_args

# Trained fixtures, exports and commands end to end: `make integration`.
pytestmark = pytest.mark.integration


def test_train_writes_a_complete_run_directory(trained_run):
    names = set(os.listdir(trained_run))
    assert {"model.keras", "spm.model", "config.json", "metrics.json", "logs"} <= names
    assert os.listdir(trained_run / "logs")  # TensorBoard event files
    metrics = json.loads((trained_run / "metrics.json").read_text())
    assert metrics["epochs"] == 3 and len(metrics["history"]) == 3
    for entry in metrics["history"]:
        assert {"loss", "masked_accuracy", "val_loss", "val_masked_accuracy"} <= set(entry)
    assert metrics["history"][-1]["loss"] < metrics["history"][0]["loss"]
    assert metrics["train_seconds"] > 0 and metrics["tokens_per_second"] > 0
    assert metrics["averaged_checkpoints"] == ["epoch-002.weights.h5", "epoch-003.weights.h5"]
    assert 0 <= metrics["valid_bleu"] <= 100 and "case:mixed" in metrics["valid_bleu_signature"]
    assert metrics["train_data"]["kept_pairs"] == 1000


def test_saved_model_is_the_average_of_the_last_checkpoints(trained_run):
    model = keras.saving.load_model(str(trained_run / "model.keras"))
    saved = model.get_weights()
    checkpoints = [str(trained_run / "checkpoints" / f"epoch-00{i}.weights.h5") for i in (2, 3)]
    per_epoch = []
    for path in checkpoints:
        model.load_weights(path)
        per_epoch.append(model.get_weights())
    assert not np.allclose(per_epoch[0][0], per_epoch[1][0])
    for i, weight in enumerate(saved):
        np.testing.assert_allclose(weight, (per_epoch[0][i] + per_epoch[1][i]) / 2, atol=1e-6)


def test_evaluate_and_translate(trained_run, corpus_files, tmp_path, monkeypatch, capsys):
    corpus, paths = corpus_files
    output = tmp_path / "test.hyp"
    assert (
        cli.main(
            ["evaluate", str(trained_run), "--src", paths["test.src"], "--ref", paths["test.tgt"],
             "--greedy", "--output", str(output)]
        )
        == 0
    )  # fmt: skip
    scores = json.loads((tmp_path / "test.hyp.json").read_text())
    assert {"bleu", "bleu_signature", "chrf", "bleu_lowercase"} <= set(scores)
    hypotheses = output.read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 40
    capsys.readouterr()

    lines = [s for s, _ in corpus.test[:5]]
    monkeypatch.setattr(
        sys,
        "stdin",
        io.StringIO(
            "".join(f"{s}\n" for s in lines[:2]) + "\n" + "".join(f"{s}\n" for s in lines[2:])
        ),
    )
    plot = tmp_path / "attention.png"
    assert cli.main(["translate", str(trained_run), "--greedy", "--plot-attention", str(plot),
                     "--plot-line", "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    # One line per input line, in order; the empty line stays empty.
    assert len(out) == 6 and out[2] == ""
    assert out[:2] + out[3:] == [hypotheses[i] for i in range(5)]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A byte that is not UTF-8 costs neither the input nor that line's place.
    data = "".join(f"{s}\r\n" for s in lines[:3]).encode() + b"ein \xff Hund\n"
    data += "".join(f"{s}\n" for s in lines[3:]).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert cli.main(["translate", str(trained_run), "--greedy"]) == 0
    printed = capsys.readouterr()
    out = printed.out.splitlines()
    assert len(out) == 6 and out[:3] + out[4:] == [hypotheses[i] for i in range(5)]
    assert "warning: input: 1 of 6 lines (line 4) not valid UTF-8" in printed.err


def test_plot_attention_data(trained_run, corpus_files):
    from keras_transformer.plotting import attention_figure_data
    from keras_transformer.translation import load_run

    corpus, _ = corpus_files
    model, tokenizer = load_run(str(trained_run))
    weights, src, tgt, translation = attention_figure_data(
        model, tokenizer, corpus.test[0][0], beam_size=1
    )
    assert weights.shape == (len(tgt), len(src)) and src[-1] == "</s>"
    # The last row predicts EOS, unless the output ran to the model's max_length.
    assert tgt[-1] == "</s>" or len(tgt) == model.get_layer("token_embedding").max_length
    # Rows are softmaxes (the run trained in mixed_bfloat16: 8 bits of mantissa).
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=4e-3)
    assert "".join(src[:-1]).replace("▁", " ").strip() == corpus.test[0][0]
    with pytest.raises(ValueError, match="empty"):
        attention_figure_data(model, tokenizer, "   ")


def test_a_different_configuration_is_refused(trained_run, corpus_files):
    _, paths = corpus_files
    before = (trained_run / "model.keras").read_bytes()
    with pytest.raises(SystemExit, match="different configuration.*seed"):
        cli.main(_train_args(paths, trained_run, "--epochs", "3", "--seed", "7"))
    assert (trained_run / "model.keras").read_bytes() == before


def test_shape_flags_override_the_preset_and_bind_the_run(corpus_files, tmp_path):
    _, paths = corpus_files
    out = tmp_path / "run"
    shape = ["--num-layers", "2", "--num-decoder-layers", "1", "--hidden-dim", "32"]
    shape += ["--intermediate-dim", "48"]
    assert cli.main(_train_args(paths, out, "--max-steps", "2", *shape, "--num-heads", "2")) == 0
    config = TransformerConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert (
        config.num_encoder_layers,
        config.num_decoder_layers,
        config.hidden_dim,
        config.intermediate_dim,
        config.num_heads,
    ) == (2, 1, 32, 48, 2)
    assert config.max_length == TransformerConfig.from_preset("tiny").max_length  # the rest: tiny's
    model = keras.saving.load_model(str(out / "model.keras"))
    assert model.get_layer("decoder_layer_0").output.shape[-1] == 32
    names = {layer.name for layer in model.layers}
    assert {"encoder_layer_1", "decoder_layer_0"} <= names and "decoder_layer_1" not in names
    # Another shape on the same run directory is another run.
    with pytest.raises(SystemExit, match="different configuration.*num_heads: 2 there, 4 now"):
        cli.main(_train_args(paths, out, "--max-steps", "3", *shape, "--num-heads", "4"))


def test_a_shape_that_cannot_be_built_is_refused_before_training(corpus_files, tmp_path):
    _, paths = corpus_files
    args = _train_args(paths, tmp_path / "run", "--hidden-dim", "30", "--num-heads", "4")
    with pytest.raises(SystemExit, match="hidden_dim must be divisible by num_heads"):
        cli.main(args)
    with pytest.raises(SystemExit, match="num_layers must be a positive integer"):
        cli.main(_train_args(paths, tmp_path / "run2", "--num-layers", "0"))
    args = _train_args(paths, tmp_path / "run3")
    args[args.index("--tokens-per-batch") + 1] = "40"  # below tiny's max_length, 48
    with pytest.raises(SystemExit, match=r"tokens_per_batch \(40\) must be at least"):
        cli.main(args)
    args = _train_args(paths, tmp_path / "run4")
    args[args.index("--vocab-size") + 1] = "200"  # SentencePiece needs the 256 byte pieces
    with pytest.raises(SystemExit, match="vocab_size must be at least 300"):
        cli.main(args)
    for run in ("run", "run2", "run3", "run4"):
        assert not (tmp_path / run).exists()


def test_a_foreign_directory_is_refused(corpus_files, tmp_path):
    _, paths = corpus_files
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty and has no train_config.json"):
        cli.main(_train_args(paths, tmp_path, "--epochs", "1"))
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_mismatched_files_fail_before_training(corpus_files, tmp_path):
    _, paths = corpus_files
    short = tmp_path / "short.tgt"
    short.write_text("ONE\nTWO\n")
    args = _train_args({**paths, "train.tgt": str(short)}, tmp_path / "run", "--epochs", "1")
    with pytest.raises(SystemExit, match=r"short.tgt has 2 lines"):
        cli.main(args)
    assert not (tmp_path / "run").exists()


def test_float16_run_with_loss_scaling(float16_run):
    # --max-steps is exercised by the slow Multi30k test (40 steps).
    metrics = json.loads((float16_run / "metrics.json").read_text())
    assert metrics["epochs"] == 1 and metrics["steps"] > 5
    assert metrics["precision"] == "mixed_float16"
    assert np.isfinite(metrics["history"][0]["loss"])
    # The training model had loss scaling (a reloaded functional model reports
    # a float32 policy of its own and is compiled with the plain optimizer).
    from keras_transformer.train import build_and_compile

    fresh = build_and_compile(TransformerConfig.from_preset("tiny"), precision="mixed_float16")
    assert isinstance(fresh.optimizer, keras.optimizers.LossScaleOptimizer)


def test_load_run_skips_the_optimizer_of_a_float16_run(float16_run):
    # Compiling on load would build a plain Adam and warn that it skips the
    # saved LossScaleOptimizer's variables; decoding needs neither.
    import warnings

    from keras_transformer.translation import load_run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_run(str(float16_run))
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    assert getattr(model, "optimizer", None) is None  # not compiled
    assert model.get_layer("decoder_layer_0").dtype_policy.name == "mixed_float16"


@pytest.mark.slow  # two real processes (~1 min); `make slow`
def test_killed_run_resumes_after_the_last_completed_epoch(corpus_files, tmp_path):
    """Kill the real command mid-epoch 2, rerun it, and check it went on from epoch 2."""
    _, paths = corpus_files
    out = tmp_path / "run"
    command = [sys.executable, "-m", "keras_transformer.cli"] + _train_args(
        paths, out, "--epochs", "3", "--select-by", "bleu", "--patience", "3",
        "--accumulate-steps", "2", "--average", "2",
    )  # fmt: skip
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metadata = out / "backup" / "training_metadata.json"
    deadline = time.time() + 300
    try:
        while not metadata.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert metadata.exists(), "the first run never completed an epoch"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    first = json.loads((out / "history.json").read_text())
    assert len(first) in (1, 2)  # killed during epoch 2 (or right after it ended)
    assert not (out / "metrics.json").exists()

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Resuming" in rerun.stdout
    history = json.loads((out / "history.json").read_text())
    assert [e["epoch"] for e in history] == [1, 2, 3]
    assert history[0] == first[0]  # epoch 1 was not trained again
    metrics = json.loads((out / "metrics.json").read_text())
    # The optimizer state was restored: 2 batches per update all along.
    assert history[-1]["steps"] == 3 * metrics["train_data"]["batches"] // 2
    assert metrics["epochs"] == 3 and all("val_bleu" in e for e in history)
    assert metrics["final"]["chosen"] in {c["name"] for c in metrics["final"]["candidates"]}


@pytest.mark.slow  # two trainings; the span-saving SIGTERM test of tests/train/test_streamed.py runs in CI
def test_sigterm_mid_epoch_of_text_files_keeps_the_last_epochs_backup_and_resumes_there(
    corpus_files, tmp_path, capsys
):
    """Text files resume only at epoch ends: SIGTERM during epoch 2 drops its updates,
    leaves epoch 1's backup, says so, and returns; the rerun trains epochs 2 and 3."""
    import threading

    from keras_transformer.train import TrainSettings, train

    _, paths = corpus_files
    settings = TrainSettings(
        src_train=paths["train.src"], tgt_train=paths["train.tgt"],
        src_valid=paths["valid.src"], tgt_valid=paths["valid.tgt"], preset="tiny",
        vocab_size=400, tokens_per_batch=512, epochs=3, select_by="loss", precision="float32",
    )  # fmt: skip
    out = tmp_path / "run"

    def signal_after_epoch_1():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (out / "backup" / "training_metadata.json").exists():
                time.sleep(0.05)  # into epoch 2
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=signal_after_epoch_1, daemon=True)
    thread.start()
    result = train(settings, str(out), verbose=1)
    thread.join()
    said = capsys.readouterr().out
    assert result["stopped_by"] == "SIGTERM" and result["epochs"] == 1
    assert result["steps"] > json.loads((out / "history.json").read_text())[0]["steps"]
    assert "the epoch in flight is dropped" in said and "backup after epoch 1 stands" in said
    assert json.loads((out / "backup" / "training_metadata.json").read_text())["epoch"] == 1
    assert not (out / "model.keras").exists()

    resumed = train(settings, str(out), verbose=0)
    assert [e["epoch"] for e in resumed["history"]] == [1, 2, 3]
    assert resumed["steps"] == 3 * resumed["train_data"]["batches"]


def test_a_resumed_start_does_not_replay_the_first_starts_batches_and_masks(
    trained_run, corpus_files, tmp_path, capsys
):
    """No checkpoint keeps a dropout `SeedGenerator`'s state or tf.data's shuffle
    order, so each start seeds both anew. Seeded as the first start was, a resumed
    start would train its epochs on the first start's batches, in the same order,
    with the same masks."""
    import shutil

    from keras_transformer.data.pipeline import read_parallel
    from keras_transformer.train import TrainSettings, run_dir, stages

    _, paths = corpus_files
    settings = TrainSettings(
        src_train=paths["train.src"], tgt_train=paths["train.tgt"],
        src_valid=paths["valid.src"], tgt_valid=paths["valid.tgt"],
        preset="tiny", vocab_size=400, tokens_per_batch=1024, dropout=0.1,
    )  # fmt: skip
    texts = (*read_parallel(paths["train.src"], paths["train.tgt"]),
             *read_parallel(paths["valid.src"], paths["valid.tgt"]))  # fmt: skip
    # What the first start drew: its SentencePiece model and no epochs done.
    first_dir = tmp_path / "first"
    first_dir.mkdir()
    shutil.copy(trained_run / "spm.model", first_dir / "spm.model")
    done = len(json.loads((trained_run / "history.json").read_text()))

    def start(out_dir, verbose=0):
        run = run_dir._Run(str(out_dir), True, None, SINGLE_PROCESS, verbose)
        data = stages._load_data(run, settings, *texts)
        batches = [b[0]["source_ids"].numpy() for b in data.train.take(3)]
        model = build_transformer(data.config)
        masks = [np.asarray(v.value) for v in model.variables if "seed_generator" in v.path]
        assert masks, "the model has no dropout to seed"
        return batches, masks

    first = start(first_dir)
    resumed = start(trained_run, verbose=1)
    said = capsys.readouterr().out
    again = start(trained_run)
    assert not all(map(np.array_equal, first[0], resumed[0]))
    assert not any(map(np.array_equal, first[1], resumed[1]))
    # A repeated resume from the same epoch draws the same again.
    assert all(map(np.array_equal, resumed[0], again[0]))
    assert all(map(np.array_equal, resumed[1], again[1]))
    assert f"the {done} epochs done), not the first start's again." in said


def test_plot_attention_of_an_output_that_never_ends():
    """A random model that runs to max_length without EOS still gets a plot."""
    from keras_transformer.data.toy import WordVocabulary
    from keras_transformer.plotting import attention_figure_data

    vocabulary = WordVocabulary([f"w{i}" for i in range(36)])
    config = TransformerConfig.from_preset("tiny", vocabulary_size=len(vocabulary), max_length=12)
    model = build_transformer(config)
    weights, src, tgt, _ = attention_figure_data(model, vocabulary, "w5 w6 w7", beam_size=1)
    assert weights.shape == (len(tgt), len(src)) and len(tgt) <= 12
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-4)


def test_auto_precision_accumulation_and_cooldown_are_chosen_said_and_recorded(
    corpus_files, tmp_path, capsys, monkeypatch
):
    """A CPU with bfloat16 units (flags mocked) gets mixed_bfloat16, recorded per epoch with
    the CPU; 2 batches per update; the cool-down is counted in updates."""
    monkeypatch.setattr("keras_transformer.precision.cpu_flags", lambda: {"avx512_bf16"})
    monkeypatch.setattr("keras_transformer.train.stages.visible_gpus", lambda: [])
    monkeypatch.setattr(
        "keras_transformer.precision.cpu_name", lambda: "Some CPU (family 6, model 143)"
    )
    _, paths = corpus_files
    out = tmp_path / "run"
    args = _train_args(paths, out, "--epochs", "1", "--accumulate-steps", "2", "--cooldown", "0.5")
    for flag in ("--warmup-steps", "--learning-rate-scale"):  # the automatic schedule
        del args[args.index(flag) : args.index(flag) + 2]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert (
        "Precision: mixed_bfloat16 (auto: CPU with avx512_bf16), on Some CPU (family 6, model 143)."
        in printed
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["precision"] == "mixed_bfloat16" and metrics["precision_setting"] == "auto"
    # Each epoch says where it ran: a resumed run may continue on another machine.
    assert metrics["device"] == "Some CPU (family 6, model 143)"
    history = json.loads((out / "history.json").read_text())
    assert [(e["precision"], e["device"]) for e in history] == [
        ("mixed_bfloat16", "Some CPU (family 6, model 143)")
    ]
    assert metrics["precision_reason"] == "auto: CPU with avx512_bf16"
    # The tests import keras_transformer first, as users do: TensorFlow runs oneDNN on x86.
    assert metrics["tensorflow_onednn"] is (platform.machine() in ("x86_64", "AMD64"))
    batches = metrics["train_data"]["batches"]
    assert metrics["accumulate_steps"] == 2 and metrics["updates_per_epoch"] == batches // 2
    assert metrics["steps"] == batches // 2  # optimizer updates, not batches
    # 3 epochs of updates to warm up, at the paper's peak learning rate.
    assert metrics["warmup_steps"] == 3 * (batches // 2)
    assert metrics["learning_rate_scale"] == pytest.approx((3 * (batches // 2) / 4000) ** 0.5)
    # The cool-down: the last half of the run's updates, in updates, not batches.
    assert metrics["total_steps"] == batches // 2
    assert metrics["cooldown_steps"] == max(1, round(0.5 * (batches // 2)))
    assert "falling linearly to 0 over updates" in printed
    model = keras.saving.load_model(str(out / "model.keras"))
    assert model.get_layer("decoder_layer_0").dtype_policy.name == "mixed_bfloat16"


def test_automatic_batch_size_is_chosen_said_and_recorded(
    corpus_files, tmp_path, capsys, monkeypatch
):
    """Without --tokens-per-batch, the command takes `automatic_tokens_per_batch`'s choice
    (its rule is tested in tests/train/test_settings.py): here 4096, with one update an epoch
    enough, so that the choice differs from the tests' usual 1024."""
    from keras_transformer.train import batch_size, stages

    chosen = 4096
    monkeypatch.setattr(batch_size, "MIN_UPDATES_PER_EPOCH", 1)
    encoded = []  # each side is tokenized once, however many sizes are tried
    encode = stages.encode_pairs
    monkeypatch.setattr(
        stages, "encode_pairs", lambda *a, **k: encoded.append(1) or encode(*a, **k)
    )
    _, paths = corpus_files
    out = tmp_path / "run"
    args = _train_args(paths, out, "--max-steps", "1")
    del args[args.index("--tokens-per-batch") : args.index("--tokens-per-batch") + 2]
    assert cli.main(args) == 0
    assert len(encoded) == 2  # training pairs and validation pairs
    assert f"Batches: {chosen} tokens per side (auto: the largest of 4096, 2048, 1024" in (
        capsys.readouterr().out
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["tokens_per_batch"] == chosen
    settings = json.loads((out / "train_config.json").read_text())
    assert settings["tokens_per_batch"] is None  # the setting stays automatic on resume


def test_patience_stops_and_the_best_epoch_is_kept(corpus_files, tmp_path, capsys):
    """References no output can match give BLEU 0 every epoch: epoch 1 stays best.

    Equal is not better, so `--patience 2` stops after epoch 3, and
    `--final best --average 1` saves epoch 1's weights, not the last ones.
    """
    _, paths = corpus_files
    unmatched = tmp_path / "valid.tgt"
    lines = open(paths["valid.tgt"], encoding="utf-8").read().splitlines()
    unmatched.write_text("".join("zzzz\n" for _ in lines))
    paths = {**paths, "valid.tgt": str(unmatched)}
    out = tmp_path / "run"
    args = _train_args(
        paths, out, "--epochs", "6", "--select-by", "bleu", "--patience", "2",
        "--final", "best", "--average", "1",
    )  # fmt: skip
    assert cli.main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["val_bleu"] for e in metrics["history"]] == [0.0, 0.0, 0.0]
    assert metrics["stopped_by_patience"] and metrics["best_epoch"] == 1
    assert metrics["final"] == {
        "chosen": "best epoch", "epochs": [1], "candidates": [{"name": "best epoch", "epochs": [1]}]
    }  # fmt: skip
    model = keras.saving.load_model(str(out / "model.keras"))
    saved = model.get_weights()
    for epoch, same in ((1, True), (3, False)):
        model.load_weights(str(out / "checkpoints" / f"epoch-00{epoch}.weights.h5"))
        assert (
            all(np.array_equal(a, b) for a, b in zip(saved, model.get_weights(), strict=True))
            is same
        )
    # Rerun with a larger budget: patience is still spent, nothing more is trained.
    capsys.readouterr()
    assert cli.main([*args[:-10], "--epochs", "8", *args[-8:]]) == 0
    assert "already spent" in capsys.readouterr().out
    assert len(json.loads((out / "history.json").read_text())) == 3


def test_the_train_command_prints_its_progress_and_nothing_else(corpus_files, tmp_path):
    """The real console script, training with SentencePiece inside tf.data.

    Its progress names the budget, not Keras' "Epoch 1/N"; stderr holds only
    our progress bar: no lines from TensorFlow's or SentencePiece's C++
    logging, and no Python warnings (Keras' "ran out of data" for a dataset
    of unknown length, or its warning about `shuffle` with a dataset).
    """
    _, paths = corpus_files
    command = os.path.join(os.path.dirname(sys.executable), "keras-transformer")
    env = {
        k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONWARNINGS")
    }
    arguments = _train_args(paths, tmp_path / "run", "--max-steps", "2", "--max-minutes", "30")
    done = subprocess.run(
        [command, *arguments], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert "Epoch 1 (budget 30 min or 2 steps)" in done.stdout
    assert "Epoch 1/" not in done.stdout
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert lines and all(line.startswith("translating [") for line in lines), lines


def test_subword_sampling_is_said_recorded_and_binds_the_run(corpus_files, tmp_path, capsys):
    _, paths = corpus_files
    out = tmp_path / "run"
    sampling = ["--subword-alpha", "0.2", "--subword-nbest", "-1"]
    assert cli.main(_train_args(paths, out, "--max-steps", "2", *sampling)) == 0
    printed = capsys.readouterr().out
    assert "Subword sampling: every epoch re-segments the training sentences (alpha 0.2, " in (
        printed
    )
    assert "among all segmentations" in printed
    recorded = json.loads((out / "train_config.json").read_text())
    assert (recorded["subword_alpha"], recorded["subword_nbest"]) == (0.2, -1)
    with pytest.raises(SystemExit, match="different configuration.*subword_alpha: 0.2 there"):
        cli.main(_train_args(paths, out, "--max-steps", "3", "--subword-alpha", "0.5"))
    with pytest.raises(SystemExit, match="nbest must be -1"):
        cli.main(
            _train_args(paths, tmp_path / "other", "--subword-alpha", "0.1", "--subword-nbest", "1")
        )
    assert not (tmp_path / "other").exists()


def test_rdrop_doubles_the_batches_keeps_the_updates_and_binds_the_run(
    corpus_files, tmp_path, capsys
):
    _, paths = corpus_files
    out = tmp_path / "run"
    assert cli.main(_train_args(paths, out, "--max-steps", "3", "--rdrop-alpha", "5")) == 0
    assert "R-Drop: every sentence twice per batch, consistency alpha 5." in capsys.readouterr().out
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["rdrop_alpha"] == 5.0
    history = json.loads((out / "history.json").read_text())
    assert history[-1]["steps"] == 3 and np.isfinite(history[-1]["val_loss"])
    with pytest.raises(SystemExit, match="different configuration.*rdrop_alpha: 5.0 there"):
        cli.main(_train_args(paths, out, "--max-steps", "4"))
    for bad, message in (("-1", "R-Drop alpha"), ("nan", "R-Drop alpha")):
        with pytest.raises(SystemExit, match=message):
            cli.main(_train_args(paths, tmp_path / "other", "--rdrop-alpha", bad))
    with pytest.raises(SystemExit, match="tf.distribute splits them over replicas"):
        cli.main(
            _train_args(paths, tmp_path / "other", "--rdrop-alpha", "1", "--strategy", "mirrored")
        )
    assert not (tmp_path / "other").exists()
