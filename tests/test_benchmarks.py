import json

import numpy as np
import pytest

from benchmarks.matmul_ceiling import main as ceiling_main
from benchmarks.matmul_ceiling import step_products
from benchmarks.throughput.batches import training_flops
from keras_transformer import TransformerConfig
from keras_transformer.data.pipeline import read_lines

# Trained fixtures, exports and commands end to end: `make integration`.
pytestmark = pytest.mark.integration


def test_the_step_products_add_up_to_the_analytic_flop_count():
    # Every product of the list, forward and backward, on a batch without
    # padding must give exactly the benchmark's analytic count (3 x forward).
    config = TransformerConfig.from_preset("paper-base", vocabulary_size=37000)
    for batch_size, source_len, target_len in ((3, 7, 5), (40, 20, 20)):
        products = step_products(config, batch_size, source_len, target_len)
        total = sum(2.0 * p["count"] * p["batch"] * p["m"] * p["k"] * p["n"] for p in products)
        expected = training_flops(
            config, np.full(batch_size, source_len), np.full(batch_size, target_len)
        )
        assert total == expected
        # Each backward pair costs what its forward product does.
        forward = sum(
            2.0 * p["count"] * p["batch"] * p["m"] * p["k"] * p["n"]
            for p in products
            if p["name"].endswith("forward")
        )
        assert total == 3 * forward


