"""The ONNX exporter (`keras_transformer.export.onnx`): the folder it writes, and
its encoder, decoder step and whole-model graphs against Keras, in float32,
float16 and int8."""

import dataclasses
import json
import logging
import os

import keras
import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the ONNX tests run once, in the TensorFlow tier (the export itself takes either backend: tests/test_model.py)",
)

from keras_transformer_runtime import OnnxTranslator  # noqa: E402
from keras_transformer_runtime.specials import BOS_ID, PAD_ID  # noqa: E402

from keras_transformer import cli  # noqa: E402
from keras_transformer.export.onnx import (  # noqa: E402
    BATCH_STEPS_PER_ITERATION,
    ExportError,
    export_onnx,
    float32_copy,
)
from keras_transformer.model import transformer_parts  # noqa: E402
from keras_transformer.translation import load_run  # noqa: E402
from tests.onnx_helpers import (  # noqa: E402
    KINDS,
    held_out_lines,
    op_types,
    padded,
    source_ids,
    subgraphs,
)

# --------------------------------------------------------------------------- the export itself


def test_export_folder_is_complete_and_valid(exported):
    model, _, translator, out = exported("float32")
    names = set(os.listdir(out))
    graphs = {
        "encoder", "decoder_step", "greedy_search", "greedy_batch_search", "beam_search",
        "beam_batch_search", "forced_scores", "alignment", "teacher_forced",
    }  # fmt: skip
    assert names == {f"{g}{suffix}.onnx" for g in graphs for suffix in ("", "_fp16")} | {
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
    forced = manifest["graphs"]["forced_scores"]
    assert forced["inputs"]["target_ids"]["shape"] == ["batch", "target_len"]
    assert forced["inputs"]["labels"]["shape"] == ["batch", "target_len"]
    # One score per label that is not padding, in row order.
    assert forced["outputs"]["label_log_probs"] == {"dtype": "float32", "shape": ["positions"]}
    assert manifest["graphs"]["teacher_forced"]["outputs"]["log_probs"]["shape"] == [
        "batch", "target_len", config.vocabulary_size,
    ]  # fmt: skip
    assert manifest["graphs"]["alignment"]["outputs"]["alignment_weights"] == {
        "dtype": "float32",
        "shape": ["batch", "target_len", "source_len"],
    }
    masks = {
        "suppressed": {"dtype": "int64", "shape": ["suppressed"]},
        "min_length": {"dtype": "int64", "shape": []},
    }
    assert step["outputs"]["alignment_weights"] == {
        "dtype": "float32",
        "shape": ["batch", "source_len"],
    }
    # Every search graph returns alignments where its `alignment` input asks.
    aligned = {"dtype": "float32", "shape": ["steps", "sentences", "width"]}
    for name in ("greedy_search", "greedy_batch_search"):
        search = manifest["graphs"][name]
        assert search["inputs"]["limits"] == {"dtype": "int64", "shape": ["sentences"]}
        assert {k: search["inputs"][k] for k in masks} == masks
        assert search["outputs"]["tokens"] == {"dtype": "int64", "shape": ["steps", "sentences"]}
        assert search["inputs"]["alignment"] == {"dtype": "bool", "shape": []}
        assert search["outputs"]["alignments"] == aligned
    for name in ("beam_search", "beam_batch_search"):
        beam = manifest["graphs"][name]
        assert beam["inputs"]["beam_size"] == {"dtype": "int64", "shape": []}
        assert beam["inputs"]["length_penalty"] == {"dtype": "float64", "shape": []}
        assert beam["inputs"]["n_best"] == {"dtype": "int64", "shape": []}
        assert beam["inputs"]["alignment"] == {"dtype": "bool", "shape": []}
        assert beam["outputs"]["alignments"]["shape"] == ["sentences", "n_best", "steps", "width"]
        assert {k: beam["inputs"][k] for k in masks} == masks
        hypotheses = ["sentences", "n_best", "steps"]
        assert beam["outputs"]["tokens"] == {"dtype": "int64", "shape": hypotheses}
        assert beam["outputs"]["scores"] == {"dtype": "float64", "shape": hypotheses[:2]}
        assert beam["outputs"]["token_scores"] == {"dtype": "float64", "shape": hypotheses}
    assert manifest["format_version"] == 8
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
                for g in subgraphs(graph)
                for tensor in g.initializer
                if tensor.data_location == onnx.TensorProto.EXTERNAL
            }
            assert {e["location"] for e in entries.values()} == {weights}
            # Every constant is read (ONNX Runtime warns of the others on load).
            read = {i for g in subgraphs(graph) for node in g.node for i in node.input}
            held = [t.name for g in subgraphs(graph) for t in g.initializer]
            assert set(held) <= read, (n, set(held) - read)
            inline = [
                t.name
                for g in subgraphs(graph)
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
    assert {"tensorflow", "onnx", "onnxruntime", "keras"} <= set(manifest["versions"])
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
    sources = source_ids(tokenizer, lines)
    # Targets of varied lengths, so that both sides carry padding.
    targets = [[1] + list(rng.integers(4, 40, size=rng.integers(1, 14))) for _ in lines]
    source, target = padded(sources), padded(targets)
    assert (source == 0).any() and (target == 0).any()

    encoded, mask, cross = translator.decoder.encode(source)
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
    log_probs = keras.ops.convert_to_numpy(keras.ops.log_softmax(logits, axis=-1))
    real = target != 0
    # The teacher-forced graphs: every position's distribution, and the labels' entries.
    forced = translator.decoder.log_probs(source, target)
    np.testing.assert_allclose(forced[real], log_probs[real], atol=1e-4)
    # Any label at a real position (padding's own id included): each is scored;
    # positions whose input is padding are not (0).
    labels = np.random.default_rng(5).integers(0, parts.config.vocabulary_size, target.shape)
    labels[:, 0] = 0
    picked = translator.decoder.label_log_probs(source, target, labels)
    assert picked.dtype == np.float64 and picked.shape == target.shape
    expected = np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
    assert (picked[~real] == 0).all() and (picked[real] < 0).all()
    np.testing.assert_allclose(picked[real], expected[real], atol=1e-4)

    # The cached step, fed the targets one token at a time, gives the
    # teacher-forced log-probabilities at every real position.
    caches = translator.decoder.empty_self_caches(len(source))
    for t in range(target.shape[1]):
        feeds = translator.decoder.search_feeds(mask, cross)
        feeds["token_ids"] = target[:, t : t + 1]
        feeds.update(zip(translator.decoder.cache_names("self"), caches, strict=True))
        feeds["top_k"] = np.array([7], np.int64)
        selected = translator.decoder.step_session.run(["top_log_probs", "top_ids"], feeds)
        step_log_probs, caches = translator.decoder.decoder_step(
            target[:, t : t + 1], mask, cross, caches
        )
        assert all(cache.shape[2] == t + 1 for cache in caches)
        np.testing.assert_allclose(step_log_probs[real[:, t]], log_probs[real[:, t], t], atol=1e-4)
        # The graph's own selection: each row's 7 best tokens but padding and BOS, best first.
        values, ids = selected
        allowed = step_log_probs.copy()
        allowed[:, [PAD_ID, BOS_ID]] = -np.inf
        assert ids.shape == (len(source), 7) and not np.isin(ids, [PAD_ID, BOS_ID]).any()
        np.testing.assert_array_equal(values, np.take_along_axis(allowed, ids, axis=1))
        np.testing.assert_array_equal(values, -np.sort(-allowed, axis=1)[:, :7])


# Model shapes beyond the paper's that the node-by-node graphs must follow.
MODEL_SHAPES = {
    # pre-norm layers with final norms, a separate output projection
    "pre-norm-untied": dict(normalize_first=True, tie_embeddings=False),
    # Marian's options: concatenated sinusoids, swish, an output bias,
    # unscaled embeddings, a deeper encoder than decoder
    "marian-swish": dict(
        positional_layout="concatenated",
        activation="swish",
        output_bias=True,
        embedding_scale=1.0,
        num_encoder_layers=3,
        num_decoder_layers=1,
        layer_norm_epsilon=1e-5,
    ),
    # separate source vocabulary, the decoder embedding tied to the output, GELU
    "separate-vocabularies-gelu": dict(
        tie_embeddings=False,
        tie_decoder_output=True,
        source_vocabulary_size=37,
        activation="gelu",
        output_bias=True,
    ),
}


@pytest.mark.parametrize("shape", sorted(MODEL_SHAPES))
def test_other_model_shapes_graphs_match_keras(shape, tmp_path):
    """The node-by-node encoder and step also cover the other model shapes
    (`MODEL_SHAPES`), and a source with no token at all (Keras gives its
    queries zeros, not an average)."""
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
        **MODEL_SHAPES[shape],
    )
    model = build_transformer(config)
    parts = transformer_parts(model)
    # The model recovers its config (num_layers is only the depths' shorthand).
    assert dataclasses.replace(parts.config, num_layers=config.num_layers) == config
    if parts.target_embedding.logits_bias is not None:
        parts.target_embedding.logits_bias.assign(np.linspace(-2, 2, 50).astype("float32"))
    out = str(tmp_path / "onnx")
    tied = parts.output_projection is None
    export_onnx(model, out, precision="int8" if tied else "float32")
    translator = OnnxTranslator(out)
    if tied:  # the output product reads the lookups' table: held once in each precision
        check_tied_table_held_once(out, config.vocabulary_size, config.hidden_dim)
    # Positions past the table (16) are computed, in both layouts.
    source = np.array([[5, 6, 7, 8] * 5 + [2], [9, 2] + [0] * 19, [0] * 21], np.int32)
    target = np.array([[1, 5, 9], [1, 7, 0], [1, 4, 4]], np.int32)
    encoded, mask, cross = translator.decoder.encode(source)
    keras_encoded, keras_mask = parts.encode(source)
    np.testing.assert_allclose(encoded, keras.ops.convert_to_numpy(keras_encoded), atol=1e-5)
    np.testing.assert_array_equal(mask, keras.ops.convert_to_numpy(keras_mask))
    logits = keras.ops.convert_to_numpy(model({"source_ids": source, "target_ids": target}))
    log_probs = keras.ops.convert_to_numpy(keras.ops.log_softmax(logits, axis=-1))
    caches = translator.decoder.empty_self_caches(len(source))
    for t in range(target.shape[1]):
        step, caches = translator.decoder.decoder_step(target[:, t : t + 1], mask, cross, caches)
        # Real target tokens of rows with a source only: the searches never
        # decode a sentence without one (its output is empty), so the step
        # spends no node on that case.
        rows = (target[:, t] != 0) & mask.any(axis=1)
        np.testing.assert_allclose(step[rows], log_probs[rows, t], atol=1e-4)
    # The teacher-forced pass (all positions at once) as well.
    forced = translator.decoder.log_probs(source, target)
    rows = (target != 0) & mask.any(axis=1)[:, None]
    np.testing.assert_allclose(forced[rows], log_probs[rows], atol=1e-4)
    if tied:  # and in int8, near enough for the rows and scales to be the right ones
        int8 = OnnxTranslator(out, precision="int8").decoder.log_probs(source, target)
        np.testing.assert_allclose(int8[rows], log_probs[rows], atol=0.05)


