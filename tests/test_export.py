"""ONNX export and the ONNX Runtime translator, checked against Keras.

Three exports of trained models: the demo's float32 toy model (word
vocabulary, also exported in float16), and SentencePiece runs trained under
mixed_bfloat16 and mixed_float16, which are compared with their float32
rebuild. Sentences come from a corpus drawn with a seed no training run uses.
"""

import io
import json
import logging
import os
import subprocess
import sys
from unittest.mock import ANY

import keras
import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="ONNX export converts TensorFlow graphs"
)

from keras_transformer_runtime.runtime import ExportFileError, OnnxTranslator  # noqa: E402
from keras_transformer_runtime.specials import BOS_ID, PAD_ID  # noqa: E402

from keras_transformer import cli  # noqa: E402
from keras_transformer.data.toy import generate_toy_corpus  # noqa: E402
from keras_transformer.decoding import beam_search, greedy_search  # noqa: E402
from keras_transformer.export.onnx import (  # noqa: E402
    BATCH_STEPS_PER_ITERATION,
    ExportError,
    export_onnx,
    float32_copy,
)
from keras_transformer.model import transformer_parts  # noqa: E402
from keras_transformer.translation import load_run, translate_lines  # noqa: E402

# The mixed_float16 run's comparison is in the slow set (`make slow`) to keep
# the default run short; the float16 training run itself is in the default one.
KINDS = [
    "float32",
    "mixed_bfloat16",
    pytest.param("mixed_float16", marks=pytest.mark.slow),
]


def held_out_lines(count=240, seed=31):
    """Toy-language sentences from a seed that no training run here uses."""
    corpus = generate_toy_corpus(num_train=1, num_valid=1, num_test=count, max_words=8, seed=seed)
    return [source for source, _ in corpus.test]


@pytest.fixture(scope="session")
def exported(toy_run, trained_run, float16_run, tmp_path_factory):
    """kind -> (float32 Keras model, tokenizer, OnnxTranslator, export dir)."""
    cache = {}

    def get(kind):
        if kind not in cache:
            run_dir = {
                "float32": toy_run[3]["run_dir"],
                "mixed_bfloat16": str(trained_run),
                "mixed_float16": str(float16_run),
            }[kind]
            out = str(tmp_path_factory.mktemp("onnx") / kind)
            if kind == "float32":  # through the CLI, with the float16 graphs too
                assert cli.main(["export", run_dir, "--out", out, "--precision", "float16"]) == 0
            else:
                export_onnx(run_dir, out)
            model, tokenizer = load_run(run_dir)
            cache[kind] = (float32_copy(model), tokenizer, OnnxTranslator(out), out)
        return cache[kind]

    return get


def _sources(tokenizer, lines):
    return [tokenizer.encode(line) + [tokenizer.eos_id] for line in lines]


