"""The exported search graphs (greedy_search, greedy_batch_search, beam_search,
beam_batch_search) and the decoder step's token selection: checked against the
search specification (`keras_transformer_runtime.spec`), against each other and
against Keras."""

import os
from unittest.mock import ANY

import keras
import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the ONNX tests run once, in the TensorFlow tier (the export itself takes either backend: tests/test_model.py)",
)

from keras_transformer_runtime import OnnxTranslator, spec  # noqa: E402
from keras_transformer_runtime.export_format import ALIGNMENT_INPUT  # noqa: E402
from keras_transformer_runtime.onnx_decoder import OnnxDecoder  # noqa: E402
from keras_transformer_runtime.options import NO_MASKS  # noqa: E402
from keras_transformer_runtime.specials import BOS_ID, PAD_ID  # noqa: E402

from keras_transformer.decoding import beam_search, greedy_search  # noqa: E402
from keras_transformer.model import transformer_parts  # noqa: E402
from tests.onnx_helpers import (  # noqa: E402
    SPEC_SCORE_TOLERANCE,
    held_out_lines,
    op_types,
    source_ids,
    spec_view,
    subgraphs,
)


def _graph_calls(translator, method, monkeypatch):
    """Records the search graph each call of the decoder's `method` (`run_greedy_graph`
    or `run_beam_graph`) runs."""
    calls = []
    decoder = translator.decoder
    original = getattr(OnnxDecoder, method).__get__(decoder)
    default = {"run_greedy_graph": "greedy_search", "run_beam_graph": "beam_search"}[method]
    position = {"run_greedy_graph": 2, "run_beam_graph": 4}[method]

    def record(*args):
        calls.append(args[position] if len(args) > position else default)
        return original(*args)

    monkeypatch.setattr(decoder, method, record)
    return calls


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_the_greedy_graphs_follow_the_search_specification(precision, exported, monkeypatch):
    """greedy_search.onnx and greedy_batch_search.onnx (the loop inside ONNX
    Runtime; the batch graph drops each sentence when it ends) give the same
    tokens and scores as each other; in float32, the search specification's
    over the export's whole model and Keras' tokens. `greedy_search` runs the
    first up to `GRAPH_LOOP_MAX_SENTENCES` sentences, the batch graph above."""
    from keras_transformer_runtime.onnx_decoder import GRAPH_LOOP_MAX_SENTENCES

    model, tokenizer, reference, out = exported("float32")
    # Whole batches: the test follows which graph searches (no split, `split_parts`).
    translator = OnnxTranslator(out, precision=precision, split_batches=False)
    sources = source_ids(tokenizer, held_out_lines(40, seed=71))
    keras_tokens, _ = greedy_search(model, sources)
    calls = _graph_calls(translator, "run_greedy_graph", monkeypatch)

    def in_graph(batch, graph, max_length=None):
        source, limits = translator._prepare(batch, max_length)
        tokens, steps = translator.decoder.run_greedy_graph(source, limits, graph)
        return tokens, [sum(s) for s in steps]

    for start, size in ((0, 1), (1, 1), (2, 2), (4, 5), (9, 31)):
        batch = sources[start : start + size]
        for max_length in (None, 3):  # 3: most sentences stop at their limit, not at EOS
            calls.clear()
            tokens, scores = translator.greedy_search(batch, max_length=max_length)
            chosen = "greedy_search" if size <= GRAPH_LOOP_MAX_SENTENCES else "greedy_batch_search"
            assert calls == [chosen]
            for graph in ("greedy_search", "greedy_batch_search"):
                graph_tokens, graph_scores = in_graph(batch, graph, max_length)
                assert graph_tokens == tokens, graph
                np.testing.assert_allclose(graph_scores, scores, rtol=0, atol=1e-5)
            assert all(len(t) <= (max_length or 99) for t in tokens)
            if precision == "float32":
                if max_length is None:
                    assert tokens == keras_tokens[start : start + size]
                limits = translator._prepare(batch, max_length)[1]
                expected = [
                    spec.greedy(spec_view(reference, s), limit)
                    for s, limit in zip(batch, limits, strict=True)
                ]
                assert tokens == [e[0] for e in expected]
                np.testing.assert_allclose(
                    scores, [e[1] for e in expected], rtol=0, atol=SPEC_SCORE_TOLERANCE
                )
    # An empty source in the batch: an empty output and score 0.
    for graph in ("greedy_search", "greedy_batch_search"):
        tokens, scores = in_graph([sources[0], [], sources[1]], graph)
        assert tokens[1] == [] and scores[1] == 0 and tokens[0] == keras_tokens[0]
        assert tokens[2] == keras_tokens[1]


