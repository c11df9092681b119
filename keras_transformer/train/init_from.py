"""`train --init-from RUN`: another run's model shape, weights and tokenizer to start from
(an imported Marian model, or any run of ours), with text files or prepared data.

A model may also start shallower than RUN (`--num-encoder-layers`,
`--num-decoder-layers`, `--num-layers`: at most RUN's, its widths kept): it
takes RUN's embeddings, norms and output layer, and the layers `kept_layers`
picks from each of RUN's stacks. This is the "shrink and fine-tune" start of a
student (Shleifer and Rush, 2020, "Pre-trained Summarization Distillation":
copy spread-out layers of the teacher, then train on its translations).
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile

from keras_transformer.config import DEPTH_FIELDS, SHAPE_FIELDS, TransformerConfig
from keras_transformer.data.pipeline import DataError
from keras_transformer.translation import load_run


def check_init_from(settings) -> None:
    """Raises ValueError where `settings` cannot start from their `init_from` run: a
    width or norm setting given (those are the run's), no model in the run, or more
    layers asked for than it has (read from the saved model's config, before any
    file of the new run is written)."""
    given = [n for n in SHAPE_FIELDS if n not in DEPTH_FIELDS and getattr(settings, n) is not None]
    if given or settings.normalize_first is not None:
        raise ValueError(
            "init_from takes the model's shape (but fewer layers) and tokenizer from its "
            f"run: leave out {', '.join(given) or 'normalize_first'}."
        )
    path = os.path.join(settings.init_from, "model.keras")
    if not os.path.isfile(path):
        raise ValueError(f"init_from: no model.keras in {settings.init_from}")
    try:
        with zipfile.ZipFile(path) as archive:
            layers = json.loads(archive.read("config.json"))["config"]["layers"]
        kinds = [layer["class_name"] for layer in layers]
    except (OSError, KeyError, TypeError, ValueError, zipfile.BadZipFile):
        return  # loading the model says what is wrong with it
    for side, kind in (("encoder", "EncoderLayer"), ("decoder", "DecoderLayer")):
        _check_depth(settings, side, kinds.count(kind))


def _check_depth(settings, side, has):
    asked = getattr(settings, f"num_{side}_layers") or settings.num_layers or has
    if asked > has:
        raise ValueError(
            f"init_from: {settings.init_from} has {has} {side} layers; a model started "
            f"from it has at most as many (asked for {asked})."
        )
    return asked


def init_config(settings) -> TransformerConfig:
    """The `--init-from` run's model config, with this run's depths and dropout settings
    where given. Raises ValueError for a stack deeper than the run's."""
    from keras_transformer.model import transformer_parts

    config = transformer_parts(load_run(settings.init_from)[0]).config
    changes = {
        name: getattr(settings, name)
        for name in ("dropout", "attention_dropout")
        if getattr(settings, name) is not None
    }
    depths = {
        side: _check_depth(settings, side, getattr(config, f"num_{side}_layers"))
        for side in ("encoder", "decoder")
    }
    changes.update(
        num_layers=depths["encoder"],
        num_encoder_layers=depths["encoder"],
        num_decoder_layers=depths["decoder"],
    )
    return dataclasses.replace(config, **changes)


def kept_layers(have: int, keep: int, side: str) -> list[int]:
    """Which of the `have` layers of a stack (`side`: "encoder" or "decoder") a stack of
    `keep` starts from: spread evenly, the first and the last kept (`keep` >= 2). One
    alone: of the decoder, the last, whose output the output layer was trained on; of
    the encoder, the first, which was trained on the embeddings (each measured the
    better start, docs/data.md)."""
    if not 1 <= keep <= have:
        raise ValueError(f"cannot keep {keep} of {have} layers")
    if keep == 1:
        return [have - 1 if side == "decoder" else 0]
    return [round(i * (have - 1) / (keep - 1)) for i in range(keep)]


def start_from(model, run_dir) -> str:
    """Sets `model`'s weights from those of the run in `run_dir` (a model of the same
    widths and at least its depths): each stack's layers from those `kept_layers`
    picks, every other layer from the run's layer of the same name. Returns a line
    for the log that says what was kept."""
    from keras_transformer.model import transformer_parts

    origin = load_run(run_dir)[0]
    ours, theirs = transformer_parts(model), transformer_parts(origin)
    source = {layer.name: layer for layer in origin.layers}
    kept = []
    for side in ("encoder", "decoder"):
        mine, others = getattr(ours, f"{side}_layers"), getattr(theirs, f"{side}_layers")
        chosen = kept_layers(len(others), len(mine), side)
        source.update({a.name: others[i] for a, i in zip(mine, chosen, strict=True)})
        kept.append(f"{side} layers {chosen} of {len(others)}")
    for layer in model.layers:
        if layer.weights:
            if layer.name not in source:
                raise ValueError(f"init_from: the run has no layer {layer.name!r} to start from")
            layer.set_weights(source[layer.name].get_weights())
    return f"Starting from {run_dir}: " + ", ".join(kept) + "."


def check_prepared_for(settings, prepared) -> None:
    """With --init-from: the shards were encoded with that run's own tokenizer."""
    from keras_transformer.translation import load_tokenizer

    ours = load_tokenizer(settings.init_from).model_proto
    if prepared.tokenizer().model_proto != ours:
        raise DataError(
            f"{settings.data} was not encoded with the tokenizer of {settings.init_from}: "
            f"prepare it with --tokenizer-from {settings.init_from}."
        )
    limit = init_config(settings).max_length
    if prepared.max_length > limit:
        raise DataError(
            f"{settings.data} was prepared with max_length {prepared.max_length}, longer than "
            f"the model's {limit}: prepare it again with --max-length {limit} or less."
        )
