import json
import os

import keras
import numpy as np
import pytest

from keras_transformer.cli import main

# Trained fixtures, exports and commands end to end: `make integration`.
pytestmark = pytest.mark.integration


def test_demo_entry_point_on_a_shrunken_run(tmp_path, capsys):
    out = str(tmp_path / "demo")
    code = main(["demo", "--out", out, "--epochs", "1", "--num-train", "256", "--num-test", "16"])
    assert code == 0
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["num_test"] == 16
    # The exact match is a count of the 16 printed sentences, and the printed figure is the metric.
    matched = metrics["exact_match"] * 16
    assert abs(matched - round(matched)) < 1e-9
    printed = capsys.readouterr().out
    assert f"Exact match on 16 held-out test sentences: {metrics['exact_match']:.4f}" in printed
    assert printed.count("[ok ]") + printed.count("[BAD]") > 0
    assert metrics["train_seconds"] > 0 and np.isfinite(metrics["final_train_loss"])
    model = keras.saving.load_model(os.path.join(out, "model.keras"))
    assert model.count_params() > 0
    assert not [name for name in os.listdir(out) if name.startswith(".")]  # no temp files left


def test_demo_learns_the_toy_task(toy_run):
    # A few hundred steps are enough to move far above chance on held-out tokens.
    _, _, _, metrics = toy_run
    assert metrics["final_valid_accuracy"] > 0.5