def test_the_greedy_batch_graph_finds_the_same_at_any_steps_per_iteration(exported, tmp_path):
    """The float32 greedy_batch_search makes one decoder step per loop
    iteration (int8's make two, `BATCH_STEPS_PER_ITERATION`); built with 2 or 3
    steps and one compaction after them it gives the same tokens and scores,
    a batch's steps after its last sentence ended dropped; so do those graphs
    with the step's sinusoids read off a table made before the loop
    (`loop_step.search_graph`, as the export builds them), whose steps past
    the largest limit still find their rows."""
    import shutil

    import onnxruntime as ort

    from keras_transformer.export.greedy_graph import build_greedy_batch_search
    from keras_transformer.export.loop_step import search_graph

    _, tokenizer, _, out = exported("float32")
    translator = OnnxTranslator(out)
    sources = source_ids(tokenizer, held_out_lines(24, seed=73))
    step = onnx.load(os.path.join(out, "decoder_step.onnx"), load_external_data=False)
    shutil.copyfile(os.path.join(out, "weights.bin"), tmp_path / "weights.bin")
    sessions = {"exported": translator.decoder.session("greedy_batch_search")}
    for k in (2, 3):
        path = str(tmp_path / f"greedy_batch_k{k}.onnx")  # beside its weights
        onnx.save(build_greedy_batch_search(step, k), path)
        sessions[k] = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        hoisted = search_graph(build_greedy_batch_search, step, k)
        (loop,) = [node for node in hoisted.graph.node if node.op_type == "Loop"]
        outer_ops = {node.op_type for node in hoisted.graph.node}
        assert "Sin" not in op_types(loop.attribute[0].g) and "Sin" in outer_ops
        path = str(tmp_path / f"greedy_batch_k{k}_hoisted.onnx")
        onnx.save(hoisted, path)
        sessions[f"{k} hoisted"] = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    batches = [
        (sources, None),
        (sources, 3),
        (sources[:5], 4),
        ([sources[0], [], sources[1]], None),
    ]
    for rows, max_length in batches:
        source, limits = translator._prepare(rows, max_length)
        _, mask, cross = translator.decoder.encode(source)
        feeds = translator.decoder.search_feeds(mask, cross)
        feeds["limits"] = np.asarray(limits, np.int64)
        feeds.update(OnnxDecoder.mask_feeds(NO_MASKS))
        feeds[ALIGNMENT_INPUT] = np.array(True)
        tokens, scores, aligns = sessions["exported"].run(None, feeds)
        # As many steps as the longest output, EOS included.
        assert len(tokens) == max(int((column >= 0).sum()) for column in tokens.T)
        assert aligns.shape == (*tokens.shape, source.shape[1])
        made = tokens >= 0
        for k in (2, 3, "2 hoisted", "3 hoisted"):
            k_tokens, k_scores, k_aligns = sessions[k].run(None, feeds)
            np.testing.assert_array_equal(k_tokens, tokens)
            np.testing.assert_allclose(k_scores, scores, rtol=0, atol=1e-6)
            np.testing.assert_allclose(k_aligns[made], aligns[made], rtol=0, atol=1e-6)
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