def check_tied_table_held_once(out, vocabulary_size, hidden_dim):
    """Each graph in `out` holds the tied `(vocabulary, hidden)` table at most
    once, in either layout (the decoder step exactly once): the int8 graphs in
    int8, one table for the lookups and the product."""
    with open(os.path.join(out, "manifest.json")) as f:
        graphs = json.load(f)["graphs"]
    shape = sorted([vocabulary_size, hidden_dim])
    for name, graph in graphs.items():
        for precision in ("float32", "int8"):
            proto = onnx.load(os.path.join(out, graph[precision]), load_external_data=False)
            held = [
                (t.name, t.data_type)
                for g in subgraphs(proto.graph)
                for t in g.initializer
                if sorted(t.dims) == shape
            ]
            assert len(held) <= 1 and (name != "decoder_step" or held), (precision, name, held)
            if precision == "int8":
                assert all(kind == onnx.TensorProto.INT8 for _, kind in held), (name, held)


def test_step_rows_of_a_sentence_share_its_cross_caches(exported):
    """The step takes the cross keys and values once per sentence: G consecutive
    rows per sentence (its beams) give what each row gives alone, and a row count
    that is not a multiple of the sentences is refused with its reason."""
    _, _, translator, _ = exported("float32")
    source = np.array([[5, 6, 7, 2], [8, 9, 2, 0]], np.int32)
    _, mask, cross = translator.decoder.encode(source)
    tokens = np.array([[1, 5, 6], [1, 8, 4]], np.int32)  # three rows per sentence
    rows = len(source) * tokens.shape[1]
    caches = translator.decoder.empty_self_caches(rows)
    for t in range(2):  # two steps, so that the self caches are not empty
        fed = tokens.reshape(-1, 1) if t else np.full((rows, 1), 1, np.int32)
        grouped, caches = translator.decoder.decoder_step(fed, mask, cross, caches)
    for row in range(rows):
        sentence = row // tokens.shape[1]
        alone = translator.decoder.empty_self_caches(1)
        for t in range(2):
            fed = np.array([[tokens.reshape(-1)[row] if t else 1]], np.int32)
            single, alone = translator.decoder.decoder_step(
                fed,
                mask[sentence : sentence + 1],
                [c[sentence : sentence + 1] for c in cross],
                alone,
            )
        np.testing.assert_allclose(grouped[row], single[0], atol=1e-5)
        np.testing.assert_allclose(caches[0][row], alone[0][0], atol=1e-5)
    with pytest.raises(ValueError, match="not a multiple of the 2 sentences"):
        translator.decoder.decoder_step(
            np.ones((5, 1), np.int32), mask, cross, translator.decoder.empty_self_caches(5)
        )


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
        ops = op_types(quantized.graph)
        assert ops & {"MatMulInteger", "DynamicQuantizeLinear"}, name
        # The embedding table too is int8 (one scale per row), in every graph.
        vocabulary = manifest["config"]["vocabulary_size"]
        tables = [
            t.data_type
            for g in subgraphs(quantized.graph)
            for t in g.initializer
            if len(t.dims) == 2 and t.dims[0] == vocabulary and t.dims[1] > 1  # not the scales
        ]
        assert onnx.TensorProto.INT8 in tables and onnx.TensorProto.FLOAT not in tables, name

    def products(name):
        graph = onnx.load(os.path.join(out, manifest["graphs"][name]["int8"])).graph
        kinds = ("MatMulInteger", "DynamicQuantizeMatMul")
        return sum(n.op_type in kinds for g in subgraphs(graph) for n in g.node)

    # The int8 greedy batch graph makes its decoder steps two per loop iteration.
    assert BATCH_STEPS_PER_ITERATION["int8"] == 2
    assert products("greedy_batch_search") == 2 * products("decoder_step") > 0
    assert products("greedy_search") == products("decoder_step")
    full_size = os.path.getsize(os.path.join(out, "weights.bin"))
    assert os.path.getsize(os.path.join(out, "weights_int8.bin")) < 0.6 * full_size
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
    assert OnnxTranslator(out, cpu, num_threads=2, precision="int8").decoder.split_parts(64, 4) == 1
    told = OnnxTranslator(out, cpu, num_threads=2, precision="int8", split_batches=True)
    assert told.decoder.split_parts(64, 4) == 2
    assert OnnxTranslator(out, cpu, num_threads=2).decoder.split_parts(64, 4) == 2
    with pytest.raises(ValueError, match="no 'float16' graphs"):
        OnnxTranslator(out, precision="float16")
