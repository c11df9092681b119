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


def test_multi30k_train_evaluate_translate_smoke(tmp_path, monkeypatch, capsys):
    out = tmp_path / "de-en"
    args = [
        "train", "--out", str(out), "--preset", "small", "--max-steps", "40",
        "--src-train", str(DATA / "train.de.gz"), "--tgt-train", str(DATA / "train.en.gz"),
        "--src-valid", str(DATA / "val.de.gz"), "--tgt-valid", str(DATA / "val.en.gz"),
        "--vocab-size", "4000", "--tokens-per-batch", "2048", "--warmup-steps", "40",
    ]  # fmt: skip
    assert cli.main(args) == 0
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