def test_the_graphs_that_keep_their_sentences_read_the_mask_bias_from_before_the_loop(exported):
    """In greedy_search and beam_search (every sentence stays to the end) no loop
    node reads only the sentences' inputs and weights: the mask's bias and the
    shapes read off the source are made once, before the loop (the batch graphs
    carry the mask of the sentences left, which shrinks). The search
    specification tests hold the graphs to the same tokens."""
    _, _, _, out = exported("float32")
    for name in ("greedy_search", "beam_search"):
        graph = onnx.load(os.path.join(out, f"{name}.onnx"), load_external_data=False).graph
        (loop,) = [node for node in graph.node if node.op_type == "Loop"]
        body = loop.attribute[0].g
        weights = {t.name for t in graph.initializer} | {t.name for t in body.initializer}
        sentence_values = {"source_mask"} | {v.name for v in graph.input if "cross_" in v.name}
        of_sentences = [
            node.op_type
            for node in body.node
            if any(i in sentence_values for i in node.input)
            and all(i in sentence_values or i in weights for i in node.input if i)
        ]
        assert of_sentences == [], name
        assert any(n.op_type == "Where" for n in body.node)  # the rules' own
        outer_mask_readers = [n.op_type for n in graph.node if "source_mask" in n.input]
        assert "Unsqueeze" in outer_mask_readers, name  # the mask's bias, once


