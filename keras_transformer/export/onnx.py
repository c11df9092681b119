"""Export a trained model to ONNX: encoder, cached decoder step, search and teacher-forced graphs.

The graphs, each built node by node from the layer weights:

- `encoder.onnx` (built node by node, `keras_transformer.export.encoder_graph`):
  `source_ids (batch, source_len) int32` -> `encoder_output`, `source_mask
  (batch, source_len) bool` and, per decoder layer i, `cross_key_i` and `cross_value_i (batch,
  heads, source_len, head_dim)`: the cross-attention keys and values,
  computed once per sentence.
- `decoder_step.onnx` (built node by node, `keras_transformer.export.step_graph`):
  `token_ids (batch, 1) int32`, `source_mask`, the cross keys and values
  (one row per sentence; `batch` may be a multiple of the sentences, each
  sentence's rows, e.g. its beams, consecutive), and `self_key_i`, `self_value_i (batch, heads, past_len, head_dim)` ->
  `log_probs (batch, vocabulary) float32`, `top_log_probs` and `top_ids
  (batch, top_k)` (each row's best tokens but padding and BOS, as many
  as the `top_k (1,) int64` input asks) and `new_self_key_i`,
  `new_self_value_i` of length `past_len + 1`. The step index is the cache
  length: the first step gets caches of length 0, so one graph serves every
  step and the two can never disagree.
- `forced_scores.onnx`, `alignment.onnx` and `teacher_forced.onnx` (built
  node by node, `keras_transformer.export.forced_graph`): the encoder's
  outputs and `target_ids (batch, target_len)` (and `labels` for the first)
  -> each label's log-probability, the cross-attention of
  `spec.alignment_layer` averaged over heads `(batch, target_len,
  source_len)`, or the whole log-probabilities at every position.
- `greedy_search.onnx`, `beam_search.onnx` and their batch versions
  `greedy_batch_search.onnx`, `beam_batch_search.onnx`: the whole search,
  the decoder step inside an ONNX `Loop` (`keras_transformer.export.greedy_graph`,
  `.beam_graph`); a batch graph drops each sentence from its loop when it ends.
- With a vocabulary shortlist (`shortlist=`), the same four search graphs
  again as `*_shortlist.onnx`, built from a decoder step that scores only the
  ids of a `shortlist` input, and the list itself (`shortlist.npz`).

Every graph keeps its weights in one file per precision, `weights.bin` (`weights_int8.bin`, ...), each tensor
once (`share_weights`).

Why one step graph rather than ONNX Runtime's split into a first step (that
also computes the cross-attention keys and values) and later steps: the
encoder graph already computes them once, so a second decoder graph would only
duplicate every decoder weight on disk and in memory. Why a growing cache
(concatenated) rather than a preallocated one: each step attends only to the
positions produced so far instead of the longest output, and ONNX Runtime
returns a fresh output buffer per step either way.

A model trained under `mixed_float16`/`mixed_bfloat16` is first rebuilt as a
float32 copy from its config and weights. `precision="float16"` also writes
`*_fp16.onnx` graphs converted with ONNX Runtime's float16 tool, with float32
inputs and outputs so that they stay usable from numpy. `precision="int8"`
also writes `*_int8.onnx` graphs: ONNX Runtime's dynamic quantization of the
weight matrices of every MatMul and Gemm with a constant weight (int8
weights, activations quantized per call; attention's activation-by-activation
products, layer norms and softmax stay float32).

The result is written to a temporary folder beside `out_dir` and renamed into
place, with the tokenizer (`spm.model` or `vocab.txt`) and `manifest.json`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

from keras_transformer_runtime.export_format import FORMAT_VERSION, MANIFEST
from keras_transformer_runtime.shortlist import FILE as SHORTLIST_FILE

from keras_transformer.export.beam_graph import build_beam_batch_search, build_beam_search
from keras_transformer.export.encoder_graph import build_encoder
from keras_transformer.export.forced_graph import FORCED_GRAPHS, build_teacher_forced
from keras_transformer.export.greedy_graph import build_greedy_batch_search, build_greedy_search
from keras_transformer.export.loop_step import search_graph
from keras_transformer.export.quantize import float16_graph, int8_graph, int8_listed_output
from keras_transformer.export.step_graph import (
    LISTED_OUTPUT,
    build_decoder_step,
    output_embeddings,
    selection_top_k_limit,
)
from keras_transformer.export.weights import ExportError, share_weights

GRAPHS = ("encoder", "decoder_step", *FORCED_GRAPHS)
# `format_version` in the manifest is the one the runtime reads: one number,
# defined beside the reader. 2: the step graph's top_k input and outputs; 3:
# the greedy_search graph; 4: the beam_search graph, and the weights of the
# graphs that translate in one file per precision (`share_weights`); 5: the
# batch search graphs.
# The graphs that translate, whose weights are stored once per precision.
SHARED_WEIGHT_GRAPHS = (
    "encoder",
    "decoder_step",
    "greedy_search",
    "greedy_batch_search",
    "beam_search",
    "beam_batch_search",
    *FORCED_GRAPHS,
)
TOKENIZER_FILES = ("spm.model", "vocab.json", "vocab.txt")
# The files beside Marian's vocab.json that its tokenizer reads too.
MARIAN_TOKENIZER_FILES = ("source.spm", "target.spm", "target_vocab.json")
PRECISIONS = ("float32", "float16", "int8")
# The file suffix of each extra precision's graphs.
SUFFIXES = {"float16": "_fp16", "int8": "_int8"}


def export_onnx(
    model_or_run_dir,
    out_dir,
    opset=17,
    precision="float32",
    tokenizer_path=None,
    overwrite=False,
    source_language=None,
    shortlist=None,
):
    """Converts a model (or a run directory's `model.keras`) to ONNX graphs in `out_dir`.

    Args:
        model_or_run_dir: a `build_transformer` model, or a run directory
            (with `model.keras` and `spm.model`, Marian's `vocab.json` or `vocab.txt`).
        out_dir: the folder to create. An existing export there is replaced
            only with `overwrite=True`; any other existing non-empty folder
            is refused.
        opset: ONNX opset (at least 17).
        precision: "float32"; "float16" or "int8" to also write graphs of
            that precision.
        tokenizer_path: the tokenizer file to copy when a model object is given.
        source_language: the source language's code ("de"), recorded in the
            manifest: the runtime splits documents into sentences by its rules.
        shortlist: a `keras_transformer_runtime.shortlist.Shortlist` of the
            model's vocabulary: also writes the search graphs that score only
            each batch's shortlisted pieces (`*_shortlist.onnx`) and the list
            (`shortlist.npz`), which the runtime then uses.

    Returns:
        The manifest (a dict), also written to `out_dir/manifest.json`.
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(PRECISIONS)}. Received: {precision!r}"
        )
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < 17:
        raise ValueError(
            f"opset must be an integer >= 17 (for LayerNormalization). Received: opset={opset!r}"
        )
    if source_language is not None and not re.fullmatch(
        r"[A-Za-z]{2,3}([-_][A-Za-z0-9]+)*", source_language
    ):
        raise ValueError(
            "source_language must be a language code such as 'de' or 'pt-BR'. "
            f"Received: {source_language!r}"
        )
    out_dir = os.path.abspath(os.fspath(out_dir))
    _check_out_dir(out_dir, overwrite)

    model, tokenizer_path = _load(model_or_run_dir, tokenizer_path)
    model = float32_copy(model)

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private
    try:
        manifest = _write_graphs(model, staging, opset, precision, shortlist)
        if tokenizer_path is not None:
            name = os.path.basename(tokenizer_path)
            shutil.copyfile(tokenizer_path, os.path.join(staging, name))
            manifest["tokenizer"] = name
            if name == "vocab.json":
                folder = os.path.dirname(tokenizer_path)
                for companion in MARIAN_TOKENIZER_FILES:
                    if os.path.isfile(os.path.join(folder, companion)):
                        shutil.copyfile(
                            os.path.join(folder, companion), os.path.join(staging, companion)
                        )
        if source_language is not None:
            manifest["source_language"] = source_language
        with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        _move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