def _subgraphs(graph):
    """`graph` and the graphs inside it (a Loop's body)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _subgraphs(attribute.g)


def _op_types(graph):
    """The operator types of `graph` and of the graphs inside it (a Loop's body)."""
    found = set()
    for node in graph.node:
        found.add(node.op_type)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found |= _op_types(attribute.g)
    return found


def _padded(rows):
    array = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return array


# --------------------------------------------------------------------------- the export itself


def test_export_folder_is_complete_and_valid(exported):
    model, _, translator, out = exported("float32")
    names = set(os.listdir(out))
    assert names == {
        "encoder.onnx", "decoder_step.onnx", "greedy_search.onnx", "greedy_batch_search.onnx",
        "beam_search.onnx", "beam_batch_search.onnx", "model.onnx", "encoder_fp16.onnx",
        "decoder_step_fp16.onnx", "greedy_search_fp16.onnx", "greedy_batch_search_fp16.onnx",
        "beam_search_fp16.onnx", "beam_batch_search_fp16.onnx", "model_fp16.onnx",
        "manifest.json", "vocab.txt", "weights.bin", "weights_fp16.bin",
    }  # fmt: skip
    for name in {n for n in names if n.endswith(".onnx")}:
        onnx.checker.check_model(os.path.join(out, name), full_check=True)
    manifest = json.loads(open(os.path.join(out, "manifest.json")).read())
    config = transformer_parts(model).config
    assert manifest["config"] == config.to_dict()
    assert manifest["special_ids"] == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
    assert manifest["opset"] == 17 and manifest["precisions"] == ["float32", "float16"]
    step = manifest["graphs"]["decoder_step"]
    head = config.hidden_dim // config.num_heads
    assert step["inputs"]["self_key_0"]["shape"] == ["batch", config.num_heads, "past_len", head]
    assert step["outputs"]["new_self_value_1"]["shape"] == [
        "batch", config.num_heads, "past_len_plus_1", head,
    ]  # fmt: skip
    assert manifest["graphs"]["encoder"]["outputs"]["cross_key_0"]["shape"] == [
        "batch", config.num_heads, "source_len", head,
    ]  # fmt: skip
    assert step["outputs"]["log_probs"] == {
        "dtype": "float32",
        "shape": ["batch", config.vocabulary_size],
    }
    assert manifest["graphs"]["model"]["inputs"]["target_ids"]["shape"] == ["batch", "target_len"]
    for name in ("greedy_search", "greedy_batch_search"):
        search = manifest["graphs"][name]
        assert search["inputs"]["limits"] == {"dtype": "int64", "shape": ["sentences"]}
        assert search["outputs"]["tokens"] == {"dtype": "int64", "shape": ["steps", "sentences"]}
    for name in ("beam_search", "beam_batch_search"):
        beam = manifest["graphs"][name]
        assert beam["inputs"]["beam_size"] == {"dtype": "int64", "shape": []}
        assert beam["inputs"]["length_penalty"] == {"dtype": "float64", "shape": []}
        assert beam["outputs"]["tokens"] == {"dtype": "int64", "shape": ["sentences", "steps"]}
        assert beam["outputs"]["scores"] == {"dtype": "float64", "shape": ["sentences"]}
    assert manifest["format_version"] == 5
    # The graphs that translate hold no weights of their own: one file per
    # precision holds them, each tensor once (the decoder's are in three graphs).
    assert manifest["weights"] == {"float32": "weights.bin", "float16": "weights_fp16.bin"}
    assert manifest["weight_bytes"]["float32"] == os.path.getsize(os.path.join(out, "weights.bin"))
    for suffix, weights in (("", "weights.bin"), ("_fp16", "weights_fp16.bin")):
        names = [f"{g}{suffix}.onnx" for g in ("encoder", "decoder_step", "greedy_search")]
        names += [f"{g}{suffix}.onnx" for g in ("beam_search", "greedy_batch_search")]
        names.append(f"beam_batch_search{suffix}.onnx")
        spans = {}  # graph -> {tensor: (offset, length)} of its external tensors
        for n in names:
            graph = onnx.load(os.path.join(out, n), load_external_data=False).graph
            entries = {
                tensor.name: dict((e.key, e.value) for e in tensor.external_data)
                for g in _subgraphs(graph)
                for tensor in g.initializer
                if tensor.data_location == onnx.TensorProto.EXTERNAL
            }
            assert {e["location"] for e in entries.values()} == {weights}
            # Every constant is read (ONNX Runtime warns of the others on load).
            read = {i for g in _subgraphs(graph) for node in g.node for i in node.input}
            held = [t.name for g in _subgraphs(graph) for t in g.initializer]
            assert set(held) <= read, (n, set(held) - read)
            inline = [
                t.name
                for g in _subgraphs(graph)
                for t in g.initializer
                if t.data_location != onnx.TensorProto.EXTERNAL
                and onnx.numpy_helper.to_array(t).nbytes >= 1024
            ]
            assert not inline, (n, inline)
            spans[n] = {k: (int(e["offset"]), int(e["length"])) for k, e in entries.items()}
        # The loops' bodies read the step graph's very bytes (all but the ban
        # of its own selection, which the search graphs replace).
        step = spans[names[1]]
        for n in names[2:]:
            assert set(step) - set(spans[n]) <= {"banned_ids_bias"}, n
            assert all(step[k] == span for k, span in spans[n].items() if k in step), n
        with open(os.path.join(out, weights), "rb") as f:
            blob = f.read()
        stored = [
            blob[o : o + n] for o, n in set().union(*(set(s.values()) for s in spans.values()))
        ]
        assert len(set(stored)) == len(stored)  # no tensor stored twice
    assert {"tensorflow", "tf2onnx", "onnx", "onnxruntime", "keras"} <= set(manifest["versions"])
    assert translator.provider == "CPUExecutionProvider" or "CUDA" in translator.provider


def test_mixed_precision_models_are_rebuilt_in_float32(trained_run):
    model, _ = load_run(str(trained_run))
    assert model.get_layer("decoder_layer_0").dtype_policy.name == "mixed_bfloat16"
    copy = float32_copy(model)
    assert copy is not model
    assert {layer.dtype_policy.name for layer in copy.layers} == {"float32"}
    for a, b in zip(model.get_weights(), copy.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_export_refuses_foreign_or_existing_folders_and_leaves_nothing_on_failure(
    toy_run, exported, tmp_path, monkeypatch
):
    run_dir = toy_run[3]["run_dir"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="is not an ONNX export"):
        export_onnx(run_dir, foreign)
    assert os.listdir(foreign) == ["notes.txt"]
    with pytest.raises(ExportError, match="already holds an export"):
        export_onnx(run_dir, exported("float32")[3])
    with pytest.raises(SystemExit, match="already holds an export"):
        cli.main(["export", run_dir, "--out", exported("float32")[3]])
    with pytest.raises(ValueError, match="precision must be one of .*Received: 'int4'"):
        export_onnx(run_dir, tmp_path / "x", precision="int4")

    import keras_transformer.export.onnx as export_module

    def failing(*args, **kwargs):
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(export_module, "_write_graphs", failing)
    with pytest.raises(RuntimeError, match="conversion failed"):
        export_onnx(run_dir, tmp_path / "new")
    assert sorted(os.listdir(tmp_path)) == ["foreign"]  # no half-written folder


# --------------------------------------------------------------------------- numeric parity


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_teacher_forced_and_step_outputs_match_keras(kind, exported):
    model, tokenizer, translator, _ = exported(kind)
    parts = transformer_parts(model)
    rng = np.random.default_rng(0)
    lines = held_out_lines(48, seed=41)
    sources = _sources(tokenizer, lines)
    # Targets of varied lengths, so that both sides carry padding.
    targets = [[1] + list(rng.integers(4, 40, size=rng.integers(1, 14))) for _ in lines]
    source, target = _padded(sources), _padded(targets)
    assert (source == 0).any() and (target == 0).any()

    encoded, mask, cross = translator.encode(source)
    keras_encoded, keras_mask = parts.encode(source)
    np.testing.assert_allclose(encoded, keras.ops.convert_to_numpy(keras_encoded), atol=1e-4)
    np.testing.assert_array_equal(mask, keras.ops.convert_to_numpy(keras_mask))
    expected = []
    for layer in parts.decoder_layers:
        for dense in (layer.cross_attention.key_dense, layer.cross_attention.value_dense):
            # (batch, source_len, heads, head_dim) in Keras; heads first in the export.
            expected.append(
                np.transpose(keras.ops.convert_to_numpy(dense(keras_encoded)), (0, 2, 1, 3))
            )
    assert len(cross) == len(expected) == 2 * len(parts.decoder_layers)
    for cache, keras_cache in zip(cross, expected, strict=True):
        np.testing.assert_allclose(cache, keras_cache, atol=1e-4)

    logits = keras.ops.convert_to_numpy(model({"source_ids": source, "target_ids": target}))
    np.testing.assert_allclose(translator.logits(source, target), logits, atol=1e-4)

    # The cached step, fed the targets one token at a time, gives the
    # teacher-forced log-probabilities at every real position.
    log_probs = keras.ops.convert_to_numpy(keras.ops.log_softmax(logits, axis=-1))
    caches = translator.empty_self_caches(len(source))
    real = target != 0
    for t in range(target.shape[1]):
        feeds = translator._search_feeds(mask, cross)
        selected, _ = translator._run_step(target[:, t : t + 1], feeds, caches, top_k=7)
        step_log_probs, caches = translator.decoder_step(target[:, t : t + 1], mask, cross, caches)
        assert all(cache.shape[2] == t + 1 for cache in caches)
        np.testing.assert_allclose(step_log_probs[real[:, t]], log_probs[real[:, t], t], atol=1e-4)
        # The graph's own selection: each row's 7 best tokens but padding and BOS, best first.
        values, ids = selected
        allowed = step_log_probs.copy()
        allowed[:, [PAD_ID, BOS_ID]] = -np.inf
        assert ids.shape == (len(source), 7) and not np.isin(ids, [PAD_ID, BOS_ID]).any()
        np.testing.assert_array_equal(values, np.take_along_axis(allowed, ids, axis=1))
        np.testing.assert_array_equal(values, -np.sort(-allowed, axis=1)[:, :7])


@pytest.mark.parametrize("kind", KINDS)
def test_same_translations_as_keras_on_held_out_sentences(kind, exported):
    model, tokenizer, translator, _ = exported(kind)
    lines = held_out_lines(200)
    sources = _sources(tokenizer, lines)
    keras_greedy, keras_greedy_scores = greedy_search(model, sources)
    onnx_greedy, onnx_greedy_scores = translator.greedy_search(sources)
    assert onnx_greedy == keras_greedy  # every one of the 200
    np.testing.assert_allclose(onnx_greedy_scores, keras_greedy_scores, atol=1e-3)

    keras_beam, keras_scores = beam_search(model, sources, beam_size=4)
    onnx_beam, onnx_scores = translator.beam_search(sources, beam_size=4)
    same = np.mean([a == b for a, b in zip(onnx_beam, keras_beam, strict=True)])
    assert same >= 0.99
    np.testing.assert_allclose(onnx_scores, keras_scores, atol=1e-3)

    # The text path: tokenization, batching by length, detokenization.
    texts = lines[:64]
    assert translator.translate(texts, beam_size=1) == translate_lines(
        model, tokenizer, texts, beam_size=1
    )


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_the_greedy_loop_in_the_graph_finds_what_the_step_by_step_search_finds(
    precision, exported, monkeypatch
):
    """greedy_search.onnx and greedy_batch_search.onnx (the loop inside ONNX
    Runtime; the batch graph drops each sentence when it ends) against the
    Python loop over decoder_step.onnx, and against Keras: the same tokens,
    the same scores."""
    from keras_transformer_runtime import runtime

    model, tokenizer, _, out = exported("float32")
    # Whole batches: the test follows which graph searches (no split, `split_parts`).
    translator = OnnxTranslator(out, precision=precision, split_batches=False)
    sources = _sources(tokenizer, held_out_lines(40, seed=71))
    keras_tokens, _ = greedy_search(model, sources)

    def search(batch, graph, **kwargs):
        """`graph`: the search graph that must run, or None for the Python loop."""
        monkeypatch.setattr(runtime, "GREEDY_BATCH_GRAPH", graph == "greedy_batch_search")
        limit = len(batch) if graph == "greedy_search" else 0
        monkeypatch.setattr(runtime, "GRAPH_LOOP_MAX_SENTENCES", limit)
        calls = []
        original = translator._greedy_in_graph
        monkeypatch.setattr(
            translator,
            "_greedy_in_graph",
            lambda *a: calls.append(a[3] if len(a) > 3 else "greedy_search") or original(*a),
        )
        result = translator.greedy_search(batch, **kwargs)
        assert calls == ([graph] if graph else [])
        return result

    for start, size in ((0, 1), (1, 1), (2, 2), (4, 5), (9, 31)):
        batch = sources[start : start + size]
        graphs = ["greedy_search", "greedy_batch_search"]
        for max_length in (None, 3):  # 3: most sentences stop at their limit, not at EOS
            step_tokens, step_scores = search(batch, None, max_length=max_length)
            for graph in graphs:
                graph_tokens, graph_scores = search(batch, graph, max_length=max_length)
                assert graph_tokens == step_tokens, graph
                np.testing.assert_allclose(graph_scores, step_scores, rtol=0, atol=1e-5)
            if max_length is None and precision == "float32":
                assert step_tokens == keras_tokens[start : start + size]
            else:
                assert all(len(t) <= (max_length or 99) for t in step_tokens)
    # An empty source in the batch: an empty output and score 0, as step by step.
    for graph in ("greedy_search", "greedy_batch_search"):
        tokens, scores = search([sources[0], [], sources[1]], graph)
        assert tokens[1] == [] and scores[1] == 0 and tokens[0] == keras_tokens[0]
        assert tokens[2] == keras_tokens[1]


def test_the_greedy_batch_graph_finds_the_same_at_any_steps_per_iteration(exported, tmp_path):
    """The float32 greedy_batch_search makes one decoder step per loop
    iteration (int8's make two, `BATCH_STEPS_PER_ITERATION`); built with 2 or 3
    steps and one compaction after them it gives the same tokens and scores,
    a batch's steps after its last sentence ended dropped."""
    import shutil

    import onnxruntime as ort

    from keras_transformer.export.greedy_graph import build_greedy_batch_search

    _, tokenizer, _, out = exported("float32")
    translator = OnnxTranslator(out)
    sources = _sources(tokenizer, held_out_lines(24, seed=73))
    step = onnx.load(os.path.join(out, "decoder_step.onnx"), load_external_data=False)
    shutil.copyfile(os.path.join(out, "weights.bin"), tmp_path / "weights.bin")
    sessions = {"exported": translator.session("greedy_batch_search")}
    for k in (2, 3):
        path = str(tmp_path / f"greedy_batch_k{k}.onnx")  # beside its weights
        onnx.save(build_greedy_batch_search(step, k), path)
        sessions[k] = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    batches = [
        (sources, None),
        (sources, 3),
        (sources[:5], 4),
        ([sources[0], [], sources[1]], None),
    ]
    for rows, max_length in batches:
        source, limits = translator._prepare(rows, max_length)
        _, mask, cross = translator.encode(source)
        feeds = translator._search_feeds(mask, cross)
        feeds["limits"] = np.asarray(limits, np.int64)
        tokens, scores = sessions["exported"].run(None, feeds)
        # As many steps as the longest output, EOS included.
        assert len(tokens) == max(int((column >= 0).sum()) for column in tokens.T)
        for k in (2, 3):
            k_tokens, k_scores = sessions[k].run(None, feeds)
            np.testing.assert_array_equal(k_tokens, tokens)
            np.testing.assert_allclose(k_scores, scores, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="at least 1"):
        build_greedy_batch_search(step, 0)


def _selection_step(vocabulary_size, opset):
    """The tail of a decoder step on its own: logits in; `log_probs` and the
    `top_k` best tokens other than padding and BOS out, as `build_decoder_step`
    writes them."""
    from onnx import TensorProto, helper, numpy_helper

    never = np.zeros(vocabulary_size, np.float32)
    never[[PAD_ID, BOS_ID]] = -np.inf
    nodes = [
        helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1),
        helper.make_node("Add", ["log_probs", "banned_ids_bias"], ["allowed"]),
        helper.make_node("TopK", ["allowed", "top_k"], ["top_log_probs", "top_ids"], axis=-1),
    ]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "step",
        [
            helper.make_tensor_value_info("logits", f32, ["batch", vocabulary_size]),
            helper.make_tensor_value_info("top_k", TensorProto.INT64, [1]),
        ],
        [
            helper.make_tensor_value_info("log_probs", f32, ["batch", vocabulary_size]),
            helper.make_tensor_value_info("top_log_probs", f32, ["batch", "top_k"]),
            helper.make_tensor_value_info("top_ids", TensorProto.INT64, ["batch", "top_k"]),
        ],
        [numpy_helper.from_array(never, "banned_ids_bias")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("opset", [17, 18])
def test_the_blocked_selection_picks_the_tokens_topk_picks(opset):
    """`blocked_selection` finds each row's k best tokens block by block: the
    same tokens, in the same order, and log-probabilities as one `TopK` over
    the vocabulary, ties to the lower id across and within blocks, padding and
    BOS never chosen, for k from 1 to the number of blocks."""
    import onnxruntime as ort

    from keras_transformer.export.step_graph import (
        blocked_selection,
        selection_block_size,
        selection_top_k_limit,
    )

    vocabulary_size = 2000
    assert selection_block_size(vocabulary_size) == 40  # the divisor nearest sqrt(2000)
    assert selection_top_k_limit(vocabulary_size) == 50
    step = _selection_step(vocabulary_size, opset)
    blocked = blocked_selection(step)
    onnx.checker.check_model(blocked, full_check=True)
    assert not any(list(n.input) == ["log_probs", "banned_ids_bias"] for n in blocked.graph.node)

    rng = np.random.default_rng(5)
    logits = rng.normal(size=(12, vocabulary_size)).astype(np.float32)
    logits[1, [PAD_ID, BOS_ID]] = 50.0  # the best two are banned
    logits[2] = 0.0  # all equal: the first allowed ids, 2, 3, ...
    logits[3, [700, 1900, 5]] = 40.0  # one tie across blocks, one in the first block
    logits[4, [719, 701]] = 40.0  # a tie inside one block
    logits[5, :] = -np.inf
    logits[5, [PAD_ID, 1999]] = 1.0  # only padding and the last id finite
    logits[6, [PAD_ID, 39]] = 30.0  # the first block's best is banned, id 39 is not
    logits[7] = np.round(logits[7])  # many ties
    logits[8, [40, 80]] = 30.0  # the first ids of two blocks
    logits[9, [PAD_ID, BOS_ID, 2]] = [60.0, 60.0, 59.0]
    logits[10] = np.round(rng.normal(size=vocabulary_size) * 0.3).astype(np.float32)
    logits[11, 80:120] = 20.0  # one whole block ahead of the rest, all tied

    def run(model, rows, k):
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        return session.run(None, {"logits": rows, "top_k": np.array([k], np.int64)})

    for k in (1, 2, 8, 41, 50):
        for rows in (logits, logits[:1], logits[2:3]):
            expected, found = run(step, rows, k), run(blocked, rows, k)
            np.testing.assert_array_equal(found[0], expected[0])  # log_probs untouched
            np.testing.assert_array_equal(found[2], expected[2])
            np.testing.assert_array_equal(found[1], expected[1])
    tokens = run(blocked, logits, 1)[2][:, 0]
    assert list(tokens[1:7]) == [int(np.argsort(-logits[1][2:])[0]) + 2, 2, 5, 701, 1999, 39]
    assert tokens[8] == 40 and tokens[9] == 2
    assert list(run(blocked, logits, 3)[2][2]) == [2, 3, 4]
    assert list(run(blocked, logits, 41)[2][11][:40]) == list(range(80, 120))

    # No block width: vocabularies under 1024, or with no divisor in 16..512.
    for size in (1000, 1031):
        assert selection_block_size(size) is None and selection_top_k_limit(size) is None
        assert blocked_selection(_selection_step(size, opset)) is None


def test_the_search_graphs_with_blocked_selection_find_what_the_full_topk_finds():
    """A random `tiny` model with a 1200-token vocabulary (block width 30, 40
    blocks): its greedy_batch_search (1 and 2 steps per iteration) gives
    greedy_search's tokens and scores (greedy_search keeps the full `TopK`),
    and beam_search and beam_batch_search give what they give built with the
    full `TopK`, for beams of 1, 4 and 20 (2 x 20 = every block). Random
    weights give nearly flat log-probabilities, many close calls."""
    import onnxruntime as ort

    from keras_transformer.config import TransformerConfig
    from keras_transformer.export.beam_graph import build_beam_batch_search, build_beam_search
    from keras_transformer.export.encoder_graph import build_encoder
    from keras_transformer.export.greedy_graph import (
        build_greedy_batch_search,
        build_greedy_search,
    )
    from keras_transformer.export.step_graph import build_decoder_step
    from keras_transformer.model import build_transformer

    keras.utils.set_random_seed(3)
    model = build_transformer(TransformerConfig.from_preset("tiny", vocabulary_size=1200))
    parts = transformer_parts(model)
    step = build_decoder_step(parts)

    def session(proto):
        return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])

    def selects_by_blocks(proto):
        return any(n.output[0] == "best.blocks" for g in _subgraphs(proto.graph) for n in g.node)

    encoder = session(build_encoder(parts))
    rng = np.random.default_rng(8)
    lengths = rng.integers(1, 12, size=20)
    source = np.zeros((20, 12), np.int32)
    for i, n in enumerate(lengths):
        source[i, :n] = rng.integers(4, 1200, size=n)
    _, mask, *cross = encoder.run(None, {"source_ids": source})
    feeds = {"source_mask": mask}
    feeds.update({v.name: c for v, c in zip(encoder.get_outputs()[2:], cross, strict=True)})
    feeds["limits"] = (lengths + 6).astype(np.int64)
    tokens, scores = session(build_greedy_search(step)).run(None, feeds)
    for k in (1, 2):
        graph = build_greedy_batch_search(step, k)
        assert selects_by_blocks(graph)
        k_tokens, k_scores = session(graph).run(None, feeds)
        np.testing.assert_array_equal(k_tokens, tokens)
        np.testing.assert_allclose(k_scores, scores, rtol=0, atol=1e-6)

    for build in (build_beam_search, build_beam_batch_search):
        blocked, full = build(step), build(step, blocked=False)
        assert selects_by_blocks(blocked) and not selects_by_blocks(full)
        blocked, full = session(blocked), session(full)
        for beam in (1, 4, 20):
            beam_feeds = dict(feeds, beam_size=np.array(beam, np.int64))
            beam_feeds["length_penalty"] = np.array(0.6, np.float64)
            expected, found = full.run(None, beam_feeds), blocked.run(None, beam_feeds)
            np.testing.assert_array_equal(found[0], expected[0])
            np.testing.assert_array_equal(found[1], expected[1])
            np.testing.assert_allclose(found[2], expected[2], rtol=0, atol=1e-9)


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_the_beam_loop_in_the_graph_finds_what_the_step_by_step_search_finds(
    precision, exported, monkeypatch
):
    """beam_search.onnx and beam_batch_search.onnx (the loop inside ONNX Runtime;
    the batch graph drops each sentence when it is done) against the Python
    loop over decoder_step.onnx, and against Keras: the same tokens, the same
    scores, for several beam sizes, length penalties and length limits."""
    from keras_transformer_runtime import runtime

    model, tokenizer, _, out = exported("float32")
    # Whole batches: the test follows which graph searches (no split, `split_parts`).
    translator = OnnxTranslator(out, precision=precision, split_batches=False)
    sources = _sources(tokenizer, held_out_lines(40, seed=73))
    graphs = ("beam_search", "beam_batch_search")
    # float16 log-probabilities may round one unit apart between the graph's
    # and the step's kernels (2**-11 near 0.5-1 on an AVX2 CPU); the tokens
    # must still be the same.
    tolerance = dict(rtol=0, atol=1e-5) if precision == "float32" else dict(rtol=1e-3, atol=1e-3)

    def search(batch, graph, **kwargs):
        """`graph`: the search graph that must run, or None for the Python loop."""
        monkeypatch.setattr(runtime, "BEAM_BATCH_GRAPH", graph == "beam_batch_search")
        limit = len(batch) if graph == "beam_search" else 0
        monkeypatch.setattr(runtime, "BEAM_GRAPH_MAX_SENTENCES", limit)
        calls = []
        original = OnnxTranslator._beam_in_graph.__get__(translator)
        monkeypatch.setattr(
            translator,
            "_beam_in_graph",
            lambda *a: calls.append(a[5] if len(a) > 5 else "beam_search") or original(*a),
        )
        result = translator.beam_search(batch, **kwargs)
        assert calls == ([graph] if graph else [])
        return result

    settings = [
        dict(beam_size=4),
        dict(beam_size=2, length_penalty=0.0),
        dict(beam_size=5, length_penalty=2.0),
        dict(beam_size=4, max_length=3),  # most sentences end at the limit, not at EOS
        dict(beam_size=3, max_length=1),
    ]
    for start, size in ((0, 1), (1, 1), (2, 2), (4, 5), (9, 31)):
        batch = sources[start : start + size]
        for kwargs in settings:
            step_tokens, step_scores = search(batch, None, **kwargs)
            for graph in graphs:
                graph_tokens, graph_scores = search(batch, graph, **kwargs)
                assert graph_tokens == step_tokens, (graph, kwargs)
                np.testing.assert_allclose(graph_scores, step_scores, **tolerance)
            assert all(len(t) <= kwargs.get("max_length", 99) for t in step_tokens)
            if precision == "float32" and kwargs == settings[0]:
                keras_tokens, keras_scores = beam_search(model, batch, beam_size=4)
                assert step_tokens == keras_tokens
                np.testing.assert_allclose(step_scores, keras_scores, atol=1e-3)
    # More beams than the graphs' ranking takes (2 * beam > vocabulary): the Python loop.
    for limit in (4, 0):
        monkeypatch.setattr(runtime, "BEAM_GRAPH_MAX_SENTENCES", limit)
        monkeypatch.setattr(runtime, "BEAM_BATCH_GRAPH", True)
        monkeypatch.setattr(translator, "_beam_in_graph", lambda *a: pytest.fail("graph used"))
        wide = translator.vocabulary_size // 2 + 1
        assert translator.beam_search(sources[:1], beam_size=wide)[0][0] == (
            beam_search(model, sources[:1], beam_size=wide)[0][0] if precision == "float32" else ANY
        )
    # An empty source in the batch: an empty output and score 0, as step by step.
    step_tokens, step_scores = search([sources[0], [], sources[1]], None, beam_size=4)
    for graph in graphs:
        tokens, scores = search([sources[0], [], sources[1]], graph, beam_size=4)
        assert tokens == step_tokens
        np.testing.assert_allclose(scores, step_scores, rtol=0, atol=1e-5)
        assert tokens[1] == [] and scores[1] == 0