def test_the_batch_beam_graph_copies_each_cache_once_a_step(exported):
    """beam_batch_search takes each self-attention cache to the new beams and
    drops the done sentences' rows in one `Gather`, by the kept rows' origins,
    not a `Gather` then a `Compress`. The search specification tests hold the
    graph to the same tokens."""
    _, _, _, out = exported("float32")
    graph = onnx.load(os.path.join(out, "beam_batch_search.onnx"), load_external_data=False).graph
    (loop,) = [node for node in graph.node if node.op_type == "Loop"]
    body = loop.attribute[0].g
    made = {name: node for node in body.node for name in node.output}
    caches = [value.name for value in body.output if "_self_" in value.name]
    assert caches and len(caches) % 2 == 0  # each layer's keys and values
    for name in caches:
        node = made[name]
        step_output = "new_" + name.split("kept_next_")[1]  # the step's grown cache
        assert (node.op_type, node.input[0]) == ("Gather", step_output)
        assert made[node.input[1]].op_type == "Compress"  # the kept rows' origins


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
        return any(n.output[0] == "best.blocks" for g in subgraphs(proto.graph) for n in g.node)

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
    feeds.update(OnnxDecoder.mask_feeds(NO_MASKS))
    feeds[ALIGNMENT_INPUT] = np.array(True)
    tokens, scores, aligns = session(build_greedy_search(step)).run(None, feeds)
    made = tokens >= 0
    for k in (1, 2):
        graph = build_greedy_batch_search(step, k)
        assert selects_by_blocks(graph)
        k_tokens, k_scores, k_aligns = session(graph).run(None, feeds)
        np.testing.assert_array_equal(k_tokens, tokens)
        np.testing.assert_allclose(k_scores, scores, rtol=0, atol=1e-6)
        np.testing.assert_allclose(k_aligns[made], aligns[made], rtol=0, atol=1e-6)

    for build in (build_beam_search, build_beam_batch_search):
        blocked, full = build(step), build(step, blocked=False)
        assert selects_by_blocks(blocked) and not selects_by_blocks(full)
        blocked, full = session(blocked), session(full)
        for beam in (1, 4, 20):
            beam_feeds = dict(feeds, beam_size=np.array(beam, np.int64))
            beam_feeds["length_penalty"] = np.array(0.6, np.float64)
            beam_feeds["n_best"] = np.array(min(beam, 2), np.int64)
            beam_feeds["length_penalty_form"] = np.array(beam % 2, np.int64)  # both forms
            expected, found = full.run(None, beam_feeds), blocked.run(None, beam_feeds)
            np.testing.assert_array_equal(found[0], expected[0])
            np.testing.assert_array_equal(found[1], expected[1])
            np.testing.assert_allclose(found[2], expected[2], rtol=0, atol=1e-9)
            np.testing.assert_allclose(found[4], expected[4], rtol=0, atol=1e-6)
            assert found[4].shape[-1] == source.shape[1]  # alignments asked for


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_the_beam_graphs_follow_the_search_specification(precision, exported, monkeypatch):
    """beam_search.onnx and beam_batch_search.onnx (the loop inside ONNX Runtime;
    the batch graph drops each sentence when it is done) and the runtime's
    Python loop over decoder_step.onnx (for beams too wide for the graphs) give
    the same tokens and scores, for several beam sizes, length penalties and
    length limits; in float32, those of the search specification over the
    export's whole model, and of Keras. `beam_search` runs the first up to
    `BEAM_GRAPH_MAX_SENTENCES` sentences, the batch graph above."""
    from keras_transformer_runtime.onnx_decoder import BEAM_GRAPH_MAX_SENTENCES

    model, tokenizer, reference, out = exported("float32")
    # Whole batches: the test follows which graph searches (no split, `split_parts`).
    translator = OnnxTranslator(out, precision=precision, split_batches=False)
    # The same export with graphs that take no beam: every beam searches in Python.
    python = OnnxTranslator(out, precision=precision, split_batches=False)
    for graph in ("beam_search", "beam_batch_search"):
        python.manifest["graphs"][graph]["max_top_k"] = 0
    monkeypatch.setattr(python.decoder, "run_beam_graph", lambda *a: pytest.fail("graph used"))
    sources = source_ids(tokenizer, held_out_lines(40, seed=73))
    graphs = ("beam_search", "beam_batch_search")
    calls = _graph_calls(translator, "run_beam_graph", monkeypatch)
    # float16 log-probabilities may round one unit apart between the graph's
    # and the step's kernels (2**-11 near 0.5-1 on an AVX2 CPU); the tokens
    # must still be the same.
    tolerance = dict(rtol=0, atol=1e-5) if precision == "float32" else dict(rtol=1e-3, atol=1e-3)

    def in_graph(batch, graph, beam_size, length_penalty=0.6, max_length=None):
        source, limits = translator._prepare(batch, max_length)
        found = translator.decoder.run_beam_graph(source, limits, beam_size, length_penalty, graph)
        assert all(len(rows) == 1 for part in found for rows in part)  # n_best 1
        tokens, scores, steps = ([rows[0] for rows in part] for part in found)
        # The step scores are the best hypothesis's: its score is their sum, penalized.
        for row, score, step, limit in zip(tokens, scores, steps, limits, strict=True):
            assert len(step) == (len(row) + (len(row) < limit) if limit else 0)
            length = len(step)
            assert (
                sum(step) / ((5 + length) / 6) ** length_penalty == pytest.approx(score, abs=1e-6)
                or not limit
            )
        return tokens, scores

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
            calls.clear()
            tokens, scores = translator.beam_search(batch, **kwargs)
            chosen = "beam_search" if size <= BEAM_GRAPH_MAX_SENTENCES else "beam_batch_search"
            assert calls == [chosen]
            step_tokens, step_scores = python.beam_search(batch, **kwargs)
            assert step_tokens == tokens, kwargs
            np.testing.assert_allclose(step_scores, scores, **tolerance)
            for graph in graphs:
                graph_tokens, graph_scores = in_graph(batch, graph, **kwargs)
                assert graph_tokens == tokens, (graph, kwargs)
                np.testing.assert_allclose(graph_scores, scores, **tolerance)
            assert all(len(t) <= kwargs.get("max_length", 99) for t in tokens)
            if precision == "float32" and kwargs in (settings[0], settings[3]) and size < 31:
                limits = translator._prepare(batch, kwargs.get("max_length"))[1]
                alpha = kwargs.get("length_penalty", 0.6)
                expected = [
                    spec.beam(spec_view(reference, s), limit, kwargs["beam_size"], alpha)
                    for s, limit in zip(batch, limits, strict=True)
                ]
                assert tokens == [e[0] for e in expected], kwargs
                np.testing.assert_allclose(
                    scores, [e[1] for e in expected], rtol=0, atol=SPEC_SCORE_TOLERANCE
                )
            if precision == "float32" and kwargs == settings[0]:
                keras_tokens, keras_scores = beam_search(model, batch, beam_size=4)
                assert tokens == keras_tokens
                np.testing.assert_allclose(scores, keras_scores, atol=1e-3)
    # More beams than the graphs' ranking takes (2 * beam > vocabulary): the Python loop.
    wide = translator.vocabulary_size // 2 + 1
    for batch in (sources[:1], sources[:6]):
        calls.clear()
        tokens = translator.beam_search(batch, beam_size=wide)[0]
        assert calls == []
        assert tokens == (
            beam_search(model, batch, beam_size=wide)[0] if precision == "float32" else ANY
        )
    # An empty source in the batch: an empty output and score 0, as step by step.
    step_tokens, step_scores = python.beam_search([sources[0], [], sources[1]], beam_size=4)
    for graph in graphs:
        tokens, scores = in_graph([sources[0], [], sources[1]], graph, beam_size=4)
        assert tokens == step_tokens
        np.testing.assert_allclose(scores, step_scores, **tolerance)
        assert tokens[1] == [] and scores[1] == 0


