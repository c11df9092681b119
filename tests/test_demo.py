import json
import os

import keras
import numpy as np

from keras_transformer.cli import main


def test_demo_entry_point_on_a_shrunken_run(tmp_path, capsys):
    out = str(tmp_path / "demo")
    code = main(["demo", "--out", out, "--epochs", "1", "--num-train", "256", "--num-test", "16"])
    assert code == 0
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    assert 0.0 <= metrics["exact_match"] <= 1.0 and metrics["num_test"] == 16
    assert metrics["train_seconds"] > 0 and np.isfinite(metrics["final_train_loss"])
    assert "Exact match on 16 held-out test sentences" in capsys.readouterr().out
    model = keras.saving.load_model(os.path.join(out, "model.keras"))
    assert model.count_params() > 0
    assert not [name for name in os.listdir(out) if name.startswith(".")]  # no temp files left


def test_demo_learns_the_toy_task(toy_run):
    # A few hundred steps are enough to move far above chance on held-out tokens.
    _, _, _, metrics = toy_run
    assert metrics["final_valid_accuracy"] > 0.5