def test_float16_graphs_translate_within_half_a_point_of_float32(exported, toy_run):
    _, _, translator, out = exported("float32")
    half = OnnxTranslator(out, precision="float16")
    lines = held_out_lines(200, seed=47)
    references = [toy_run[1].translate(line) for line in lines]  # the toy run's language
    scores = {}
    for name, runner in (("float32", translator), ("float16", half)):
        outputs = runner.translate(lines, beam_size=1)
        scores[name] = 100 * np.mean([o == r for o, r in zip(outputs, references, strict=True)])
    assert scores["float32"] >= 10  # the briefly trained model gets a fair share right
    assert abs(scores["float16"] - scores["float32"]) <= 0.5, scores


def test_int8_graphs_are_smaller_and_translate_no_worse_than_float32(toy_run, tmp_path, caplog):
    """`--precision int8`: quantized weight matrices, a smaller folder, and the toy
    language translated at least as well as in float32, less at most one point."""
    out = str(tmp_path / "int8")
    with caplog.at_level(logging.WARNING):
        assert cli.main(["export", toy_run[3]["run_dir"], "--out", out, "--precision", "int8"]) == 0
    assert not [r for r in caplog.records if "quantization" in r.getMessage()]
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["precisions"] == ["float32", "int8"]
    for name, graph in manifest["graphs"].items():
        quantized = onnx.load(os.path.join(out, graph["int8"]))
        ops = _op_types(quantized.graph)
        assert ops & {"MatMulInteger", "DynamicQuantizeLinear"}, name
        # The embedding table too is int8 (one scale per row), in every graph.
        vocabulary = manifest["config"]["vocabulary_size"]
        tables = [
            t.data_type
            for g in _subgraphs(quantized.graph)
            for t in g.initializer
            if len(t.dims) == 2 and t.dims[0] == vocabulary and t.dims[1] > 1  # not the scales
        ]
        assert onnx.TensorProto.INT8 in tables and onnx.TensorProto.FLOAT not in tables, name

    def products(name):
        graph = onnx.load(os.path.join(out, manifest["graphs"][name]["int8"])).graph
        kinds = ("MatMulInteger", "DynamicQuantizeMatMul")
        return sum(n.op_type in kinds for g in _subgraphs(graph) for n in g.node)

    # The int8 greedy batch graph makes its decoder steps two per loop iteration.
    assert BATCH_STEPS_PER_ITERATION["int8"] == 2
    assert products("greedy_batch_search") == 2 * products("decoder_step") > 0
    assert products("greedy_search") == products("decoder_step")
    for full_file, int8_file in (
        ("model.onnx", "model_int8.onnx"),
        ("weights.bin", "weights_int8.bin"),
    ):
        full_size = os.path.getsize(os.path.join(out, full_file))
        assert os.path.getsize(os.path.join(out, int8_file)) < 0.6 * full_size
    full, quantized = OnnxTranslator(out), OnnxTranslator(out, precision="int8")
    lines = held_out_lines(200, seed=59)
    references = [toy_run[1].translate(line) for line in lines]
    scores = {}
    for name, runner in (("float32", full), ("int8", quantized)):
        outputs = runner.translate(lines, beam_size=1)
        scores[name] = 100 * np.mean([o == r for o, r in zip(outputs, references, strict=True)])
    assert scores["float32"] >= 10
    # What int8 may not do is lose accuracy; rounding differences that help
    # a few sentences (on 200, one point is two sentences) are no defect.
    assert scores["int8"] >= scores["float32"] - 1.0, scores
    # A step's activations share one int8 scale per batch: whole batches
    # unless told, so that the translations do not depend on the threads.
    cpu = ["CPUExecutionProvider"]
    assert OnnxTranslator(out, cpu, num_threads=2, precision="int8").split_parts(64, 4) == 1
    told = OnnxTranslator(out, cpu, num_threads=2, precision="int8", split_batches=True)
    assert told.split_parts(64, 4) == 2
    assert OnnxTranslator(out, cpu, num_threads=2).split_parts(64, 4) == 2
    with pytest.raises(ValueError, match="no 'float16' graphs"):
        OnnxTranslator(out, precision="float16")