# --------------------------------------------------------------------------- inputs


def _check_out_dir(out_dir, overwrite):
    if os.path.isfile(out_dir):
        raise ExportError(f"{out_dir} is a file; the export needs a folder there.")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not os.path.isfile(os.path.join(out_dir, MANIFEST)):
            raise ExportError(
                f"{out_dir} exists and is not an ONNX export (no {MANIFEST}); "
                "choose an empty or new folder."
            )
        if not overwrite:
            raise ExportError(
                f"{out_dir} already holds an export; pass overwrite=True (CLI: --overwrite) "
                "to replace it."
            )


def _load(model_or_run_dir, tokenizer_path):
    import keras

    if isinstance(model_or_run_dir, keras.Model):
        model = model_or_run_dir
    else:
        run_dir = os.fspath(model_or_run_dir)
        from keras_transformer.translation import load_run

        model, _ = load_run(run_dir)
        if tokenizer_path is None:
            for name in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(run_dir, name)):
                    tokenizer_path = os.path.join(run_dir, name)
                    break
    if tokenizer_path is not None:
        tokenizer_path = os.fspath(tokenizer_path)
        if os.path.basename(tokenizer_path) not in TOKENIZER_FILES:
            raise ExportError(
                f"tokenizer_path must be a file named {' or '.join(TOKENIZER_FILES)}. "
                f"Received: {tokenizer_path}"
            )
        if not os.path.isfile(tokenizer_path):
            raise FileNotFoundError(f"Tokenizer file not found: {tokenizer_path}")
    return model, tokenizer_path


