"""Slow smoke test on the real Multi30k data (skipped where the folder is absent)."""

import json
import os
from pathlib import Path

import pytest

from keras_transformer import cli
from keras_transformer.data.pipeline import read_parallel

DATA = Path(
    os.environ.get("MULTI30K", Path(__file__).resolve().parents[1] / ".." / "shared/data/multi30k")
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (DATA / "train.de.gz").is_file(),
        reason=f"Multi30k not found at {DATA} (set MULTI30K to its folder)",
    ),
]


def test_multi30k_files_are_parallel():
    for split, lines in (("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)):
        de, en = read_parallel(str(DATA / f"{split}.de.gz"), str(DATA / f"{split}.en.gz"))
        assert len(de) == len(en) == lines


@pytest.fixture(scope="module")
def multi30k_run(tmp_path_factory):
    """The small preset trained 40 steps on Multi30k de->en."""
    out = tmp_path_factory.mktemp("multi30k") / "de-en"
    args = [
        "train", "--out", str(out), "--preset", "small", "--max-steps", "40",
        "--src-train", str(DATA / "train.de.gz"), "--tgt-train", str(DATA / "train.en.gz"),
        "--src-valid", str(DATA / "val.de.gz"), "--tgt-valid", str(DATA / "val.en.gz"),
        "--vocab-size", "4000", "--tokens-per-batch", "2048", "--warmup-steps", "40",
        # float32 on any CPU: the ONNX export is float32, and the export test
        # asks for Keras's own greedy tokens, which a bfloat16 model near its
        # start (many near-ties) does not give.
        "--precision", "float32",
    ]  # fmt: skip
    assert cli.main(args) == 0
    return out


def test_multi30k_train_evaluate_translate_smoke(multi30k_run, tmp_path, monkeypatch, capsys):
    out = multi30k_run
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_data"]["total_pairs"] == 29000
    assert metrics["train_data"]["kept_pairs"] > 28900
    assert metrics["steps"] == 40
    assert metrics["history"][0]["val_loss"] < 8.3  # below the uniform ln(4000)
    test_src = tmp_path / "test.de"
    test_src.write_text(
        "".join(line + "\n" for line in read_parallel(
            str(DATA / "test_2016_flickr.de.gz"), str(DATA / "test_2016_flickr.en.gz")
        )[0][:40])
    )  # fmt: skip
    capsys.readouterr()
    with open(test_src) as f:
        monkeypatch.setattr("sys.stdin", f)
        assert cli.main(["translate", str(out), "--greedy"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 40


def test_onnx_export_translates_multi30k_like_keras(multi30k_run, tmp_path):
    import numpy as np
    from keras_transformer_runtime import OnnxTranslator

    from keras_transformer.decoding import beam_search, greedy_search
    from keras_transformer.export.onnx import export_onnx
    from keras_transformer.translation import load_run

    export_onnx(multi30k_run, tmp_path / "onnx")
    translator = OnnxTranslator(tmp_path / "onnx")
    model, tokenizer = load_run(str(multi30k_run))
    lines = read_parallel(
        str(DATA / "test_2016_flickr.de.gz"), str(DATA / "test_2016_flickr.en.gz")
    )[0][:200]
    sources = [tokenizer.encode(line) + [tokenizer.eos_id] for line in lines]
    assert translator.greedy_search(sources)[0] == greedy_search(model, sources)[0]
    keras_beam = beam_search(model, sources, beam_size=4)[0]
    onnx_beam = translator.beam_search(sources, beam_size=4)[0]
    assert np.mean([a == b for a, b in zip(keras_beam, onnx_beam, strict=True)]) >= 0.99
