"""`GraphBuilder`, the one way the export writes ONNX graphs node by node.

The graphs built with it (encoder, decoder step, searches) are checked
against Keras and the search specification in tests/export/test_graphs.py
and tests/export/test_onnx.py; these
tests hold the builder's own rules: names, shared constants, loop bodies
and the helpers' results in ONNX Runtime.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from keras_transformer.export.graph_builder import GraphBuilder, copied_nodes

ort = pytest.importorskip("onnxruntime")


def _run(model, feeds):
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_names_are_prefixed_made_by_op_or_kept_exact():
    g = GraphBuilder("search.")
    auto = g.node("Relu", ["x"])
    named = g.node("Relu", [auto], "y")
    first, second = g.node("TopK", [named, "k"], ["values", "indices"], axis=0)
    exact = g.output("Identity", [first], "top_k")
    assert auto.startswith("search.relu_")
    assert (named, first, second, exact) == ("search.y", "search.values", "search.indices", "top_k")
    assert g.name("y") == named
    assert list(g.nodes[0].input) == ["x"]  # inputs are read as given
    assert len({node.name for node in g.nodes}) == len(g.nodes)


def test_a_constant_is_made_once_and_a_name_holds_one_value():
    g = GraphBuilder("p.")
    assert g.int64s([1]) == g.int64s([1]) == "p.ints_1"
    assert g.int64s(1) == "p.int_1"  # a scalar is not the (1,) tensor
    assert g.int64s([-1, 2]) == "p.ints_m1_2"
    assert g.const("half", 0.5, np.float32) == g.const("half", 0.5, np.float32)
    assert [t.name for t in g.initializers] == ["p.ints_1", "p.int_1", "p.ints_m1_2", "p.half"]
    with pytest.raises(ValueError, match="'p.half' is already made with another value"):
        g.const("half", 0.25, np.float32)
    with pytest.raises(ValueError, match="already made"):
        g.const("half", 0.5, np.float64)


def test_helpers_compute_what_their_names_say():
    """reshape, (un)squeeze, dimension, filled, cast, keep_rows and any_true in ONNX Runtime."""
    g = GraphBuilder()
    rows = g.dimension("x", 0)  # (1,)
    g.output("Identity", [g.filled(rows, -1, np.int64)], "filled")
    flat = g.reshape("x", [-1])
    g.output("Identity", [g.squeeze(g.unsqueeze(flat, [0, 2]), [2])], "squeezed")
    positive = g.node(
        "Greater",
        [g.node("ReduceSum", ["x", g.int64s([1])], keepdims=0), g.const("zero", 0.0, np.float32)],
    )
    g.keep_rows(positive, ["x"], ["kept"])
    g.output("Identity", [g.any_true(positive)], "any_positive")
    g.output("Identity", [g.cast(positive, TensorProto.INT64)], "as_int")
    value = g.value_info
    model = g.model(
        "helpers",
        [value("x", TensorProto.FLOAT, ["rows", 2])],
        [
            value("filled", TensorProto.INT64, ["rows"]),
            value("squeezed", TensorProto.FLOAT, [1, None]),
            value("kept", TensorProto.FLOAT, [None, 2]),
            value("any_positive", TensorProto.BOOL, []),
            value("as_int", TensorProto.INT64, ["rows"]),
        ],
        opset=17,
    )
    assert model.ir_version <= 9
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    x = np.array([[1, 2], [-3, -4], [0.5, 0]], np.float32)
    filled, squeezed, kept, any_positive, as_int = _run(model, {"x": x})
    np.testing.assert_array_equal(filled, [-1, -1, -1])
    np.testing.assert_array_equal(squeezed, x.reshape(1, -1))
    np.testing.assert_array_equal(kept, x[[0, 2]])
    assert any_positive
    np.testing.assert_array_equal(as_int, [1, 0, 1])
    (_, _, _, none_positive, _) = _run(model, {"x": -np.abs(x) - 1})
    assert not none_positive


def test_a_loop_body_reads_its_constants_from_the_outer_graph():
    """The body's constants live in the outer graph (made once for both); a
    Loop that doubles a value until it passes a limit runs in ONNX Runtime."""
    g = GraphBuilder("loop.")
    b = g.body()
    two = b.const("two", 2.0, np.float32)
    doubled = b.node("Mul", [b.name("value"), two], "value_next")
    b.node("Less", [doubled, "limit"], "keep_going")
    b.output("Identity", [doubled], "loop.trace")
    assert b.int64s([1]) == g.int64s([1])  # one constant for both graphs
    assert not b.initializers and "loop.two" in {t.name for t in g.initializers}
    value = g.value_info
    body = b.graph(
        "double",
        [
            value(b.name("iteration"), TensorProto.INT64, []),
            value(b.name("condition"), TensorProto.BOOL, []),
            value(b.name("value"), TensorProto.FLOAT, []),
        ],
        [
            value(b.name("keep_going"), TensorProto.BOOL, []),
            value(b.name("value_next"), TensorProto.FLOAT, []),
            value("loop.trace", TensorProto.FLOAT, []),
        ],
    )
    g.output(
        "Loop",
        [g.int64s(100), g.const("true", True, np.bool_), g.const("one", 1.0, np.float32)],
        ["last", "trace"],
        body=body,
    )
    model = g.model(
        "doubling",
        [value("limit", TensorProto.FLOAT, [])],
        [value("last", TensorProto.FLOAT, []), value("trace", TensorProto.FLOAT, [None])],
        opset=17,
    )
    last, trace = _run(model, {"limit": np.array(20.0, np.float32)})
    assert last == 32.0
    np.testing.assert_array_equal(trace, [2, 4, 8, 16, 32])


def test_copied_nodes_rename_what_they_make_and_keep_what_they_share():
    g = GraphBuilder()
    hidden = g.node("Add", ["x", g.const("bias", 1.0, np.float32)], "hidden")
    g.output("Mul", [hidden, "scale"], "y")
    again = copied_nodes(g.nodes, "step1/", {"x": "y"}, keep={"bias"})
    assert [list(n.input) for n in again] == [["y", "bias"], ["step1/hidden", "step1/scale"]]
    assert [list(n.output) for n in again] == [["step1/hidden"], ["step1/y"]]
    assert all(n.name.startswith("step1/") for n in again)
    renamed = copied_nodes(g.nodes, names={"scale": "live_scale"})
    assert [list(n.input) for n in renamed] == [["x", "bias"], ["hidden", "live_scale"]]
    assert [list(n.output) for n in renamed] == [["hidden"], ["y"]]
    assert [list(n.input) for n in g.nodes][1] == ["hidden", "scale"]  # the originals untouched


def test_when_runs_its_branch_only_where_the_condition_holds():
    """`when`: an If whose branch gives each change's value where the condition
    holds, and a copy of the unchanged value where not; the branch reads the
    outer graph's values and constants. `copied_nodes` renames inside it too."""
    g = GraphBuilder("w.")
    f = g.body()
    scaled = f.node("Mul", ["x", f.const("three", 3.0, np.float32)], "scaled")
    counted = f.node("Add", ["count", f.int64s(1)], "counted")
    positive = g.node(
        "Greater", [g.node("ReduceSum", ["x"], keepdims=0), g.const("zero", 0.0, np.float32)]
    )
    changes = [
        ("x_next", scaled, "x", TensorProto.FLOAT),
        ("count_next", counted, "count", TensorProto.INT64),
    ]
    made = g.when(positive, f, changes)
    assert made == ["w.x_next", "w.count_next"]
    for name, out in zip(made, ("y", "n"), strict=True):
        g.output("Identity", [name], out)
    value = g.value_info
    model = g.model(
        "when",
        [value("x", TensorProto.FLOAT, [2]), value("count", TensorProto.INT64, [])],
        [value("y", TensorProto.FLOAT, [2]), value("n", TensorProto.INT64, [])],
        opset=17,
    )
    count = np.array(5, np.int64)
    y, n = _run(model, {"x": np.array([1, 2], np.float32), "count": count})
    np.testing.assert_array_equal(y, [3, 6])
    assert n == 6
    y, n = _run(model, {"x": np.array([-1, -2], np.float32), "count": count})
    np.testing.assert_array_equal(y, [-1, -2])
    assert n == 5
    # Renaming an input reaches the nodes inside the branches.
    (renamed,) = [
        n for n in copied_nodes(g.nodes, names={"count": "live_count"}) if n.op_type == "If"
    ]
    branch_inputs = {i for a in renamed.attribute for n in a.g.node for i in n.input}
    assert "live_count" in branch_inputs and "count" not in branch_inputs


