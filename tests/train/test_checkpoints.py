"""Ranking epochs on validation, patience, the final candidates and averaging checkpoints."""

import numpy as np
import pytest

from keras_transformer.config import TransformerConfig
from keras_transformer.model import build_transformer
from keras_transformer.train.checkpoints import (
    average_checkpoints,
    final_candidates,
    patience_spent,
    ranked_epochs,
)


def _history(key, values):
    return [{"epoch": e, key: v} for e, v in enumerate(values, start=1)]


def test_epochs_rank_by_loss_or_bleu_and_ties_keep_the_earlier():
    assert ranked_epochs(_history("val_loss", [3.0, 2.0, 2.5, 2.0]), "loss") == [2, 4, 3, 1]
    assert ranked_epochs(_history("val_bleu", [10.0, 30.0, 20.0, 30.0]), "bleu") == [2, 4, 3, 1]
    # An epoch without the measure (a run that switched measure) is not ranked.
    assert ranked_epochs([{"epoch": 1, "val_loss": 2.0}], "bleu") == []


@pytest.mark.parametrize(
    "losses,patience,spent",
    [
        ([3.0, 2.0, 2.5], 1, True),
        ([3.0, 2.0, 2.5], 2, False),
        ([3.0, 2.0, 2.0, 2.0], 2, True),  # equal is not better
        ([3.0, 2.0, 1.0], 1, False),
        ([3.0, 2.0, 2.5], None, False),
    ],
)
def test_patience(losses, patience, spent):
    assert patience_spent(_history("val_loss", losses), "loss", patience) is spent


def test_final_candidates():
    history = _history("val_bleu", [10.0, 30.0, 20.0, 25.0])
    assert final_candidates(history, [1, 2, 3, 4], "bleu", 3) == {
        "last epoch": [4],
        "best epoch": [2],
        "mean of last 2": [3, 4],
        "mean of best 2": [2, 4],
        "mean of last 3": [2, 3, 4],
    }  # the best 3 are the last 3: listed once
    assert final_candidates(history, [1, 2, 3, 4], "bleu", 2, "last") == {"mean of last 2": [3, 4]}
    assert final_candidates(history, [1, 2, 3, 4], "bleu", 1, "best") == {"best epoch": [2]}
    # Only epochs whose checkpoint is still there.
    assert final_candidates(history, [3, 4], "bleu", 2, "best") == {"mean of best 2": [3, 4]}


def test_average_checkpoints(tmp_path):
    config = TransformerConfig.from_preset("tiny", vocabulary_size=40)
    model = build_transformer(config)
    paths = []
    for k in range(3):
        model.set_weights([np.full(w.shape, float(k + 1), w.dtype) for w in model.get_weights()])
        paths.append(str(tmp_path / f"{k}.weights.h5"))
        model.save_weights(paths[-1])
    average_checkpoints(model, paths)
    assert all(np.allclose(w, 2.0) for w in model.get_weights())
    with pytest.raises(ValueError, match="No checkpoints"):
        average_checkpoints(model, [])