def float32_copy(model):
    """The model itself if it computes in float32, else a float32 rebuild with its weights."""
    import keras

    from keras_transformer.model import build_transformer, transformer_parts

    if all(layer.dtype_policy.name == "float32" for layer in model.layers):
        return model
    config = transformer_parts(model).config
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")
    try:
        copy = build_transformer(config, name=model.name)
    finally:
        keras.config.set_dtype_policy(previous)
    copy.set_weights(model.get_weights())
    return copy


# --------------------------------------------------------------------------- graphs


def _write_graphs(model, folder, opset, precision, shortlist=None):
    import onnx

    from keras_transformer.model import transformer_parts

    parts = transformer_parts(model)
    config = parts.config
    if shortlist is not None and shortlist.vocabulary_size != config.vocabulary_size:
        raise ExportError(
            f"The shortlist covers {shortlist.vocabulary_size} pieces; the model has "
            f"{config.vocabulary_size}. Build it with this model's tokenizer."
        )
    converted = {
        "encoder": build_encoder(parts, opset),
        "decoder_step": build_decoder_step(parts, opset),
    }
    for name, output in FORCED_GRAPHS.items():
        converted[name] = build_teacher_forced(parts, output, opset)
    graphs = {}
    table = shared_int8_table(parts) if precision == "int8" else None  # read once
    for name in GRAPHS:
        proto = converted[name]
        onnx.checker.check_model(proto, full_check=True)
        path = os.path.join(folder, f"{name}.onnx")
        onnx.save(proto, path)
        graphs[name] = {"float32": f"{name}.onnx"}
        if precision != "float32":
            extra = f"{name}{SUFFIXES[precision]}.onnx"
            if precision == "float16":
                half = float16_graph(proto)
                onnx.checker.check_model(half, full_check=True)
                onnx.save(half, os.path.join(folder, extra))
            else:
                int8_graph(path, os.path.join(folder, extra), config.vocabulary_size, (), table)
            graphs[name][precision] = extra
        graphs[name]["inputs"] = _describe(proto.graph.input)
        graphs[name]["outputs"] = _describe(proto.graph.output)
    for search in SEARCH_GRAPHS:
        graphs[search] = _write_search(folder, graphs["decoder_step"], search)
    listed = {}
    if shortlist is not None:
        listed = _write_shortlisted(parts, folder, opset, precision, shortlist)
        graphs.update(listed)
    weights, weight_bytes = {}, {}
    for kind in graphs["decoder_step"]:
        if kind in PRECISIONS:
            files = [graphs[name][kind] for name in SHARED_WEIGHT_GRAPHS + tuple(listed)]
            weights[kind] = f"weights{SUFFIXES.get(kind, '')}.bin"
            share_weights(folder, files, weights[kind])
            weight_bytes[kind] = os.path.getsize(os.path.join(folder, weights[kind]))
    return {
        "format_version": FORMAT_VERSION,
        "opset": opset,
        "precisions": ["float32"] + ([precision] if precision != "float32" else []),
        "special_ids": {"pad": 0, "bos": 1, "eos": 2, "unk": 3},
        "config": config.to_dict(),
        "num_layers": config.num_layers,
        "graphs": graphs,
        "weights": weights,
        "weight_bytes": weight_bytes,
        "decoder_step": (
            "Feed token_ids (batch, 1), source_mask, cross_key_i and cross_value_i from "
            "encoder.onnx (one row per sentence; batch may be a multiple of the sentences, "
            "each sentence's rows consecutive), and self_key_i/self_value_i (batch, heads, t, head_dim), length 0 "
            "at the first step; the new token is at position t. Returns log_probs and "
            "new_self_key_i/new_self_value_i of length t + 1, and for top_k (1,) int64, "
            "top_log_probs and top_ids (batch, top_k), the best tokens other than padding "
            "and BOS."
        ),
        "greedy_search": (
            "The whole greedy search, the decoder step inside an ONNX Loop: feed source_mask "
            "and the cross keys and values from encoder.onnx and limits (sentences,) int64, "
            "each sentence's maximum output length (EOS included); suppressed (suppressed,) "
            "int64, ids never generated (empty for none), and min_length () int64, EOS not "
            "before that many tokens (0 for none; the beam graphs take both too). Returns "
            "tokens and scores "
            "(steps, sentences): a sentence's output is its tokens up to the first EOS or -1, "
            "its score the sum of its scores."
        ),
        "greedy_batch_search": (
            "greedy_search's inputs, outputs and results; its loop drops each sentence "
            "when it ends, so that later steps compute only the unfinished ones: for "
            "batches of several sentences."
        ),
        "beam_search": (
            "The whole beam search, the decoder step inside an ONNX Loop: feed source_mask "
            "and the cross keys and values from encoder.onnx, limits (sentences,) int64 "
            "(each sentence's maximum output length, EOS included; 0 for an empty source), "
            "beam_size () int64 (twice it at most the vocabulary size), length_penalty () "
            "double (alpha; 0: none), n_best () int64 (at most beam_size) and "
            "length_penalty_form () int64 (0: divide by ((5 + length) / 6) ** alpha, GNMT's; "
            "1: by length ** alpha, the average form). Returns, per sentence its n_best best hypotheses, best first: "
            "tokens (sentences, n_best, steps) and lengths (sentences, n_best): a hypothesis "
            "is its first lengths tokens; scores (sentences, n_best) double, the "
            "length-penalized score (-inf where fewer finished); and token_scores."
        ),
        "beam_batch_search": (
            "beam_search's inputs, outputs and results; its loop drops each sentence when "
            "it is done, so that later steps compute only the unfinished ones: for batches "
            "of several sentences."
        ),
        "versions": _versions(),
        **(
            {
                "shortlist": {
                    "file": SHORTLIST_FILE,
                    "per_piece": shortlist.per_piece,
                    "frequent": int(shortlist.frequent.size),
                    "graphs": sorted(listed),
                }
            }
            if shortlist is not None
            else {}
        ),
    }


