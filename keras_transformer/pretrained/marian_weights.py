"""The one table between transformers' MarianMT tensor names and our variables.

`weight_table` pairs every variable of a model from `build_transformer` with
its tensor in a transformers MarianMT checkpoint and the two reshapes between
them, so that importing (`checkpoint_values`) and exporting back (the
export's `_write_weights`, `marian_tensors`) read the same table. PyTorch's
`Linear` keeps `(out, in)`; our projections keep `(in, out)` split into
heads. The vocabulary rows are renumbered
(`keras_transformer_runtime.marian_vocabulary`): our padding row 0 is zero on
import and dropped on export.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable

import numpy as np

# Tensors a checkpoint may hold that carry nothing of their own: the fixed
# sinusoids, and copies of a tied embedding.
DERIVED = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")
# The output bias of our padding row, which Marian lacks: far below any real
# logit, so that it takes no probability (the log-probabilities are Marian's
# exactly) and no gradient reaches it through the softmax; finite, so that the
# label-smoothed loss stays finite and float16 holds it.
PADDING_BIAS = -1e4


class MarianWeightError(ValueError):
    """A checkpoint whose tensors do not fit the model its config describes."""


@dataclasses.dataclass
class Entry:
    variable: object  # a Keras variable
    names: tuple[str, ...]  # the checkpoint's name for it, and aliases tried in order
    to_keras: Callable[[np.ndarray], np.ndarray]
    to_marian: Callable[[np.ndarray], np.ndarray]
    # For a vocabulary matrix: `to_keras` is `_rows_in(rows)`, which
    # `_read_rows` reads block by block from the file.
    rows: np.ndarray | None = None


def _rows_in(to_marian):
    """Marian's `(V, ...)` rows in our order, with a zero padding row first."""

    def convert(matrix, padding=0.0):
        out = np.full((len(to_marian),) + matrix.shape[1:], padding, np.float32)
        out[1:] = matrix[to_marian[1:]]
        return out

    return convert


def _rows_out(to_marian):
    """Our rows back in Marian's order (our padding row dropped)."""
    order = marian_order(to_marian)
    return lambda matrix: matrix[order]


def marian_order(to_marian):
    """Which of our rows is each of Marian's: `ours[marian_order(to_marian)]` is
    `_rows_out`'s matrix."""
    order = np.zeros(len(to_marian) - 1, np.int64)
    order[np.asarray(to_marian)[1:]] = np.arange(1, len(to_marian))
    return order


