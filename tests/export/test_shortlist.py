"""Vocabulary shortlists: the list, the shortlisted search graphs, the export and the runtime."""

import json
import os

import keras
import numpy as np
import pytest
from keras_transformer_runtime.shortlist import Shortlist, build_shortlist
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, PAD_ID, UNK_ID


def test_the_table_lists_what_comes_with_each_source_piece_best_first():
    # Source piece 10 always comes with target 20, piece 11 with 21 and
    # sometimes 22; 30 is in every target sentence (frequent, but no better
    # sign of 10 or 11 than of anything else).
    pairs = [([10, 4], [20, 30]), ([10], [20, 30]), ([11], [21, 30]), ([11, 10], [21, 22, 30, 20])]
    pairs.append(([5], [30]))
    shortlist = build_shortlist(pairs, 40, per_piece=2, frequent=1)
    assert shortlist.table[10].tolist() == [20, 30]
    assert shortlist.table[11].tolist() == [21, 22]
    assert shortlist.table[12].tolist() == [-1, -1]  # never seen
    assert shortlist.frequent.tolist() == [30]
    ids = shortlist.ids(np.array([[10, 0, 0]]))
    assert ids.tolist() == sorted({EOS_ID, UNK_ID, 20, 30})
    assert ids.dtype == np.int64


def test_a_batch_list_is_topped_up_to_what_a_step_selects():
    shortlist = build_shortlist([([10], [20])], 40, per_piece=1, frequent=0)
    ids = shortlist.ids(np.array([[10]]), at_least=8)
    assert ids.size == 8 and {20, EOS_ID, UNK_ID} <= set(ids.tolist())
    assert PAD_ID not in ids and BOS_ID not in ids


def test_bad_ids_and_bad_files_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="outside the vocabulary of 40"):
        build_shortlist([([10], [45])], 40)
    with pytest.raises(ValueError, match="per_piece must be >= 1"):
        build_shortlist([], 40, per_piece=0)
    bad = tmp_path / "shortlist.npz"
    bad.write_text("not numpy")
    with pytest.raises(ValueError, match="is not a shortlist file"):
        Shortlist.load(str(bad))
    shortlist = build_shortlist([([10], [20])], 40, per_piece=1, frequent=1)
    shortlist.save(str(bad))
    again = Shortlist.load(str(bad))
    assert np.array_equal(again.table, shortlist.table)
    assert np.array_equal(again.frequent, shortlist.frequent)


pytestmark_onnx = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the ONNX tests run in the TensorFlow tier"
)


@pytest.fixture(scope="module")
def listed_exports(trained_run, corpus_files, tmp_path_factory):
    """The SentencePiece toy run exported three ways: with the whole vocabulary as
    its shortlist (Python API, int8 too), with a tight list counted from its
    training text (the CLI), and without."""
    from keras_transformer import cli
    from keras_transformer.export.onnx import export_onnx
    from keras_transformer.model import transformer_parts
    from keras_transformer.translation import load_run

    _, paths = corpus_files
    folder = tmp_path_factory.mktemp("listed")
    model, _ = load_run(str(trained_run))
    vocabulary_size = transformer_parts(model).config.vocabulary_size
    whole = str(folder / "whole")
    export_onnx(
        str(trained_run),
        whole,
        precision="int8",
        shortlist=Shortlist.whole_vocabulary(vocabulary_size),
    )
    tight = str(folder / "tight")
    arguments = ["export", str(trained_run), "--out", tight, "--shortlist-data"]
    arguments += [paths["train.src"], paths["train.tgt"]]
    assert cli.main([*arguments, "--shortlist-per-piece", "3", "--shortlist-frequent", "5"]) == 0
    plain = str(folder / "plain")
    export_onnx(str(trained_run), plain)
    return whole, tight, plain, paths


def _sources(translator, path, count):
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()[:count]
    return [translator.tokenizer.encode(line) + [EOS_ID] for line in lines]


@pytestmark_onnx
@pytest.mark.integration
@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_the_whole_vocabulary_as_shortlist_gives_the_full_search(listed_exports, precision):
    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions

    whole, _, _, paths = listed_exports
    listed = OnnxTranslator(whole, precision=precision, split_batches=False)
    full = OnnxTranslator(whole, precision=precision, split_batches=False, shortlist=False)
    assert listed.decoder.shortlist is not None and full.decoder.shortlist is None
    sources = _sources(full, paths["valid.src"], 12)
    for beam in (1, 4):
        for batch in (sources[:1], sources):  # the one-sentence graphs, then the batch graphs
            got = listed.search(batch, SearchOptions(beam_size=beam))
            want = full.search(batch, SearchOptions(beam_size=beam))
            assert [h[0].tokens for h in got] == [h[0].tokens for h in want]
            # int8: the listed rows have one scale per row, where the full
            # graph's output matrix has one scale: the same tokens, scores
            # within a few thousandths.
            tolerance = 1e-5 if precision == "float32" else 5e-3
            np.testing.assert_allclose(
                [h[0].score for h in got], [h[0].score for h in want], rtol=tolerance, atol=1e-5
            )