SEARCH_GRAPHS = ("greedy_search", "greedy_batch_search", "beam_search", "beam_batch_search")


def _write_shortlisted(parts, folder, opset, precision, shortlist):
    """Writes `shortlist.npz` and the search graphs built from the shortlisted
    decoder step (`*_shortlist.onnx`, of each precision); returns their manifest
    entries. The shortlisted step itself serves only as their loop body."""
    import onnx

    step = build_decoder_step(parts, opset, shortlist=True)
    onnx.checker.check_model(step, full_check=True)
    steps = {"float32": os.path.join(folder, "decoder_step_shortlist.onnx")}
    onnx.save(step, steps["float32"])
    if precision == "float16":
        steps[precision] = os.path.join(folder, "decoder_step_shortlist_fp16.onnx")
        onnx.save(float16_graph(step), steps[precision])
    elif precision == "int8":
        steps[precision] = os.path.join(folder, "decoder_step_shortlist_int8.onnx")
        int8_graph(
            steps["float32"],
            steps[precision],
            parts.config.vocabulary_size,
            [LISTED_OUTPUT],
            shared_int8_table(parts),
        )
        quantized = onnx.load(steps[precision])
        if int8_listed_output(quantized):
            onnx.checker.check_model(quantized)
            onnx.save(quantized, steps[precision])
    entries = {}
    for search in SEARCH_GRAPHS:
        entries[f"{search}_shortlist"] = _write_search(folder, steps, search, f"{search}_shortlist")
    for path in steps.values():
        os.remove(path)
    shortlist.save(os.path.join(folder, SHORTLIST_FILE))
    return entries