def weight_table(parts, tokenizer) -> list[Entry]:
    """Every variable of `parts` (a `TransformerParts`) with its MarianMT tensor."""
    d = parts.config.hidden_dim
    heads = parts.config.num_heads
    head_dim = d // heads
    table = []

    def add(variable, names, to_keras, to_marian, rows=None):
        if isinstance(names, str):
            names = (names,)
        table.append(Entry(variable, tuple(names), to_keras, to_marian, rows))

    def linear(dense, name):
        add(dense.kernel, f"{name}.weight", lambda w: w.T, lambda k: k.T)
        add(dense.bias, f"{name}.bias", lambda b: b, lambda b: b)

    def attention(mha, name):
        for ours, theirs in (
            (mha.query_dense, "q_proj"),
            (mha.key_dense, "k_proj"),
            (mha.value_dense, "v_proj"),
        ):
            add(
                ours.kernel,
                f"{name}.{theirs}.weight",
                lambda w: w.T.reshape(d, heads, head_dim),
                lambda k: k.reshape(d, d).T,
            )
            add(
                ours.bias,
                f"{name}.{theirs}.bias",
                lambda b: b.reshape(heads, head_dim),
                lambda b: b.reshape(d),
            )
        out = mha.output_dense
        add(
            out.kernel,
            f"{name}.out_proj.weight",
            lambda w: w.T.reshape(heads, head_dim, d),
            lambda k: k.reshape(d, d).T,
        )
        add(out.bias, f"{name}.out_proj.bias", lambda b: b, lambda b: b)

    def norm(layer, name):
        add(layer.gamma, f"{name}.weight", lambda w: w, lambda w: w)
        add(layer.beta, f"{name}.bias", lambda b: b, lambda b: b)

    for i, layer in enumerate(parts.encoder_layers):
        p = f"model.encoder.layers.{i}"
        attention(layer.self_attention, f"{p}.self_attn")
        norm(layer.self_attention_norm, f"{p}.self_attn_layer_norm")
        linear(layer.feed_forward.intermediate_dense, f"{p}.fc1")
        linear(layer.feed_forward.output_dense, f"{p}.fc2")
        norm(layer.feed_forward_norm, f"{p}.final_layer_norm")
    for i, layer in enumerate(parts.decoder_layers):
        p = f"model.decoder.layers.{i}"
        attention(layer.self_attention, f"{p}.self_attn")
        norm(layer.self_attention_norm, f"{p}.self_attn_layer_norm")
        attention(layer.cross_attention, f"{p}.encoder_attn")
        norm(layer.cross_attention_norm, f"{p}.encoder_attn_layer_norm")
        linear(layer.feed_forward.intermediate_dense, f"{p}.fc1")
        linear(layer.feed_forward.output_dense, f"{p}.fc2")
        norm(layer.feed_forward_norm, f"{p}.final_layer_norm")

    source, target = tokenizer.source.to_marian, tokenizer.target.to_marian
    if parts.source_embedding is parts.target_embedding:
        add(
            parts.source_embedding.embeddings,
            ("model.shared.weight", "model.encoder.embed_tokens.weight"),
            _rows_in(source),
            _rows_out(source),
            np.asarray(source),
        )
    else:
        add(
            parts.source_embedding.embeddings,
            ("model.encoder.embed_tokens.weight", "model.shared.weight"),
            _rows_in(source),
            _rows_out(source),
            np.asarray(source),
        )
        add(
            parts.target_embedding.embeddings,
            ("model.decoder.embed_tokens.weight", "model.shared.weight"),
            _rows_in(target),
            _rows_out(target),
            np.asarray(target),
        )
    bias_rows_in, bias_rows_out = _rows_in(target), _rows_out(target)
    if parts.output_projection is not None:
        add(
            parts.output_projection.kernel,
            "lm_head.weight",
            lambda w: bias_rows_in(w).T,
            lambda k: bias_rows_out(k.T),
        )
        bias = parts.output_projection.bias
    else:
        bias = parts.target_embedding.logits_bias
    add(
        bias,
        "final_logits_bias",
        lambda b: bias_rows_in(b[0], PADDING_BIAS),
        lambda b: bias_rows_out(b)[None],
    )
    return table