def test_the_beam_graphs_give_the_n_best_lists_of_the_one_loop(exported, monkeypatch):
    """With `n_best`, beam_search.onnx and beam_batch_search.onnx keep each
    sentence's n best finished hypotheses and stop when no live beam can beat
    the n-th: the same lists (tokens, scores, step scores, best first) as the
    one Python loop (`search.search_loop`), and as the search specification
    (`spec.SentenceSearch`) over the export's teacher-forced pass."""
    from keras_transformer_runtime.options import SearchOptions
    from keras_transformer_runtime.spec import SentenceSearch

    _, tokenizer, reference, out = exported("float32")
    translator = OnnxTranslator(out, split_batches=False)
    calls = _graph_calls(translator, "run_beam_graph", monkeypatch)
    sources = source_ids(tokenizer, held_out_lines(12, seed=83))
    settings = [
        SearchOptions(beam_size=4, n_best=4, token_scores=True),
        SearchOptions(beam_size=3, n_best=2, length_penalty=1.5, max_length=4, token_scores=True),
        SearchOptions(beam_size=2, n_best=2, length_penalty=0.0, token_scores=True),
    ]
    for batch, graph in ((sources[:1], "beam_search"), (sources + [[]], "beam_batch_search")):
        for options in settings:
            calls.clear()
            found = translator.search(batch, options)
            assert calls == [graph]
            source, limits = translator._prepare(batch, options.max_length)
            loop = translator._loop(source, limits, options)
            assert [[h.tokens for h in row] for row in found] == [
                [h.tokens for h in row] for row in loop
            ], (graph, options)
            assert any(len(row) > 1 for row in found)
            for row, loop_row in zip(found, loop, strict=True):
                for h, expected in zip(row, loop_row, strict=True):
                    assert h.score == pytest.approx(expected.score, abs=1e-5)
                    assert h.log_prob == pytest.approx(expected.log_prob, abs=1e-5)
                    np.testing.assert_allclose(h.token_scores, expected.token_scores, atol=1e-5)
            for s, limit, row in list(zip(batch, limits, found, strict=True))[:3]:
                expected = SentenceSearch(limit, options).run(spec_view(reference, s))
                assert [h.tokens for h in row] == [h.tokens for h in expected], options
                np.testing.assert_allclose(
                    [h.score for h in row],
                    [h.score for h in expected],
                    rtol=0,
                    atol=SPEC_SCORE_TOLERANCE,
                )
    assert [h.tokens for h in found[-1]] == [[]]  # the empty source: one empty output


