"""Epoch checkpoints: ranking epochs on validation, patience, the candidates for the
final weights, and averaging checkpoints into them."""

from __future__ import annotations

import glob
import os
import re

import numpy as np

from keras_transformer.train.settings import MEASURES


def ranked_epochs(history, select_by) -> list[int]:
    """The epochs of `history`, best first by the validation measure `select_by`.

    Of equal scores the earlier epoch ranks first: a later epoch counts as an
    improvement only when it is strictly better. Epochs without the measure
    are left out.
    """
    key = MEASURES[select_by][0]
    scored = [(e[key], e["epoch"]) for e in history if e.get(key) is not None]
    return [epoch for _, epoch in sorted(scored, key=lambda x: (sort_key(select_by, x[0]), x[1]))]


def sort_key(select_by, value) -> float:
    """`value` of the measure `select_by` as a key that sorts the best first."""
    return -value if MEASURES[select_by][1] else value


def patience_spent(history, select_by, patience) -> bool:
    """True when the last `patience` epochs brought no better validation measure."""
    if patience is None or not history:
        return False
    ranked = ranked_epochs(history, select_by)
    return bool(ranked) and history[-1]["epoch"] - ranked[0] >= patience


def final_candidates(history, checkpoint_epochs, select_by, average, final="auto"):
    """The epoch sets the final weights may average, as `{name: [epochs]}`.

    `final="last"` / `"best"`: the last / best `average` epochs. `"auto"`:
    the last epoch, the best epoch, and the last k and best k epochs for
    k = 2 .. `average`; a set already listed is not repeated. Only epochs whose checkpoint still
    exists (`checkpoint_epochs`) take part.

    Example:

    >>> history = [{"epoch": e, "val_loss": v} for e, v in [(1, 3.0), (2, 2.0), (3, 2.5)]]
    >>> final_candidates(history, [1, 2, 3], "loss", 2)
    {'last epoch': [3], 'best epoch': [2], 'mean of last 2': [2, 3]}
    >>> final_candidates(history, [1, 2, 3], "loss", 3, final="best")
    {'mean of best 3': [1, 2, 3]}
    """
    available = set(checkpoint_epochs)
    last = [e["epoch"] for e in history if e["epoch"] in available]
    best = [e for e in ranked_epochs(history, select_by) if e in available] or last[::-1]

    def named(kind, epochs):
        k = len(epochs)
        return (f"{kind} epoch" if k == 1 else f"mean of {kind} {k}"), sorted(epochs)

    if final == "last":
        pairs = [named("last", last[-average:])]
    elif final == "best":
        pairs = [named("best", best[:average])]
    else:
        pairs = []
        for k in range(1, min(average, len(last)) + 1):
            pairs += [named("last", last[-k:]), named("best", best[:k])]
    candidates, seen = {}, set()
    for name, epochs in pairs:
        if tuple(epochs) not in seen:
            seen.add(tuple(epochs))
            candidates[name] = epochs
    return candidates


def checkpoint_epoch(path) -> int:
    return int(re.search(r"epoch-(\d+)", os.path.basename(path)).group(1))


def epoch_checkpoints(out_dir):
    paths = glob.glob(os.path.join(out_dir, "checkpoints", "epoch-*.weights.h5"))
    return sorted(paths, key=checkpoint_epoch)


def average_checkpoints(model, paths) -> None:
    """Sets `model`'s weights to the element-wise mean of the weight files `paths`."""
    if not paths:
        raise ValueError("No checkpoints to average.")
    total = None
    for path in paths:
        model.load_weights(path)
        weights = [np.asarray(w, np.float64) for w in model.get_weights()]
        total = weights if total is None else [t + w for t, w in zip(total, weights, strict=True)]
    model.set_weights([t / len(paths) for t in total])