def test_a_model_like_another_takes_its_opsets_and_ir_version():
    g = GraphBuilder()
    g.output("Identity", ["x"], "y")
    value = g.value_info
    io = [value("x", TensorProto.FLOAT, [2])], [value("y", TensorProto.FLOAT, [2])]
    first = g.model("first", *io, opset=18)
    first.ir_version = 8
    second = g.model("second", *io, like=first)
    assert second.ir_version == 8
    assert [(o.domain, o.version) for o in second.opset_import] == [("", 18)]
    np.testing.assert_array_equal(_run(second, {"x": np.ones(2, np.float32)})[0], [1, 1])


def test_the_search_graphs_are_built_by_the_builder_alone():
    """Every node of the search graphs (outer graph and loop body, the step's
    nodes aside) has a name from a GraphBuilder: no second style remains."""
    from keras_transformer.config import TransformerConfig
    from keras_transformer.export.beam_graph import build_beam_batch_search, build_beam_search
    from keras_transformer.export.greedy_graph import (
        build_greedy_batch_search,
        build_greedy_search,
    )
    from keras_transformer.export.step_graph import build_decoder_step
    from keras_transformer.model import build_transformer, transformer_parts

    model = build_transformer(TransformerConfig.from_preset("tiny", vocabulary_size=1200))
    step = build_decoder_step(transformer_parts(model))
    step_nodes = {node.name for node in step.graph.node}
    for build, prefix in [
        (build_greedy_search, "greedy."),
        (build_greedy_batch_search, "greedy."),
        (build_beam_search, "beam."),
        (build_beam_batch_search, "beam."),
    ]:
        search = build(step)
        (loop,) = [node for node in search.graph.node if node.op_type == "Loop"]
        body = loop.attribute[0].g
        outer = [n.name for n in search.graph.node]
        own = [n.name for n in body.node if n.name not in step_nodes]
        assert all(name.startswith(prefix) for name in outer)
        assert all(name.startswith((prefix, "best.", "greedy.step")) for name in own), build
