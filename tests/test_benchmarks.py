"""The benchmarks' harness (`benchmarks.harness`), and each benchmark as a smoke test: every
script parses its options, and the translation and training benchmarks run end to end
on small settings."""

import gzip
import importlib
import json
import os
import pkgutil
import sys
from argparse import Namespace

import numpy as np
import pytest

import benchmarks
from benchmarks import harness
from benchmarks.throughput.batches import training_flops
from keras_transformer import TransformerConfig
from keras_transformer.data.pipeline import read_lines

# Trained fixtures, exports, peers and child processes: `make integration`.
integration = pytest.mark.integration
LIBRARIES = {"harness", "ctranslate2_peer"}  # the other modules are scripts
SCRIPTS = sorted(
    m.name
    for m in pkgutil.iter_modules(benchmarks.__path__)
    if m.name not in LIBRARIES and not m.ispkg  # throughput/: the training peers
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_parses_its_options(script, capsys):
    """`python -m benchmarks.SCRIPT --help` prints its usage and exits 0 without measuring."""
    module = importlib.import_module(f"benchmarks.{script}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_interleaved_runs_every_system_once_per_round_and_keeps_the_last_output():
    calls = []

    def system(name):
        def run():
            calls.append(name)
            return f"{name} {len(calls)}"

        return run

    measured = harness.interleaved({"a": system("a"), "b": system("b")}, repeats=3)
    assert calls == ["a", "b"] * 3  # round by round, never one system's rounds together
    assert measured["a"][1] == "a 5" and measured["b"][1] == "b 6"
    assert all(len(seconds) == 3 and min(seconds) >= 0 for seconds, _ in measured.values())


def test_read_lines_reads_plain_and_gzipped_files_and_keeps_a_bad_line(tmp_path):
    plain, packed = tmp_path / "a.txt", tmp_path / "a.txt.gz"
    data = b"eins\nzwei\n" + b"dr\xffei\n"
    plain.write_bytes(data)
    with gzip.open(packed, "wb") as f:
        f.write(data)
    for path in (plain, packed):
        assert harness.read_lines(str(path)) == ["eins", "zwei", "dr\ufffdei"]
        assert harness.read_lines(str(path), 2) == ["eins", "zwei"]
    assert harness.multi30k(str(tmp_path), "a", "txt", "txt", 1) == (["eins"], ["eins"])


def test_a_report_names_its_command_and_machine_and_a_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "results" / "report.json"
    args = Namespace(out=str(out), beam=4, argv=["RUN", "--beam", "4", "--out", str(out)])
    report = harness.write_report("example", args, rows=[{"x": 1}])
    assert json.loads(out.read_text()) == report
    assert report["command"] == f"python -m benchmarks.example RUN --beam 4 --out {out}"
    assert list(report) == ["command", "settings", "rows", "machine"]
    assert report["settings"] == {"out": str(out), "beam": 4}
    assert report["machine"]["logical_cores"] == os.cpu_count()
    with pytest.raises(TypeError):
        harness.write_json(str(out), {"rows": object()})
    assert json.loads(out.read_text()) == report  # the earlier report stands
    assert os.listdir(out.parent) == ["report.json"]  # no temporary file left


def test_markdown_tables_have_one_row_per_entry():
    assert harness.markdown(["a", "b"], [[1, "x"], [2.5, ""]]) == (
        "| a | b |\n| --- | --- |\n| 1 | x |\n| 2.5 |  |"
    )


def test_the_analytic_flop_count_matches_the_weights_of_the_model():
    """One token a side: every kernel multiplies once per token (2 FLOPs a weight), the
    tied output projection once more, and each attention score and value one query by one
    key; training is 3 x forward."""
    from keras_transformer import build_transformer

    config = TransformerConfig.from_preset("tiny")
    model = build_transformer(config)
    kernels = sum(int(np.prod(w.shape)) for w in model.weights if w.path.endswith("kernel"))
    d, layers, attention = config.hidden_dim, config.num_layers, 3  # encoder, self, cross
    forward = 2 * kernels + 2 * d * config.vocabulary_size + layers * attention * 2 * 2 * d
    assert training_flops(config, [1], [1]) == 3 * forward
    # Attention grows with the square of the length; the rest in proportion to it.
    assert training_flops(config, [2, 1], [1, 1]) > training_flops(config, [1, 1], [1, 1])


def test_run_measured_counts_the_memory_of_a_process_and_its_children():
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
    result = harness.run_measured([sys.executable, "-c", code])
    peaks = harness.peaks(result["samples"])
    # The child's copy of `block` is shared, not counted twice; its own block is.
    assert 0.39 < peaks["peak_rss_gib"] < 0.6
    # Both blocks are anonymous memory; the interpreter's own files are not.
    assert 0.39 < peaks["peak_anon_gib"] <= peaks["peak_rss_gib"]
    marks = harness.marks(result)
    assert marks["LAST_UPDATE"] - marks["FIRST_UPDATE"] == pytest.approx(1.9)
    assert result["started"] < marks["FIRST_UPDATE"] < result["started"] + result["seconds"]


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


@integration
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


@integration
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


@integration
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