def shared_int8_table(parts):
    """The embedding table that the int8 graphs store once, for the lookups and
    the tied output product (`quantize.int8_graph`); None where the output
    layer has a matrix of its own."""
    return output_embeddings(parts) if parts.output_projection is None else None


# Decoder steps per loop iteration of greedy_batch_search, by precision
# (`build_greedy_batch_search`): two copy the state half as often, which
# measured faster for int8 at batches of 32 and no faster for float32
# (`docs/performance.md`, "Decoder steps per loop iteration").
BATCH_STEPS_PER_ITERATION = {"int8": 2}


def _write_search(folder, step_files, name, file_name=None):
    """Writes the search graph `name` (a key of `build` below) of every
    precision, each built from that precision's decoder-step graph (files in
    `folder`), as `file_name` (default `name`) plus the precision's suffix;
    returns its manifest entry."""
    import onnx

    build = {
        "greedy_search": build_greedy_search,
        "greedy_batch_search": build_greedy_batch_search,
        "beam_search": build_beam_search,
        "beam_batch_search": build_beam_batch_search,
    }[name]
    entry = {}
    for precision in (p for p in PRECISIONS if p in step_files):
        step = onnx.load(os.path.join(folder, step_files[precision]))
        steps = None
        if name == "greedy_batch_search":
            steps = BATCH_STEPS_PER_ITERATION.get(precision, 1)
        fixed = name in ("greedy_search", "beam_search")  # their sentences stay
        search = search_graph(build, step, steps, fixed_sentences=fixed)
        onnx.checker.check_model(search, full_check=True)
        entry[precision] = f"{file_name or name}{SUFFIXES.get(precision, '')}.onnx"
        onnx.save(search, os.path.join(folder, entry[precision]))
    entry["inputs"] = _describe(search.graph.input)
    entry["outputs"] = _describe(search.graph.output)
    if name != "greedy_search":  # the graphs that select block by block
        vocabulary = {v.name: v for v in step.graph.output}["log_probs"]
        limit = selection_top_k_limit(vocabulary.type.tensor_type.shape.dim[1].dim_value)
        if limit is not None:  # a step's top_k at most this (`blocked_selection`)
            entry["max_top_k"] = limit
    return entry


def _describe(values):
    import onnx

    described = {}
    for value in values:
        tensor = value.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in tensor.shape.dim]
        described[value.name] = {
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name,
            "shape": shape,
        }
    return described


def _versions():
    from importlib import metadata

    versions = {}
    for package in ("keras-transformer", "keras", "tensorflow", "onnx", "onnxruntime"):
        for candidate in (package, package + "-gpu"):
            try:
                versions[package] = metadata.version(candidate)
                break
            except metadata.PackageNotFoundError:
                continue
    return versions


def _move_into_place(staging, out_dir):
    """Renames the finished staging folder to `out_dir` (replacing an earlier export)."""
    if os.path.isdir(out_dir):
        old = out_dir + ".old-" + os.path.basename(staging)
        os.rename(out_dir, old)
        os.rename(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, out_dir)