def test_ceiling_benchmark_runs_and_writes_json(tmp_path):
    out = tmp_path / "ceiling.json"
    summary = ceiling_main(
        [
            "--shape",
            "small",
            "--budget",
            "128",
            "--repeats",
            "1",
            "--rounds",
            "2",
            "--peak-size",
            "1024",
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["summary"] == summary
    assert written["shape"] == "small" and written["tokens_per_batch"] == 128
    # Padding only adds FLOPs, so the padded products carry at least the model's.
    assert summary["padded_matmul_tflop"] >= summary["model_tflop"] > 0
    assert summary["matmul_seconds"] > 0 and all(p > 0 for p in summary["peaks_measured_gflops"])
    assert 0 < summary["mfu_ceiling"] < 1.5
    assert {p["name"] for p in written["products"]} >= {"output dE", "encoder ffn in dW"}
    # Two rounds: every product timed twice, keeping the best; peaks at the
    # start and after each round.
    for product in written["products"]:
        assert len(product["seconds_by_round"]) == 2
        assert product["seconds"] == min(product["seconds_by_round"])
    assert len(summary["peaks_measured_gflops"]) == 3


def test_attention_ablation_times_each_path_and_puts_the_switches_back():
    from benchmarks.ablations import PLAIN_ATTENTION
    from benchmarks.ablations import main as ablations_main
    from keras_transformer.layers import multi_head_attention
    from keras_transformer.ops import attention

    switch, padded = attention._fused, multi_head_attention.padded_attention
    # The experiment asserts that every path gives the same first loss.
    results = ablations_main(["attention", "--rows", "64", "--layers", "1", "--rounds", "1"])
    assert set(results["attention"]) == {
        f"{name}: {part}"
        for name in (PLAIN_ATTENTION, "fused attention", "fused attention, mask")
        for part in ("train step", "forward")
    }
    assert all(s > 0 for s in results["attention"].values())
    assert attention._fused is switch and switch == {"enabled": None}
    assert multi_head_attention.padded_attention is padded


def test_gradients_ablation_variants_agree_and_put_the_switch_back():
    from benchmarks.ablations import HAND_WRITTEN
    from benchmarks.ablations import main as ablations_main
    from keras_transformer.ops import gradients, linear

    switch, column_sum = gradients.hand_written_gradients, linear.column_sum
    # The experiment asserts that every variant's first loss equals the hand-written one's.
    variants = ["all autodiff", "sum reductions"]
    arguments = ["gradients", "--rows", "64", "--layers", "1", "--rounds", "1", "--variants"]
    results = ablations_main(arguments + variants)
    assert set(results["gradients"]) == {HAND_WRITTEN, *variants}
    assert all(s > 0 for s in results["gradients"].values())
    assert gradients.hand_written_gradients is switch and linear.column_sum is column_sum


@pytest.mark.slow  # about 70 s: two child processes each load TensorFlow and build the peers
def test_train_throughput_runs_peers_side_by_side_and_writes_json(tmp_path, capsys):
    from benchmarks.train_throughput import main as throughput_main

    out = tmp_path / "throughput.json"
    throughput_main(
        ["--shapes", "small", "--budgets", "256", "--peers", "ours", "keras-mha"]
        + ["--batches", "1", "--repeats", "2", "--out", str(out)]
    )
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert [r["peer"] for r in rows] == ["ours", "keras-mha"]
    assert written["machine"]["device"] == "cpu"
    assert set(written["highest_peak_gflops"]) == {"float32"}
    for row in rows:
        assert len(row["seconds"]) == 2 and row["median_seconds"] > 0
        assert row["tokens_per_second"] > row["target_tokens_per_second"] > 0
        # Utilization is model FLOP/s over the highest peak of the run.
        assert row["peak_gflops"] == max(row["peaks_measured_gflops"])
        expected_mfu = row["model_tflops_per_second"] * 1e3 / row["peak_gflops"]
        assert row["mfu"] == pytest.approx(expected_mfu, rel=1e-12)
        assert row["mfu_of_bfloat16_peak"] is None  # no bfloat16 peak on a CPU
        assert np.isfinite(row["first_loss"]) and row["first_loss"] > 0
    ours, peer = rows
    assert ours["ours_speedup"] == 1.0
    assert (
        peer["ours_speedup"] == ours["target_tokens_per_second"] / peer["target_tokens_per_second"]
    )
    printed = capsys.readouterr().out
    assert "small" in printed and "keras-mha" in printed and "MFU/bf16" not in printed


def test_throughput_table_has_a_bfloat16_column_when_a_gpu_peak_exists(capsys):
    from benchmarks.train_throughput import print_table

    row = {
        "shape": "paper-base",
        "tokens_per_batch": 25000,
        "peer": "ours-bf16",
        "target_tokens_per_second": 300000.0,
        "tokens_per_second": 600000.0,
        "model_tflops_per_second": 116.0,
        "peak_gflops": 786000.0,
        "mfu": 0.1476,
        "mfu_of_bfloat16_peak": 0.1476,
        "ours_speedup": 0.7,
        "ours_bf16_speedup": 1.0,
    }
    print_table([row])
    lines = capsys.readouterr().out.splitlines()
    assert "MFU/bf16" in lines[2]  # the header, after a blank line and the legend
    assert lines[-1].split()[-4:] == ["14.8%", "14.8%", "0.70x", "1.00x"]


def test_mixed_precision_peers_are_held_to_the_peak_of_their_type_on_a_gpu():
    from argparse import Namespace

    from benchmarks.train_throughput import _precision

    for mixed in ("bfloat16", "float16"):
        gpu = Namespace(device="gpu", mixed_precision=mixed)
        assert _precision("ours-bf16", gpu) == mixed
        assert _precision("torch", gpu) == mixed  # torch runs under autocast there
        assert _precision("ours", gpu) == "float32"
        assert _precision("keras-hub", gpu) == "float32"
        cpu = Namespace(device="cpu", mixed_precision=mixed)
        # On the CPU every peer is held to the float32 peak (torch runs in float32).
        assert {_precision(p, cpu) for p in ("ours", "ours-bf16", "torch")} == {"float32"}


def test_multi30k_record_command_names_only_what_differs_from_the_defaults():
    from benchmarks.multi30k import train_command

    settings = {
        "src_train": "/data/train.de.gz", "tgt_train": "/data/train.en.gz",
        "src_valid": "/data/val.de.gz", "tgt_valid": "/data/val.en.gz",
        "preset": "small", "epochs": 10, "tokens_per_batch": 2048, "precision": "auto",
        "warmup_steps": None, "dropout": 0.1, "select_by": "bleu", "average_last": None,
    }  # fmt: skip
    assert train_command(settings) == (
        "keras-transformer train --src-train $DATA/train.de.gz --src-valid $DATA/val.de.gz "
        "--tgt-train $DATA/train.en.gz --tgt-valid $DATA/val.en.gz --out RUN --epochs 10 "
        "--tokens-per-batch 2048 --dropout 0.1"
    )
    assert train_command({**settings, "select_by": "loss"}).endswith(" --select-by loss")
    assert train_command({**settings, "hidden_dim": 128, "num_heads": None}).endswith(
        " --dropout 0.1 --hidden-dim 128"
    )


def test_multi30k_record_says_where_each_stretch_of_epochs_trained():
    """A run resumed on another machine is recorded as such: the epochs that
    `train` marks with their device and precision are grouped by where they ran,
    and the table names every stretch, not the machine that wrote the record."""
    from benchmarks.multi30k import _where, trained_on

    zen3 = {"device": "AMD EPYC (family 23, model 1)", "precision": "float32"}
    zen4 = {"device": "AMD EPYC (family 25, model 17)", "precision": "mixed_bfloat16"}
    history = [{"epoch": 1}, {"epoch": 2}, {"epoch": 3, **zen3}, {"epoch": 4, **zen3}]
    history += [{"epoch": 5, **zen4}, {"epoch": 6, **zen3}]
    stretches = trained_on(history)
    assert stretches == [
        {"device": None, "precision": None, "epochs": [1, 2]},
        {**zen3, "epochs": [3, 4]},
        {**zen4, "epochs": [5, 5]},
        {**zen3, "epochs": [6, 6]},
    ]
    machine = {"cpu": "AMD EPYC", "cpu_flags": ["avx2"]}
    assert _where({"machine": machine, "trained_on": stretches}) == (
        "epochs 1-2: not recorded; epochs 3-4: AMD EPYC (family 23, model 1), float32; "
        "epoch 5: AMD EPYC (family 25, model 17), mixed_bfloat16; "
        "epoch 6: AMD EPYC (family 23, model 1), float32"
    )
    # One machine throughout: its family and model, and the precision.
    one = trained_on([{"epoch": e, **zen3} for e in (1, 2)])
    assert _where({"machine": machine, "trained_on": one}) == (
        "AMD EPYC (family 23, model 1), float32"
    )
    # Records from before the per-epoch fields: the recording machine, as before.
    assert _where({"machine": machine}) == "AMD EPYC (avx2)"
    assert _where({"machine": machine, "trained_on": trained_on([{"epoch": 1}])}) == (
        "AMD EPYC (avx2)"
    )


def test_multi30k_record_of_a_stopped_run_takes_precision_and_machine_from_its_epochs(
    tmp_path, monkeypatch
):
    import benchmarks.multi30k as multi30k

    monkeypatch.setattr(multi30k, "RESULTS", str(tmp_path / "results"))
    run = tmp_path / "run"
    run.mkdir()
    settings = {
        "src_train": "/data/train.en.gz", "tgt_train": "/data/train.de.gz",
        "src_valid": "/data/val.en.gz", "tgt_valid": "/data/val.de.gz",
        "preset": "small", "epochs": 20, "vocab_size": 8000, "label_smoothing": 0.1,
    }  # fmt: skip
    (run / "train_config.json").write_text(json.dumps(settings))
    zen3 = {"device": "AMD EPYC (family 23, model 1)", "precision": "float32"}
    history = [
        {"epoch": e, "steps": 507 * e, "seconds": 1300.0, "loss": 6.0 - e, "val_loss": 5.0 - e,
         **({} if e == 1 else zen3)}
        for e in (1, 2, 3)
    ]  # fmt: skip
    (run / "history.json").write_text(json.dumps(history))
    entry = multi30k.record(str(run), "stopped-run", "/data", stopped="for a test")
    # Epoch 1 says nothing: the precision is not known from the epochs alone.
    assert entry["precision"] is None and entry["train_minutes"] == 65.0
    assert entry["trained_on"] == [
        {"device": None, "precision": None, "epochs": [1, 1]},
        {**zen3, "epochs": [2, 3]},
    ]
    (run / "history.json").write_text(json.dumps(history[1:]))
    entry = multi30k.record(str(run), "stopped-run", "/data", stopped="for a test")
    assert entry["precision"] == "float32"
    assert json.loads((tmp_path / "results" / "stopped-run.json").read_text()) == entry


def test_multi30k_record_keeps_one_hypotheses_file_per_search():
    """A beam-5 score at another length penalty never reuses (or overwrites) the
    default's hypotheses; greedy search has no penalty, so one file serves all."""
    from benchmarks.multi30k import hypotheses_path

    assert hypotheses_path("RUN", 5).endswith("test_2016_flickr.beam5.hyp")
    assert hypotheses_path("RUN", 5, 4.0).endswith("test_2016_flickr.beam5.lp4.hyp")
    assert hypotheses_path("RUN", 5, 1.25).endswith("test_2016_flickr.beam5.lp1.25.hyp")
    assert hypotheses_path("RUN", 1, 4.0) == hypotheses_path("RUN", 1)


@pytest.mark.parametrize("normalize_first", [False, True])
def test_ctranslate2_peer_scores_as_the_keras_model(normalize_first, tmp_path):
    """The CTranslate2 conversion holds the same model: the log-probabilities CTranslate2
    gives reference translations match Keras' own, token by token (random weights and
    layer norms, a real SentencePiece model, post-norm and pre-norm)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    import keras

    from benchmarks.ctranslate2_peer import ctranslate2_model
    from keras_transformer import build_transformer
    from keras_transformer.data.tokenizer import train_sentencepiece
    from keras_transformer.data.toy import generate_toy_corpus
    from keras_transformer.decoding import sequence_log_probs

    corpus = generate_toy_corpus(num_train=400, num_valid=1, num_test=12, max_words=8, seed=5)
    tokenizer = train_sentencepiece(
        [s for pair in corpus.train for s in pair], vocabulary_size=400, seed=0
    )
    keras.utils.set_random_seed(3)
    config = TransformerConfig.from_preset(
        "tiny", vocabulary_size=len(tokenizer), normalize_first=normalize_first
    )
    model = build_transformer(config)
    rng = np.random.default_rng(0)
    for weight in model.weights:  # layer norms that do something
        if weight.path.endswith(("gamma", "beta")):
            centre = 1.0 if weight.path.endswith("gamma") else 0.0
            weight.assign(rng.normal(centre, 0.3, weight.shape).astype("float32"))
    ctranslate2_model(model, tokenizer, str(tmp_path / "ct2"))
    sources = [tokenizer.encode(s) + [2] for s, _ in corpus.test]
    targets = [tokenizer.encode(t) for _, t in corpus.test]
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    results = translator.score_batch(
        [tokenizer.pieces(s) for s in sources], [tokenizer.pieces(t) for t in targets]
    )
    for result, target in zip(results, targets, strict=True):
        assert len(result.log_probs) == len(target) + 1  # and EOS
    theirs = np.array([sum(result.log_probs) for result in results])
    ours = sequence_log_probs(model, sources, targets)
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-4)


def test_onnx_vs_ctranslate2_runs_every_system_and_writes_json(trained_run, corpus_files, tmp_path):
    """The deployment benchmark end to end on the SentencePiece test run: four systems,
    four cells, ratios to CTranslate2 at the same precision, the command as given."""
    pytest.importorskip("ctranslate2")
    from benchmarks.onnx_vs_ctranslate2 import CELLS, SYSTEMS
    from benchmarks.onnx_vs_ctranslate2 import main as deploy_main

    _, paths = corpus_files
    out = tmp_path / "deploy.json"
    argv = [str(trained_run), "--src", paths["test.src"], "--ref", paths["test.tgt"]]
    argv += ["--lines", "12", "--repeats", "1", "--out", str(out)]
    deploy_main(argv)
    report = json.loads(out.read_text())
    assert report["command"] == "python -m benchmarks.onnx_vs_ctranslate2 " + " ".join(argv)
    assert [(c["search"], c["batch_size"]) for c in report["cells"]] == [
        (s, b) for s, _, b in CELLS
    ]
    for cell in report["cells"]:
        systems = cell["systems"]
        assert set(systems) == set(SYSTEMS)
        assert systems["ort-float32"]["identical_to_ort_float32"] == 12
        for name, peer in (("ort-float32", "ct2-float32"), ("ort-int8", "ct2-int8")):
            ratio = systems[name]["sentences_per_second"] / systems[peer]["sentences_per_second"]
            assert systems[name]["ratio_to_ct2"] == pytest.approx(ratio)
        for entry in systems.values():
            median = sorted(entry["seconds"])[0]  # one repeat
            assert entry["target_tokens"] > 0
            assert entry["target_tokens_per_second"] == pytest.approx(
                entry["target_tokens"] / median
            )
    # CTranslate2's own protocol, one cell: beam 4 on batches of 32.
    deploy_main(argv + ["--cells", "beam4-32"])
    cells = json.loads(out.read_text())["cells"]
    assert [(c["search"], c["batch_size"]) for c in cells] == [("beam 4", 32)]
    # (That CTranslate2 holds the same model is test_ctranslate2_peer_scores_as_the_keras_model:
    # this 3-epoch model's outputs are too uncertain to compare token for token.)
    assert set(report["size_bytes"]) == set(SYSTEMS)
    assert report["size_bytes"]["ort-int8"] < report["size_bytes"]["ort-float32"]

    # --parallel-batches: both systems translate several batches at once, and
    # give each sentence the translation it gets one batch at a time.
    from keras_transformer_runtime import OnnxTranslator

    from benchmarks.ctranslate2_peer import CTranslate2Translator
    from keras_transformer.translation import load_run

    lines = read_lines(paths["test.src"])[:12]
    _, tokenizer = load_run(str(trained_run))
    for system in (
        OnnxTranslator(f"{trained_run}/onnx-int8", num_threads=1, precision="int8"),
        CTranslate2Translator(f"{trained_run}/ct2-float32", tokenizer, "float32", 1, 2),
    ):
        for beam in (1, 3):
            one_at_a_time = system.translate(lines, beam_size=beam, batch_size=4)
            assert (
                system.translate(lines, beam_size=beam, batch_size=4, parallel_batches=2)
                == one_at_a_time
            )


def test_onnx_vs_ctranslate2_options_measures_each_option_beside_the_plain_search(
    trained_run, corpus_files, tmp_path
):
    """`--options`: every option for every system beside its plain search, the
    cost and the ratio as the seconds give them, and outputs that hold what
    each option asks for (ours: n-best's first hypothesis is the plain output)."""
    pytest.importorskip("ctranslate2")
    from benchmarks.onnx_vs_ctranslate2 import OPTIONS, PEER, SYSTEMS
    from benchmarks.onnx_vs_ctranslate2 import main as deploy_main

    _, paths = corpus_files
    out = tmp_path / "options.json"
    argv = [str(trained_run), "--src", paths["test.src"], "--ref", paths["test.tgt"]]
    argv += ["--lines", "12", "--repeats", "1", "--options", ",".join(OPTIONS)]
    deploy_main(argv + ["--out", str(out)])
    report = json.loads(out.read_text())
    assert [entry["option"] for entry in report["options"]] == ["plain", *OPTIONS]
    plain = report["options"][0]["systems"]
    for entry in report["options"]:
        systems = entry["systems"]
        assert set(systems) == set(SYSTEMS)
        for name, peer in PEER.items():
            ratio = systems[name]["sentences_per_second"] / systems[peer]["sentences_per_second"]
            assert systems[name]["ratio_to_ct2"] == pytest.approx(ratio)
        if entry["option"] == "plain":
            continue
        for name, measured in systems.items():
            cost = measured["seconds"][0] / plain[name]["seconds"][0]
            assert measured["cost_to_plain"] == pytest.approx(cost)
        if entry["option"] == "score":
            # Both systems score the references with the same weights.
            assert systems["ort-float32"]["largest_difference_to_ct2"] < 1e-3
            assert systems["ort-float32"]["mean_log_prob"] < 0
            continue
        hypotheses = 4 * 12 if entry["option"] == "nbest" else 12
        for name in SYSTEMS:
            assert systems[name]["hypotheses"] == hypotheses
        assert systems["ort-float32"]["first_equal_to_plain"] == 12
        if entry["option"] == "alignment":
            for name in SYSTEMS:
                assert systems[name]["aligned_tokens"] > 0
    with pytest.raises(SystemExit):  # forced scoring needs the references
        deploy_main(argv[:3] + ["--options", "score"])


def test_data_scale_counts_the_memory_of_a_process_and_its_children():
    import sys

    from benchmarks.data_scale import run_measured, training_figures

    # A parent and a child, each holding 200 MiB, then the marks a training child prints.
    code = (
        "import os, time\n"
        "block = bytearray(200 * 2**20)\n"
        "pid = os.fork()\n"
        "held = bytearray(200 * 2**20) if pid == 0 else None\n"
        "time.sleep(1.5)\n"
        "if pid == 0:\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "t = time.time(); print('FIRST_UPDATE', t); print('LAST_UPDATE', t + 1.9)\n"
    )
    result = run_measured([sys.executable, "-c", code])
    figures = training_figures(result, tokens_per_batch=1000)
    # The child's copy of `block` is shared, not counted twice; its own block is.
    assert 0.39 < figures["peak_rss_gib"] < 0.6
    # Both blocks are anonymous memory; the interpreter's own files are not.
    assert 0.39 < figures["peak_anon_gib"] <= figures["peak_rss_gib"]
    assert figures["step_target_positions_per_second"] == round(1000 * 19 / 1.9)