@pytestmark_onnx
@pytest.mark.integration
def test_a_real_shortlist_keeps_every_output_piece_on_its_batch_list(listed_exports, monkeypatch):
    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions

    _, tight, plain, paths = listed_exports
    with open(os.path.join(tight, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    assert manifest["shortlist"]["per_piece"] == 3 and manifest["shortlist"]["frequent"] == 5
    assert "greedy_batch_search_shortlist" in manifest["graphs"]
    translator = OnnxTranslator(tight, split_batches=False)
    decoder = translator.decoder
    lists = []
    original = decoder.shortlist_feeds

    def record(graph, source, width, masks):
        feeds = original(graph, source, width, masks)
        lists.append(set(feeds["shortlist"].tolist()))
        return feeds

    monkeypatch.setattr(decoder, "shortlist_feeds", record)
    sources = _sources(translator, paths["valid.src"], 16)
    for beam in (1, 4):
        lists.clear()
        found = translator.search(sources, SearchOptions(beam_size=beam))
        (batch_list,) = lists
        assert len(batch_list) < decoder.vocabulary_size
        assert all(set(h[0].tokens) <= batch_list for h in found)
        assert sum(len(h[0].tokens) for h in found) > 16
    # The export without a list searches the whole vocabulary.
    assert OnnxTranslator(plain).decoder.shortlist is None


@pytestmark_onnx
@pytest.mark.integration
def test_export_refuses_text_that_is_not_parallel(trained_run, corpus_files, tmp_path):
    from keras_transformer import cli

    _, paths = corpus_files
    short = tmp_path / "short.tgt"
    with open(paths["train.tgt"], encoding="utf-8") as f:
        short.write_text("".join(f.readlines()[:10]), encoding="utf-8")
    out = tmp_path / "out"
    arguments = ["export", str(trained_run), "--out", str(out), "--shortlist-data"]
    with pytest.raises(SystemExit, match="are not parallel"):
        cli.main([*arguments, paths["train.src"], str(short)])
    assert not out.exists()  # nothing half-written


@pytestmark_onnx
@pytest.mark.integration
def test_the_listed_rows_are_gathered_before_the_loop_and_multiplied_in_int8(listed_exports):
    import onnx

    from keras_transformer.export.step_graph import LISTED_OUTPUT

    whole = listed_exports[0]
    for name in ("greedy_batch_search_shortlist", "beam_search_shortlist"):
        for precision, product in (("", "MatMul"), ("_int8", "DynamicQuantizeMatMul")):
            path = os.path.join(whole, f"{name}{precision}.onnx")
            graph = onnx.load(path, load_external_data=False).graph
            outer = [n for n in graph.node if "shortlist" in n.input]
            assert outer and all(n.op_type == "Gather" for n in outer)
            (loop,) = [n for n in graph.node if n.op_type == "Loop"]
            (body,) = [a.g for a in loop.attribute if a.name == "body"]
            # Per step the body only maps the selected positions back to ids.
            readers = [n for n in body.node if "shortlist" in n.input]
            assert all(n.op_type == "Gather" and n.input[0] == "shortlist" for n in readers)
            products = [n.op_type for n in body.node if n.name.endswith(LISTED_OUTPUT)]
            assert products and set(products) == {product}


@pytestmark_onnx
@pytest.mark.integration
def test_the_students_benchmark_measures_each_model_and_draws_its_table(
    trained_run, listed_exports, tmp_path, capsys
):
    """`benchmarks.students` end to end on the toy run and its tight list (given once
    as the run, once as the export folder): a row per cell, CTranslate2 with and
    without the list as its vmap beside ours, the table and the PNG."""
    import gzip

    pytest.importorskip("ctranslate2")
    from benchmarks.students import main

    _, tight, _, paths = listed_exports
    for side in ("src", "tgt"):
        with open(paths[f"test.{side}"], encoding="utf-8") as f:
            text = f.read()
        with gzip.open(tmp_path / f"test.{side}.gz", "wt", encoding="utf-8") as f:
            f.write(text)
    out = tmp_path / "students.json"
    # A model is a run (with its --export folder, here a path from the run) or an
    # export folder inside a run.
    import shutil

    again = tmp_path / "again"
    shutil.copytree(trained_run, again)
    shutil.copytree(tight, again / "another-list")
    from_run = os.path.relpath(tight, trained_run)
    argv = [f"teacher={trained_run}", f"again={again / 'another-list'}", "--export", from_run]
    argv += ["--data", str(tmp_path), "--src", "src", "--tgt", "tgt", "--splits", "test"]
    argv += ["--precisions", "float32", "--beams", "1", "--batches", "8", "1", "--threads", "1"]
    argv += ["--lines", "12", "--batch1-lines", "3", "--repeats", "1", "--ctranslate2"]
    main([*argv, "--out", str(out)])
    report = json.loads(out.read_text())
    assert list(report["models"]) == ["teacher", "again"]
    sizes = report["models"]["teacher"]
    assert sizes["weights_mb"] > 0 and sizes["weights_int8_mb"] is None  # a float32 export
    assert [(r["model"], r["batch"], r["sentences"]) for r in report["rows"]] == [
        ("teacher", 8, 12), ("teacher", 1, 3), ("again", 8, 12), ("again", 1, 3)
    ]  # fmt: skip
    for row in report["rows"]:
        for system in ("full", "shortlist", "ctranslate2", "ctranslate2_vmap"):
            assert row[system]["sentences_per_second"] > 0 and 0 <= row[system]["bleu"] <= 100
        assert row["speedup"] == pytest.approx(row["full"]["seconds"] / row["shortlist"]["seconds"])
        assert 0 < row["mean_list_size"] < report["models"]["teacher"]["vocabulary_size"]
    main(["--table", str(out), "--plot", str(tmp_path / "frontier.png")])
    lines = capsys.readouterr().out.strip().splitlines()[-2:]  # one line per model
    model, first = report["models"]["teacher"], report["rows"][0]
    cells = lines[0].split(" | ")
    assert cells[:5] == [
        "| teacher", f"{model['encoder_layers']}-{model['decoder_layers']}",
        str(model["hidden_dim"]), str(model["weights_int8_mb"]), f"{first['full']['bleu']:.2f}",
    ]  # fmt: skip
    assert lines[1].startswith("| again | ")
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