# --------------------------------------------------------------------------- runtime contract


def test_runtime_imports_neither_tensorflow_nor_keras(exported):
    """A fresh interpreter translates through the module CLI without loading either."""
    out = exported("mixed_bfloat16")[3]
    code = (
        "import io, sys\n"
        "sys.stdin = io.StringIO('ka ko\\n\\nli lo mina\\n')\n"
        "from keras_transformer_runtime.translate import main\n"
        f"main([{out!r}, '--beam', '2'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stderr
    lines = result.stdout.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # one line per input line


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = {"tensorflow", "tensorflow-cpu", "tensorflow-text", "tf2onnx", "keras", "jax", "jaxlib"}


def test_runtime_distribution_alone_translates_without_tensorflow(exported, tmp_path):
    """A fresh venv that installs only ./runtime holds no TensorFlow, Keras or JAX and
    translates an export through its console script, as the in-process runtime does."""
    _, _, translator, out = exported("mixed_bfloat16")
    venv = tmp_path / "runtime-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip", "--python", python]
    installed = subprocess.run(
        [*pip, "install", "--quiet", os.path.join(ROOT, "runtime")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert installed.returncode == 0, installed.stderr
    listed = subprocess.run(
        [*pip, "list", "--format=freeze"], capture_output=True, text=True, env=env, check=True
    )
    names = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert "keras-transformer-runtime" in names and "sentencepiece" in names
    assert not names & HEAVY, sorted(names & HEAVY)
    assert "keras-transformer" not in names
    lines = held_out_lines(24, seed=47)
    result = subprocess.run(
        [str(venv / "bin" / "keras-transformer-translate"), out, "--beam", "2", "--cpu"],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == translator.translate(lines, beam_size=2)


def test_module_command_translates_stdin_in_order(exported):
    model, tokenizer, _, out = exported("float32")
    lines = held_out_lines(40, seed=43)
    result = subprocess.run(
        [sys.executable, "-m", "keras_transformer_runtime.translate", out, "--beam", "1"],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "provider: CPUExecutionProvider" in result.stderr or "CUDA" in result.stderr
    assert result.stdout.splitlines() == translate_lines(model, tokenizer, lines, beam_size=1)


def _runtime_command(out, lines, *flags):
    """`python -m keras_transformer_runtime.translate OUT FLAGS` with `lines` on stdin."""
    return subprocess.run(
        [sys.executable, "-m", "keras_transformer_runtime.translate", out, *flags],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_search_graphs_spin_and_the_encoder_sleeps_unless_told(exported):
    """By default the sessions of the graphs that run decoder steps let their idle
    worker threads spin and the encoder's sleep, and in float32 the greedy batch
    graph's sleep too; `spinning=True` or `False` sets every session; the
    translations are the same under each policy."""
    from keras_transformer_runtime.runtime import SLEEPING_FLOAT32_GRAPHS, SPINNING_GRAPHS

    _, _, _, out = exported("float32")
    lines = held_out_lines(10, seed=59)
    graphs = ("encoder", "decoder_step", "greedy_search", "greedy_batch_search", "beam_search")
    graphs += ("beam_batch_search",)
    assert set(SPINNING_GRAPHS) == set(graphs) - {"encoder"}
    assert set(SLEEPING_FLOAT32_GRAPHS) == {"greedy_batch_search"}
    translations = {}
    for spinning, expected in (
        (None, {**dict.fromkeys(graphs, "1"), "encoder": "0", "greedy_batch_search": "0"}),
        (True, dict.fromkeys(graphs, "1")),
        (False, dict.fromkeys(graphs, "0")),
    ):
        translator = OnnxTranslator(
            out, providers=["CPUExecutionProvider"], num_threads=2, spinning=spinning
        )
        found = {
            name: translator.session(name)
            .get_session_options()
            .get_session_config_entry("session.intra_op.allow_spinning")
            for name in graphs
        }
        assert found == expected, spinning
        # Batches of 2 and of 6: the search graphs and their batch versions.
        translations[spinning] = [
            translator.translate(lines, beam_size=beam, batch_size=batch)
            for beam in (1, 3)
            for batch in (2, 6)
        ]
    assert translations[True] == translations[None] == translations[False]
    # Only the float32 greedy batch graph sleeps: the float16 one spins.
    half = OnnxTranslator(out, providers=["CPUExecutionProvider"], precision="float16")
    options = half.session("greedy_batch_search").get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"


def test_a_beam_too_wide_for_the_blocked_graphs_searches_in_python(exported, monkeypatch):
    """Beam graphs that select block by block take `2 * beam_size` up to their
    manifest's `max_top_k`; a wider beam runs the Python loop over the decoder
    step (its full `TopK`), with the same results."""
    _, tokenizer, _, out = exported("float32")
    translator = OnnxTranslator(out, providers=["CPUExecutionProvider"], split_batches=False)
    sources = _sources(tokenizer, held_out_lines(6, seed=11))
    expected = {beam: translator.beam_search(sources, beam_size=beam) for beam in (2, 3)}
    for graph in ("beam_search", "beam_batch_search"):
        translator.manifest["graphs"][graph]["max_top_k"] = 4
    calls = []
    in_graph = translator._beam_in_graph
    monkeypatch.setattr(
        translator, "_beam_in_graph", lambda *a, **k: calls.append(a) or in_graph(*a, **k)
    )
    for beam, graph_calls in ((3, 0), (2, 1)):  # 2 x 3 > 4: Python; 2 x 2 = 4: the graph
        tokens, scores = translator.beam_search(sources, beam_size=beam)
        assert len(calls) == graph_calls
        assert tokens == expected[beam][0]
        np.testing.assert_allclose(scores, expected[beam][1], rtol=0, atol=1e-5)


def test_a_batch_searches_as_one_part_per_thread(exported, monkeypatch, capsys):
    """On the CPU with several threads, a batch with enough decoder rows runs as
    one search per thread, each part on a one-thread translator of its own, the
    parts at once: the same tokens and scores as the whole batch, in input order.
    How many parts: one per thread or none; each of at least `SPLIT_MIN_ROWS`
    rows, or with `split_batches=True` one sentence; never with `False` (int8:
    `test_int8_graphs_are_smaller_and_translate_no_worse_than_float32`)."""
    import threading

    from keras_transformer_runtime.runtime import SPLIT_MIN_ROWS

    _, tokenizer, _, out = exported("float32")
    assert SPLIT_MIN_ROWS == 8
    cpu = ["CPUExecutionProvider"]
    two = OnnxTranslator(out, providers=cpu, num_threads=2)
    four = OnnxTranslator(out, providers=cpu, num_threads=4)
    assert [two.split_parts(n) for n in (1, 8, 15, 16, 40)] == [1, 1, 1, 2, 2]
    assert [two.split_parts(n, beam_size=4) for n in (1, 2, 3, 4)] == [1, 1, 1, 2]
    assert [four.split_parts(n) for n in (16, 31, 32, 64)] == [1, 1, 4, 4]  # all threads or none
    forced = OnnxTranslator(out, providers=cpu, num_threads=2, split_batches=True)
    assert [forced.split_parts(n) for n in (1, 2, 3)] == [1, 2, 2]
    forced_four = OnnxTranslator(out, providers=cpu, num_threads=4, split_batches=True)
    assert [forced_four.split_parts(n) for n in (3, 4)] == [1, 4]
    whole = OnnxTranslator(out, providers=cpu, num_threads=2, split_batches=False)
    assert whole.split_parts(64, beam_size=4) == 1
    assert OnnxTranslator(out, providers=cpu, num_threads=1).split_parts(64, beam_size=4) == 1

    lines = held_out_lines(19, seed=61)
    lines[4] = ""  # an empty source in one part
    sources = _sources(tokenizer, lines)
    sources[4] = []
    calls = []
    for search, beam in (("greedy_search", 1), ("beam_search", 3)):
        kwargs = {} if beam == 1 else {"beam_size": beam}
        expected_tokens, expected_scores = getattr(whole, search)(sources, **kwargs)
        for translator in (two, forced):
            tokens, scores = getattr(translator, search)(sources, **kwargs)
            assert tokens == expected_tokens, (search, translator._split)
            np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=1e-5)
        workers = two._split_workers
        assert len(workers) == 2  # made once, kept
        assert all(w.threads() == 1 and w.split_parts(64, 4) == 1 for w in workers)
        for worker in workers:
            options = worker.session("encoder").get_session_options()
            assert options.intra_op_num_threads == 1
            method = getattr(worker, search)

            def record(rows, *args, _method=method, _search=search, **kw):
                calls.append((_search, len(rows), threading.current_thread()))
                return _method(rows, *args, **kw)

            setattr(worker, search, record)
        assert getattr(two, search)(sources, **kwargs)[0] == expected_tokens
    # Each search: two parts (10 and 9 sentences), one on another thread.
    for search in ("greedy_search", "beam_search"):
        parts = [(rows, thread) for name, rows, thread in calls if name == search]
        assert sorted(rows for rows, _ in parts) == [9, 10]
        assert {thread is threading.current_thread() for _, thread in parts} == {True, False}

    # The runtime command: `--whole-batches` keeps batches whole, the same lines.
    from keras_transformer_runtime import translate as runtime_command

    made = []

    class Recording(OnnxTranslator):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("split_batches"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(runtime_command, "OnnxTranslator", Recording)
    expected = two.translate(lines, beam_size=3)
    for flags, split in (([], None), (["--whole-batches"], False)):
        monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
        assert runtime_command.main([out, "--cpu", "--threads", "2", "--beam", "3", *flags]) == 0
        assert capsys.readouterr().out.splitlines() == expected
        assert made[-1] is split


def test_parallel_batches_translate_as_one_batch_at_a_time(exported):
    """Several batches searched at once (beam searches each on a translator copy
    with sessions of its own, made once and kept; greedy ones on shared sessions):
    every line gets the translation it gets alone, in input order, through the
    Python API and the command; a count below 1 is refused by name."""
    _, _, translator, out = exported("mixed_bfloat16")
    lines = held_out_lines(90, seed=53)
    one_thread = OnnxTranslator(out, providers=["CPUExecutionProvider"], num_threads=1)
    for beam in (1, 3):
        alone = translator.translate(lines, beam_size=beam, batch_size=8)
        assert (
            one_thread.translate(lines, beam_size=beam, batch_size=8, parallel_batches=3) == alone
        )
    copies = one_thread._parallel_translators(3, beam_size=3)
    assert copies[0] is one_thread and len(copies) == 3 and one_thread._copies == copies[1:]
    encoders = {id(t.session("encoder")) for t in copies}
    assert len(encoders) == 3  # no session shared between two beam searches
    assert one_thread._parallel_translators(3, beam_size=2) == copies  # kept, not made again
    assert one_thread._parallel_translators(3, beam_size=1) == [one_thread] * 3
    one_thread._parallel_sessions = "shared"
    assert one_thread._parallel_translators(2, beam_size=4) == [one_thread] * 2
    one_thread._parallel_sessions = "own"
    assert one_thread._parallel_translators(2, beam_size=1) == copies[:2]
    with pytest.raises(ValueError, match="parallel_batches must be a positive integer"):
        translator.translate(lines, parallel_batches=0)

    def command(*flags):
        return _runtime_command(out, lines, *flags)

    done = command("--beam", "2", "--batch-size", "8", "--parallel-batches", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == translator.translate(lines, beam_size=2, batch_size=8)
    refused = command("--parallel-batches", "0")
    assert refused.returncode != 0 and "--parallel-batches must be a positive integer" in (
        refused.stderr
    )


def test_length_penalty_reaches_the_runtime_search_as_in_keras(exported):
    """`--length-penalty` of the runtime command: the beam outputs of Keras at that
    alpha, a large alpha lengthens them, and a negative one is refused by name."""
    model, tokenizer, _, out = exported("float32")
    lines = held_out_lines(40, seed=47)

    def command(*flags):
        return _runtime_command(out, lines, *flags)

    long_ones = command("--beam", "3", "--length-penalty", "4")
    assert long_ones.returncode == 0, long_ones.stderr
    keras_long = translate_lines(model, tokenizer, lines, beam_size=3, length_penalty=4.0)
    assert long_ones.stdout.splitlines() == keras_long
    keras_short = translate_lines(model, tokenizer, lines, beam_size=3, length_penalty=0.0)
    assert sum(map(len, keras_long)) > sum(map(len, keras_short))
    refused = command("--length-penalty", "-1")
    assert refused.returncode != 0
    assert "--length-penalty must be a non-negative number" in refused.stderr


def test_empty_inputs_and_unseen_characters(exported):
    _, _, translator, _ = exported("mixed_bfloat16")  # SentencePiece with byte fallback
    assert translator.translate([]) == []
    assert translator.translate(["", "   "]) == ["", ""]
    outputs = translator.translate(["ka 漢字 ko 🙂 ñandú", "ka ko"], beam_size=2)
    assert len(outputs) == 2 and all(isinstance(o, str) for o in outputs)
    _, _, words, _ = exported("float32")  # word vocabulary: unknown words become <unk>
    assert len(words.translate(["ka zzzz ko"], beam_size=1)) == 1


def test_bad_runtime_inputs_raise_clear_errors(exported):
    _, _, translator, _ = exported("float32")
    source = np.array([[5, 6, 2]], np.int32)
    with pytest.raises(ValueError, match="integer token ids"):
        translator.encode(source.astype(np.float32))
    with pytest.raises(ValueError, match="rank 2"):
        translator.encode(source[0])
    _, mask, cross = translator.encode(source)
    caches = translator.empty_self_caches(1)
    with pytest.raises(ValueError, match=r"token_ids must have shape \(batch, 1\)"):
        translator.decoder_step(np.array([[1, 1]]), mask, cross, caches)
    with pytest.raises(ValueError, match="source_mask must be a bool"):
        translator.decoder_step(np.array([[1]]), mask.astype(np.int32), cross, caches)
    with pytest.raises(ValueError, match="self_key_0 must be float32"):
        translator.decoder_step(
            np.array([[1]]), mask, cross, [c.astype(np.float64) for c in caches]
        )
    with pytest.raises(ValueError, match="cross_value_0 must have shape"):
        translator.decoder_step(
            np.array([[1]]), mask, [cross[0], cross[1][..., :2], *cross[2:]], caches
        )
    with pytest.raises(ValueError, match="Expected 4 self-attention arrays"):
        translator.decoder_step(np.array([[1]]), mask, cross, caches[:1])
    log_probs, grown = translator.decoder_step(np.array([[1]]), mask, cross, caches)
    assert log_probs.shape == (1, translator.vocabulary_size) and grown[0].shape[2] == 1
    with pytest.raises(ValueError, match="beam_size must be a positive integer"):
        translator.translate(["ka"], beam_size=0)
    with pytest.raises(TypeError, match="list of strings"):
        translator.translate("ka ko")


def test_pre_norm_untied_model_graphs_match_keras(tmp_path):
    """The node-by-node encoder and step also cover the other model shapes:
    pre-norm layers with final norms, separate output projection, and a source
    with no token at all (Keras gives its queries zeros, not an average)."""
    from keras_transformer.config import TransformerConfig
    from keras_transformer.model import build_transformer

    keras.utils.set_random_seed(3)
    config = TransformerConfig(
        vocabulary_size=50,
        num_layers=2,
        hidden_dim=32,
        intermediate_dim=48,
        num_heads=4,
        max_length=16,
        normalize_first=True,
        tie_embeddings=False,
    )
    model = build_transformer(config)
    out = str(tmp_path / "onnx")
    export_onnx(model, out)
    translator = OnnxTranslator(out)
    parts = transformer_parts(model)
    source = np.array([[5, 6, 7, 8, 2], [9, 2, 0, 0, 0], [0, 0, 0, 0, 0]], np.int32)
    target = np.array([[1, 5, 9], [1, 7, 0], [1, 4, 4]], np.int32)
    encoded, mask, cross = translator.encode(source)
    keras_encoded, keras_mask = parts.encode(source)
    np.testing.assert_allclose(encoded, keras.ops.convert_to_numpy(keras_encoded), atol=1e-5)
    np.testing.assert_array_equal(mask, keras.ops.convert_to_numpy(keras_mask))
    logits = keras.ops.convert_to_numpy(model({"source_ids": source, "target_ids": target}))
    log_probs = keras.ops.convert_to_numpy(keras.ops.log_softmax(logits, axis=-1))
    caches = translator.empty_self_caches(len(source))
    for t in range(target.shape[1]):
        step, caches = translator.decoder_step(target[:, t : t + 1], mask, cross, caches)
        # Real target tokens of rows with a source only: the searches never
        # decode a sentence without one (its output is empty), so the step
        # spends no node on that case.
        rows = (target[:, t] != 0) & mask.any(axis=1)
        np.testing.assert_allclose(step[rows], log_probs[rows, t], atol=1e-4)


def test_step_rows_of_a_sentence_share_its_cross_caches(exported):
    """The step takes the cross keys and values once per sentence: G consecutive
    rows per sentence (its beams) give what each row gives alone, and a row count
    that is not a multiple of the sentences is refused with its reason."""
    _, _, translator, _ = exported("float32")
    source = np.array([[5, 6, 7, 2], [8, 9, 2, 0]], np.int32)
    _, mask, cross = translator.encode(source)
    tokens = np.array([[1, 5, 6], [1, 8, 4]], np.int32)  # three rows per sentence
    rows = len(source) * tokens.shape[1]
    caches = translator.empty_self_caches(rows)
    for t in range(2):  # two steps, so that the self caches are not empty
        fed = tokens.reshape(-1, 1) if t else np.full((rows, 1), 1, np.int32)
        grouped, caches = translator.decoder_step(fed, mask, cross, caches)
    for row in range(rows):
        sentence = row // tokens.shape[1]
        alone = translator.empty_self_caches(1)
        for t in range(2):
            fed = np.array([[tokens.reshape(-1)[row] if t else 1]], np.int32)
            single, alone = translator.decoder_step(
                fed,
                mask[sentence : sentence + 1],
                [c[sentence : sentence + 1] for c in cross],
                alone,
            )
        np.testing.assert_allclose(grouped[row], single[0], atol=1e-5)
        np.testing.assert_allclose(caches[0][row], alone[0][0], atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple of the 2 sentences"):
        translator.decoder_step(
            np.ones((5, 1), np.int32), mask, cross, translator.empty_self_caches(5)
        )


def test_over_long_lines_translate_as_in_keras_with_a_warning(exported):
    """Past max_length the graphs compute their positions as Keras does: a long line
    among normal ones is translated like Keras, and the command warns and goes on."""
    model, tokenizer, translator, out = exported("mixed_bfloat16")
    normal = held_out_lines(6, seed=53)
    long_line = " ".join(normal * 10)
    tokens = len(tokenizer.encode(long_line)) + 1  # with EOS
    assert tokens > translator.max_length
    lines = normal[:2] + [long_line] + normal[2:]
    for beam in (1, 3):
        expected = translate_lines(model, tokenizer, lines, beam_size=beam)
        assert translator.translate(lines, beam_size=beam) == expected
    result = subprocess.run(
        [sys.executable, "-m", "keras_transformer_runtime.translate", out, "--beam", "1"],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == translator.translate(lines, beam_size=1)
    assert "Traceback" not in result.stderr
    assert (
        f"warning: line 3 has {tokens} tokens, more than the model's "
        f"max_length={translator.max_length}; translated whole" in result.stderr
    )
    assert f"warning: 1 of {len(lines)} lines were longer than" in result.stderr


@pytest.mark.parametrize(
    "damage,match",
    [
        ("missing:decoder_step.onnx", "ONNX graph missing: .*decoder_step.onnx"),
        ("corrupt:encoder.onnx", "Cannot load the ONNX graph .*encoder.onnx"),
        ("missing:weights.bin", "weights.bin missing from .*copy the whole export folder"),
        ("corrupt:weights.bin", "weights.bin has 23 bytes, not the [0-9]+ the export wrote"),
        ("missing:manifest.json", "manifest.json missing"),
        ("corrupt:manifest.json", "manifest.json is not a valid export manifest"),
        ("missing:vocab.txt", "Tokenizer file missing: .*vocab.txt"),
        ("missing:spm.model", "Tokenizer file missing: .*spm.model"),
        ("corrupt:spm.model", "Cannot read the tokenizer .*spm.model: not a SentencePiece model"),
    ],
)
def test_damaged_export_folders_name_the_file(exported, tmp_path, damage, match):
    import shutil

    action, name = damage.split(":")
    copy = tmp_path / "copy"
    kind = "mixed_bfloat16" if name == "spm.model" else "float32"
    shutil.copytree(exported(kind)[3], copy)
    if action == "missing":
        (copy / name).unlink()
    else:
        (copy / name).write_bytes(b"\x00 not what it should be")
    with pytest.raises(ExportFileError, match=match):
        OnnxTranslator(copy)
    result = subprocess.run(
        [sys.executable, "-m", "keras_transformer_runtime.translate", str(copy)],
        input="ka\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "error:" in result.stderr and name in result.stderr
    assert "Traceback" not in result.stderr