def test_the_search_graphs_take_the_stateless_masks(exported, monkeypatch):
    """`disable_unk`, `min_length` and one-token `suppress_sequences` are inputs of
    the four search graphs (`suppressed`, `min_length`): each step selects one
    more token per id they may drop, then the best allowed ones. The results are
    the one Python loop's (`search.search_loop`), with the masks applied as
    `spec.step_scores` applies them, and the specification's; a search needing
    more than the blocked selection takes runs the loop."""
    from keras_transformer_runtime.options import SearchOptions
    from keras_transformer_runtime.spec import SentenceSearch
    from keras_transformer_runtime.specials import EOS_ID, UNK_ID

    _, tokenizer, reference, out = exported("float32")
    translator = OnnxTranslator(out, split_batches=False)
    greedy_calls = _graph_calls(translator, "run_greedy_graph", monkeypatch)
    beam_calls = _graph_calls(translator, "run_beam_graph", monkeypatch)
    sources = source_ids(tokenizer, held_out_lines(12, seed=89))
    plain = translator.search(sources, SearchOptions(beam_size=1))
    # The tokens the plain outputs use most: suppressing them changes the outputs.
    counts = np.bincount([t for hs in plain for t in hs[0].tokens], minlength=4)
    common = tuple(int(i) for i in np.argsort(-counts)[:2])
    settings = [
        SearchOptions(beam_size=1, min_length=9, token_scores=True),
        SearchOptions(beam_size=1, suppress_sequences=tuple((i,) for i in common)),
        SearchOptions(beam_size=4, n_best=2, disable_unk=True, min_length=6, token_scores=True),
        SearchOptions(beam_size=3, suppress_sequences=((common[0],), (EOS_ID,)), max_length=7),
    ]
    for batch in (sources[:2], sources):
        for options in settings:
            greedy_calls.clear()
            beam_calls.clear()
            found = translator.search(batch, options)
            assert len(greedy_calls if options.beam_size == 1 else beam_calls) == 1, options
            source, limits = translator._prepare(batch, options.max_length)
            loop = translator._loop(source, limits, options)
            assert [[h.tokens for h in row] for row in found] == [
                [h.tokens for h in row] for row in loop
            ], options
            for row, loop_row in zip(found, loop, strict=True):
                for h, expected in zip(row, loop_row, strict=True):
                    assert h.score == pytest.approx(expected.score, abs=1e-5)
            for tokens in (h.tokens for row in found for h in row):
                assert len(tokens) >= min(options.min_length, options.max_length or 99)
                assert UNK_ID not in tokens or not options.disable_unk
                assert not {s[0] for s in options.suppress_sequences} & set(tokens)
            for s, limit, row in list(zip(batch, limits, found, strict=True))[:2]:
                expected = SentenceSearch(limit, options).run(spec_view(reference, s))
                assert [h.tokens for h in row] == [h.tokens for h in expected], options
    assert [hs[0].tokens for hs in found] != [hs[0].tokens for hs in plain]
    # More tokens a step than a blocked selection takes (here 5): the Python loop.
    for graph in ("beam_search", "beam_batch_search"):
        translator.manifest["graphs"][graph]["max_top_k"] = 5
    for suppressed, graph_calls in (((4,), 1), ((4, 5), 0)):  # 2 x 2 + 1 = 5; 2 x 2 + 2 = 6
        beam_calls.clear()
        options = SearchOptions(beam_size=2, suppress_sequences=tuple((i,) for i in suppressed))
        found = translator.search(sources, options)
        assert len(beam_calls) == graph_calls
        source, limits = translator._prepare(sources, None)
        loop = translator._loop(source, limits, options)
        assert [hs[0].tokens for hs in found] == [hs[0].tokens for hs in loop]


def test_a_beam_too_wide_for_the_blocked_graphs_searches_in_python(exported, monkeypatch):
    """Beam graphs that select block by block take `2 * beam_size` up to their
    manifest's `max_top_k`; a wider beam runs the Python loop over the decoder
    step (its full `TopK`), with the same results."""
    _, tokenizer, _, out = exported("float32")
    translator = OnnxTranslator(out, providers=["CPUExecutionProvider"], split_batches=False)
    sources = source_ids(tokenizer, held_out_lines(6, seed=11))
    expected = {beam: translator.beam_search(sources, beam_size=beam) for beam in (2, 3)}
    for graph in ("beam_search", "beam_batch_search"):
        translator.manifest["graphs"][graph]["max_top_k"] = 4
    calls = []
    in_graph = translator.decoder.run_beam_graph
    monkeypatch.setattr(
        translator.decoder, "run_beam_graph", lambda *a, **k: calls.append(a) or in_graph(*a, **k)
    )
    for beam, graph_calls in ((3, 0), (2, 1)):  # 2 x 3 > 4: Python; 2 x 2 = 4: the graph
        tokens, scores = translator.beam_search(sources, beam_size=beam)
        assert len(calls) == graph_calls
        assert tokens == expected[beam][0]
        np.testing.assert_allclose(scores, expected[beam][1], rtol=0, atol=1e-5)