def checkpoint_values(parts, tensors, tokenizer, hf_config: dict) -> Callable:
    """`value(variable)`: each variable of `parts` as read from the checkpoint `tensors`,
    converted when asked for; a tensor is let go after its last use.

    Raises:
        MarianWeightError: a tensor is missing, or the checkpoint holds one this
            model has no place for (it would be dropped silently), checked
            before any value is read; or, when `value` reads a tensor, it has
            another shape than the config implies.
    """
    table = weight_table(parts, tokenizer)
    chosen = [next((n for n in entry.names if n in tensors), None) for entry in table]
    for entry, name in zip(table, chosen, strict=True):
        if name is None:
            raise MarianWeightError(f"The checkpoint has no tensor {entry.names[0]}.")
    # Besides its own tensors: the fixed sinusoids, and the embedding modules
    # transformers saves beside the ones its forward pass reads.
    used = set(chosen) | set(DERIVED)
    used |= {"model.shared.weight", "model.encoder.embed_tokens.weight"}
    used.add("model.decoder.embed_tokens.weight")
    if hf_config.get("tie_word_embeddings", True):
        used.add("lm_head.weight")
    unused = sorted(set(tensors) - used)
    if unused:
        raise MarianWeightError(
            f"The checkpoint holds {len(unused)} tensor(s) this model has no place for, "
            f"such as {unused[0]}: it is not a MarianMT model of the kind its config says."
        )
    places = {id(entry.variable): (entry, name) for entry, name in zip(table, chosen, strict=True)}
    uses = {name: chosen.count(name) for name in chosen}

    def value(variable):
        entry, name = places[id(variable)]
        expected = tuple(variable.shape)
        if entry.rows is not None and hasattr(tensors, "rows"):
            converted = _read_rows(expected, tensors, name, entry.rows)
        else:
            try:
                converted = entry.to_keras(np.asarray(tensors[name], np.float32))
            except (ValueError, IndexError):  # a reshape or a row lookup that cannot fit
                converted = None
            if converted is None or converted.shape != expected:
                _refuse_shape(name, tensors[name].shape, expected)
        uses[name] -= 1
        if not uses[name]:  # its last use: let go now, so that peak memory stays low
            del tensors[name]
        return converted

    return value


def assign_weights(parts, tensors, tokenizer, hf_config: dict) -> None:
    """Sets every variable of `parts` from the checkpoint `tensors` (`checkpoint_values`)."""
    value = checkpoint_values(parts, tensors, tokenizer, hf_config)
    for entry in weight_table(parts, tokenizer):
        entry.variable.assign(value(entry.variable))


def _refuse_shape(name, shape, expected):
    raise MarianWeightError(
        f"The checkpoint's {name} has shape {tuple(shape)}; the model its config.json "
        f"describes needs {expected} (after renumbering the vocabulary): the config, the "
        "vocabulary and the weights disagree."
    )


# Rows of a vocabulary matrix read from the file at once by `_read_rows`.
ROW_BLOCK = 4096


def _read_rows(expected, tensors, name, to_marian):
    """`_rows_in(to_marian)(tensors[name])`, read from the file `ROW_BLOCK` rows at a
    time: the checkpoint's largest tensor is never held twice."""
    shape = tensors.shape(name)
    if (
        shape[1:] != expected[1:]
        or len(to_marian) != expected[0]
        or to_marian[1:].max() >= shape[0]
    ):
        _refuse_shape(name, shape, expected)
    whole = np.zeros(expected, np.float32)  # our row 0, padding, stays 0
    for start in range(0, len(to_marian), ROW_BLOCK):
        wanted = to_marian[start : start + ROW_BLOCK]
        places = np.arange(1 if start == 0 else 0, len(wanted)) + start
        sources = to_marian[places]
        # Consecutive source rows, read as one slice each (the renumbering moves few rows).
        breaks = np.flatnonzero(np.diff(sources) != 1) + 1
        for run_places, run in zip(
            np.split(places, breaks), np.split(sources, breaks), strict=True
        ):
            whole[run_places] = tensors.rows(name, int(run[0]), int(run[-1]) + 1)
    return whole


def marian_state(parts, tokenizer) -> dict[str, np.ndarray]:
    """The model's weights as a transformers MarianMT state dict (numpy, float32)."""
    return dict(marian_tensors(parts, tokenizer))


def marian_tensors(parts, tokenizer):
    """`marian_state`'s `(name, array)` pairs, made one at a time as they are taken."""
    from keras import ops

    for entry in weight_table(parts, tokenizer):
        value = np.asarray(ops.convert_to_numpy(entry.variable), np.float32)
        yield entry.names[0], np.ascontiguousarray(entry.to_marian(value))


def source_record(source: str) -> dict:
    """What `imported.json` says of an import: where from, when, with which versions."""
    from importlib import metadata

    versions = {}
    for package in ("keras-transformer", "keras", "safetensors"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "format": "marian-hf",
        "source": source,
        "imported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "versions": versions,
    }
