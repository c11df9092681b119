"""The whole greedy search as one ONNX graph: the decoder step inside an ONNX `Loop`.

A search that calls the decoder-step graph once per token pays, at every
step, for the Python loop, the feeds and the fetches around a graph that
itself takes a fraction of a millisecond at batch 1. Here the loop runs
inside ONNX Runtime: one call per batch of sentences, the self-attention
caches carried from one iteration to the next without leaving the runtime.

The loop body is the decoder-step graph of the same precision (float32,
float16 or int8: built from that graph's own proto), plus the rules of
`keras_transformer_runtime.search.greedy_loop`: each row takes the step's
best token other than padding and BOS; a row that produced EOS, or reached
its length limit, is done and is fed EOS from then on; the loop stops when
every row is done. Rows are independent, so a finished row changes nothing
in the others: the tokens and scores are those of the step-by-step search
(`tests/test_export.py` holds them equal).

Two graphs: `greedy_search` keeps every row to the end, finished ones fed
EOS, which suits one sentence; `greedy_batch_search` drops a sentence from
its state once it ends, as the Python loop does, so that a batch's later
steps compute only its unfinished sentences (it may make several steps per
loop iteration and drop the sentences that ended after them, and it finds
each row's best token block by block: `blocked_selection`).

Inputs: `source_mask (sentences, source_len) bool` and the cross keys and
values from encoder.onnx (one row per sentence), and `limits (sentences,)
int64`, each sentence's maximum output length (EOS included; at least 1).
Outputs: `tokens (steps, sentences) int64`, the token each row produced at
each step (EOS when it ended there, -1 once it was done), and `scores
(steps, sentences) float32`, that token's log-probability (0 once done); a
row's output is its tokens up to its first EOS or -1, and its score the sum
of its scores.
"""

from __future__ import annotations

import numpy as np
from keras_transformer_runtime.specials import BOS_ID, EOS_ID

from keras_transformer.export.step_graph import blocked_selection


def step_interface(step):
    """What a search graph built around the decoder-step graph `step` reads of it:
    `(inputs by name, self-attention cache names, cross-attention cache names,
    heads, head_dim, the caches' element type)`."""
    inputs = {value.name: value for value in step.graph.input}
    self_names = [name for name in inputs if name.startswith("self_")]
    cross_names = [name for name in inputs if name.startswith("cross_")]
    cache = inputs[self_names[0]].type.tensor_type
    heads, head_dim = (cache.shape.dim[i].dim_value for i in (1, 3))
    return inputs, self_names, cross_names, heads, head_dim, cache.elem_type


def build_greedy_search(step):
    """Returns the greedy-search `onnx.ModelProto` whose loop body is `step`,
    a decoder-step graph (`keras_transformer.export.step_graph.build_decoder_step`,
    or its float16 or int8 conversion)."""
    from onnx import TensorProto, helper, numpy_helper

    graph = step.graph
    inputs, self_names, cross_names, heads, head_dim, cache_type = step_interface(step)
    float_type = {v.name: v for v in graph.output}["top_log_probs"].type.tensor_type.elem_type

    def const(name, value, dtype=None):
        return numpy_helper.from_array(np.asarray(value, dtype), name)

    # ---- the loop body: the step, then greedy_loop's rules
    body_nodes = [
        helper.make_node("Constant", [], ["top_k"], value=const("greedy.k", [1], np.int64))
    ]
    body_nodes += list(graph.node)
    rules = [
        ("Squeeze", ["top_ids", "greedy.axes_1"], ["greedy.next_id"]),
        ("Squeeze", ["top_log_probs", "greedy.axes_1"], ["greedy.chosen"]),
        ("Not", ["greedy.done"], ["greedy.live"]),
        ("Where", ["greedy.live", "greedy.chosen", "greedy.zero_score"], ["greedy.step_score"]),
        ("Where", ["greedy.live", "greedy.next_id", "greedy.no_token"], ["greedy.step_token"]),
        ("Equal", ["greedy.next_id", "greedy.eos"], ["greedy.ended"]),
        ("Add", ["greedy.iteration", "greedy.one"], ["greedy.steps_made"]),
        ("GreaterOrEqual", ["greedy.steps_made", "limits"], ["greedy.at_limit"]),
        ("Or", ["greedy.done", "greedy.ended"], ["greedy.done_or_ended"]),
        ("Or", ["greedy.done_or_ended", "greedy.at_limit"], ["greedy.done_next"]),
        ("Where", ["greedy.done_next", "greedy.eos", "greedy.next_id"], ["greedy.fed_id"]),
        ("Cast", ["greedy.fed_id"], ["greedy.fed_id_int32"], {"to": TensorProto.INT32}),
        ("Unsqueeze", ["greedy.fed_id_int32", "greedy.axes_1"], ["greedy.token_ids_next"]),
        ("Not", ["greedy.done_next"], ["greedy.live_next"]),
        ("Cast", ["greedy.live_next"], ["greedy.live_next_int32"], {"to": TensorProto.INT32}),
        ("ReduceMax", ["greedy.live_next_int32"], ["greedy.any_live_int32"], {"keepdims": 0}),
        ("Cast", ["greedy.any_live_int32"], ["greedy.keep_going"], {"to": TensorProto.BOOL}),
    ]
    for op, node_inputs, node_outputs, *attributes in rules:
        body_nodes.append(
            helper.make_node(op, node_inputs, node_outputs, **(attributes[0] if attributes else {}))
        )
    body_constants = [
        const("greedy.axes_1", [1], np.int64),
        const("greedy.zero_score", 0.0, helper.tensor_dtype_to_np_dtype(float_type)),
        const("greedy.no_token", -1, np.int64),
        const("greedy.eos", EOS_ID, np.int64),
        const("greedy.one", 1, np.int64),
    ]

    def value(name, elem_type, shape=None):
        return helper.make_tensor_value_info(name, elem_type, shape)

    body_inputs = [
        value("greedy.iteration", TensorProto.INT64, []),
        value("greedy.condition", TensorProto.BOOL, []),
        value("token_ids", TensorProto.INT32, ["batch", 1]),
        value("greedy.done", TensorProto.BOOL, ["batch"]),
    ] + [value(name, cache_type, None) for name in self_names]
    body_outputs = [
        value("greedy.keep_going", TensorProto.BOOL, []),
        value("greedy.token_ids_next", TensorProto.INT32, ["batch", 1]),
        value("greedy.done_next", TensorProto.BOOL, ["batch"]),
    ] + [value(f"new_{name}", cache_type, None) for name in self_names]
    body_outputs += [
        value("greedy.step_token", TensorProto.INT64, ["batch"]),
        value("greedy.step_score", float_type, ["batch"]),
    ]
    body = helper.make_graph(
        body_nodes,
        "greedy_step",
        body_inputs,
        body_outputs,
        list(graph.initializer) + body_constants,
    )

    # ---- the outer graph: initial state, the loop, nothing else
    empty_cache_shape = [heads, 0, head_dim]
    outer = [
        helper.make_node("Shape", ["limits"], ["greedy.rows"]),
        helper.make_node(
            "Concat", ["greedy.rows", "greedy.one_column"], ["greedy.token_shape"], axis=0
        ),
        helper.make_node(
            "Expand", ["greedy.bos", "greedy.token_shape"], ["greedy.first_token_ids"]
        ),
        helper.make_node("Equal", ["limits", "greedy.zero_steps"], ["greedy.first_done"]),
        helper.make_node("ReduceMax", ["limits"], ["greedy.max_steps"], keepdims=0),
        helper.make_node(
            "Concat",
            ["greedy.rows", "greedy.empty_cache_dims"],
            ["greedy.empty_cache_shape"],
            axis=0,
        ),
        helper.make_node(
            "ConstantOfShape",
            ["greedy.empty_cache_shape"],
            ["greedy.empty_cache"],
            value=numpy_helper.from_array(
                np.zeros(1, helper.tensor_dtype_to_np_dtype(cache_type)), "greedy.zero_cache"
            ),
        ),
        helper.make_node(
            "Loop",
            ["greedy.max_steps", "greedy.true", "greedy.first_token_ids", "greedy.first_done"]
            + ["greedy.empty_cache"] * len(self_names),
            ["greedy.last_token_ids", "greedy.last_done"]
            + [f"greedy.last_{name}" for name in self_names]
            + ["tokens", "scores"],
            body=body,
        ),
    ]
    outer_constants = [
        const("greedy.one_column", [1], np.int64),
        const("greedy.bos", [[BOS_ID]], np.int32),
        const("greedy.zero_steps", 0, np.int64),
        const("greedy.empty_cache_dims", empty_cache_shape, np.int64),
        const("greedy.true", True, np.bool_),
    ]
    outer_inputs = [inputs["source_mask"]] + [inputs[name] for name in cross_names]
    outer_inputs.append(value("limits", TensorProto.INT64, ["sentences"]))
    outer_outputs = [
        value("tokens", TensorProto.INT64, ["steps", "sentences"]),
        value("scores", float_type, ["steps", "sentences"]),
    ]
    model = helper.make_model(
        helper.make_graph(outer, "greedy_search", outer_inputs, outer_outputs, outer_constants),
        producer_name="keras-transformer",
        opset_imports=list(step.opset_import),
    )
    model.ir_version = step.ir_version
    return model


def compaction(keep, states, outputs):
    """Nodes that keep the rows of `states` (axis 0) where `keep` ((rows,) bool)
    is True, writing `outputs`.

    They copy every state at every step, even when no row is dropped: an
    `If` that copies only then measured slower, since ONNX Runtime copies
    the values that pass through its branches as well.
    """
    from onnx import helper

    return [
        helper.make_node("Compress", [state, keep], [out], axis=0)
        for state, out in zip(states, outputs, strict=True)
    ]


def renamed_inputs(nodes, names):
    """Copies of `nodes` that read `names[x]` wherever they read a value `x` in `names`."""
    return _step_copy(nodes, "", names, ())


def _step_copy(nodes, prefix, names, keep):
    """Copies of the step graph's `nodes` for another step in the same loop body:
    a value named in `names` is read as `names[x]`; every other value the nodes
    make or read is renamed `prefix + x`, except those in `keep` (the step's
    weights and constants, shared by the copies)."""
    copies = []
    for node in nodes:
        copy = type(node)()
        copy.CopyFrom(node)
        for i, name in enumerate(copy.input):
            if name in names:
                copy.input[i] = names[name]
            elif name and name not in keep:
                copy.input[i] = prefix + name
        for i, name in enumerate(copy.output):
            copy.output[i] = prefix + name
        if copy.name:
            copy.name = prefix + copy.name
        copies.append(copy)
    return copies


def build_greedy_batch_search(step, steps_per_iteration=1, blocked=True):
    """Returns the greedy search for batches of several sentences, with the
    inputs and outputs of `build_greedy_search(step)` and the same results.

    Its loop carries only the sentences still being decoded: a sentence that
    ends (EOS or its length limit) leaves the state, with its source mask,
    cross keys and values and caches, as in the Python loop, so that later
    steps compute only the rows left. That costs a copy of the state
    (`compaction`), which a single sentence, the last row of its batch, never
    needs: `build_greedy_search` serves it. Each loop iteration makes
    `steps_per_iteration` decoder steps and then compacts once: a sentence
    that ends at an earlier step of an iteration is computed, and ignored,
    until the iteration's end. With `blocked` (the default), each step finds
    its best token block by block (`blocked_selection`).
    """
    from onnx import TensorProto, helper, numpy_helper

    if steps_per_iteration < 1:
        raise ValueError(f"steps_per_iteration must be at least 1, not {steps_per_iteration}")
    if blocked:
        step = blocked_selection(step) or step
    graph = step.graph
    inputs, self_names, cross_names, heads, head_dim, cache_type = step_interface(step)
    float_type = {v.name: v for v in graph.output}["top_log_probs"].type.tensor_type.elem_type
    INT64 = TensorProto.INT64
    # The body reads the live sentences' mask and cross caches from its state.
    sentence_inputs = ["source_mask", *cross_names]
    carried_name = {name: f"greedy.{name}" for name in sentence_inputs}
    shared = {init.name for init in graph.initializer} | {"top_k"}

    def const(name, value, dtype=None):
        return numpy_helper.from_array(np.asarray(value, dtype), name)

    # ---- the loop body: the steps, each followed by greedy_loop's rules,
    # then one compaction
    body_nodes = [
        helper.make_node("Constant", [], ["top_k"], value=const("greedy.k", [1], np.int64))
    ]

    def flush(rules):
        """Appends `rules`, (op, inputs, outputs[, attributes]) each, to the body."""
        for op, node_inputs, node_outputs, *attributes in rules:
            body_nodes.append(
                helper.make_node(
                    op, node_inputs, node_outputs, **(attributes[0] if attributes else {})
                )
            )
        rules.clear()

    rules = [("Mul", ["greedy.iteration", "greedy.steps_per_iteration"], ["greedy.steps_before"])]
    rules.append(("Gather", ["limits", "greedy.rows"], ["greedy.row_limits"], {"axis": 0}))
    flush(rules)
    last_made = {}
    for j in range(steps_per_iteration):
        x = f"greedy.{j}."  # this step's rule values
        if j == 0:
            body_nodes += renamed_inputs(graph.node, carried_name)
            made = {name: name for name in ["top_ids", "top_log_probs"]}
            made.update({f"new_{name}": f"new_{name}" for name in self_names})
        else:
            prefix = f"greedy.step{j}/"
            previous = f"greedy.{j - 1}."
            names = dict(carried_name, token_ids=previous + "fed_ids")
            names.update({name: last_made[f"new_{name}"] for name in self_names})
            body_nodes += _step_copy(graph.node, prefix, names, shared)
            made = {name: prefix + name for name in ["top_ids", "top_log_probs"]}
            made.update({f"new_{name}": prefix + f"new_{name}" for name in self_names})
        rules += [
            ("Squeeze", [made["top_ids"], "greedy.axes_1"], [x + "next_id"]),
            ("Squeeze", [made["top_log_probs"], "greedy.axes_1"], [x + "chosen"]),
            ("Equal", [x + "next_id", "greedy.eos"], [x + "ended"]),
            ("Add", ["greedy.steps_before", f"greedy.made_{j + 1}"], [x + "steps_made"]),
            ("GreaterOrEqual", [x + "steps_made", "greedy.row_limits"], [x + "at_limit"]),
            ("Or", [x + "ended", x + "at_limit"], [x + "finished"]),
            ("Not", [x + "finished"], [x + "not_finished"]),
        ]
        if j == 0:
            token, score, keep = x + "next_id", x + "chosen", x + "not_finished"
        else:
            # Rows that ended at an earlier step of this iteration are ignored.
            live = f"greedy.{j - 1}.keep"
            token, score, keep = x + "token_or_none", x + "score_or_zero", x + "live_on"
            rules += [
                ("Where", [live, x + "next_id", "greedy.no_token"], [token]),
                ("Where", [live, x + "chosen", "greedy.zero_score"], [score]),
                ("And", [live, x + "not_finished"], [keep]),
            ]
        rules += [
            ("Identity", [keep], [x + "keep"]),
            (
                "ScatterElements",
                ["greedy.no_tokens", "greedy.rows", token],
                [x + "step_token"],
                {"axis": 0},
            ),
            (
                "ScatterElements",
                ["greedy.zero_scores", "greedy.rows", score],
                [x + "step_score"],
                {"axis": 0},
            ),
            ("Cast", [x + "next_id"], [x + "next_id_int32"], {"to": TensorProto.INT32}),
            ("Unsqueeze", [x + "next_id_int32", "greedy.axes_1"], [x + "fed_ids"]),
        ]
        flush(rules)
        last_made = made
    last = f"greedy.{steps_per_iteration - 1}."
    rules += [
        ("Cast", [last + "keep"], ["greedy.keep_int32"], {"to": TensorProto.INT32}),
        ("ReduceMax", ["greedy.keep_int32"], ["greedy.any_live_int32"], {"keepdims": 0}),
        ("Cast", ["greedy.any_live_int32"], ["greedy.keep_going"], {"to": TensorProto.BOOL}),
    ]
    flush(rules)
    mask_type = inputs["source_mask"].type.tensor_type.elem_type
    states = [
        (last + "fed_ids", TensorProto.INT32, "greedy.token_ids_next"),
        ("greedy.rows", INT64, "greedy.rows_next"),
        (carried_name["source_mask"], mask_type, "greedy.source_mask_next"),
    ]
    states += [(carried_name[name], cache_type, f"greedy.{name}_next") for name in cross_names]
    states += [(last_made[f"new_{name}"], cache_type, f"greedy.{name}_next") for name in self_names]
    body_nodes += compaction(
        last + "keep", [name for name, *_ in states], [out for *_, out in states]
    )
    body_constants = [
        const("greedy.axes_1", [1], np.int64),
        const("greedy.eos", EOS_ID, np.int64),
        const("greedy.steps_per_iteration", steps_per_iteration, np.int64),
        const("greedy.no_token", -1, np.int64),
        const("greedy.zero_score", 0.0, helper.tensor_dtype_to_np_dtype(float_type)),
    ]
    body_constants += [
        const(f"greedy.made_{j + 1}", j + 1, np.int64) for j in range(steps_per_iteration)
    ]

    def value(name, elem_type, shape=None):
        return helper.make_tensor_value_info(name, elem_type, shape)

    body_inputs = [
        value("greedy.iteration", INT64, []),
        value("greedy.condition", TensorProto.BOOL, []),
        value("token_ids", TensorProto.INT32, ["rows", 1]),
        value("greedy.rows", INT64, ["rows"]),
        value(carried_name["source_mask"], mask_type, None),
    ]
    body_inputs += [value(carried_name[name], cache_type, None) for name in cross_names]
    body_inputs += [value(name, cache_type, None) for name in self_names]
    body_outputs = [value("greedy.keep_going", TensorProto.BOOL, [])]
    body_outputs += [value(out, t, None) for _, t, out in states]
    for j in range(steps_per_iteration):
        body_outputs += [
            value(f"greedy.{j}.step_token", INT64, ["sentences"]),
            value(f"greedy.{j}.step_score", float_type, ["sentences"]),
        ]
    body = helper.make_graph(
        body_nodes,
        "greedy_step",
        body_inputs,
        body_outputs,
        list(graph.initializer) + body_constants,
    )

    # ---- the outer graph: the sentences with room for a token, the loop
    outer_nodes = [
        ("Shape", ["limits"], ["greedy.sentences"]),
        ("Squeeze", ["greedy.sentences", "greedy.axis_0"], ["greedy.sentence_count"]),
        (
            "Range",
            ["greedy.zero", "greedy.sentence_count", "greedy.one_step"],
            ["greedy.sentence_index"],
        ),
        ("Greater", ["limits", "greedy.zero"], ["greedy.has_room"]),
        (
            "Compress",
            ["greedy.sentence_index", "greedy.has_room"],
            ["greedy.first_rows"],
            {"axis": 0},
        ),
        ("Shape", ["greedy.first_rows"], ["greedy.row_count"]),
        ("Concat", ["greedy.row_count", "greedy.one_column"], ["greedy.token_shape"], {"axis": 0}),
        ("Expand", ["greedy.bos", "greedy.token_shape"], ["greedy.first_token_ids"]),
        ("ReduceMax", ["limits"], ["greedy.max_steps"], {"keepdims": 0}),
        # Iterations: the most steps any sentence may take, rounded up.
        ("Add", ["greedy.max_steps", "greedy.round_up"], ["greedy.max_steps_up"]),
        ("Div", ["greedy.max_steps_up", "greedy.steps_per_iteration"], ["greedy.iterations"]),
        (
            "Concat",
            ["greedy.row_count", "greedy.empty_cache_dims"],
            ["greedy.empty_cache_shape"],
            {"axis": 0},
        ),
        (
            "ConstantOfShape",
            ["greedy.empty_cache_shape"],
            ["greedy.empty_cache"],
            {
                "value": const(
                    "greedy.zero_cache", np.zeros(1, helper.tensor_dtype_to_np_dtype(cache_type))
                )
            },
        ),
        (
            "ConstantOfShape",
            ["greedy.sentences"],
            ["greedy.no_tokens"],
            {"value": const("greedy.minus_one", [-1], np.int64)},
        ),
        (
            "ConstantOfShape",
            ["greedy.sentences"],
            ["greedy.zero_scores"],
            {
                "value": const(
                    "greedy.zero_score", np.zeros(1, helper.tensor_dtype_to_np_dtype(float_type))
                )
            },
        ),
    ]
    outer_nodes += [
        ("Gather", [name, "greedy.first_rows"], [f"greedy.first_{name}"], {"axis": 0})
        for name in sentence_inputs
    ]
    outer = [
        helper.make_node(op, node_inputs, node_outputs, **(attributes[0] if attributes else {}))
        for op, node_inputs, node_outputs, *attributes in outer_nodes
    ]
    outer.append(
        helper.make_node(
            "Loop",
            ["greedy.iterations", "greedy.true", "greedy.first_token_ids", "greedy.first_rows"]
            + [f"greedy.first_{name}" for name in sentence_inputs]
            + ["greedy.empty_cache"] * len(self_names),
            [f"greedy.last_{out}" for *_, out in states]
            + [
                f"greedy.{kind}_{j}"
                for j in range(steps_per_iteration)
                for kind in ("tokens", "scores")
            ],
            body=body,
        )
    )
    # (iterations, sentences) for each step of an iteration, interleaved into
    # (steps, sentences); the last iteration's later steps, made after every
    # sentence had ended, are dropped: no token there is >= 0.
    outer.append(
        helper.make_node(
            "Concat",
            ["greedy.minus_one_dim", "greedy.sentences"],
            ["greedy.steps_by_sentences"],
            axis=0,
        )
    )
    for kind in ("tokens", "scores"):
        parts = []
        for j in range(steps_per_iteration):
            outer.append(
                helper.make_node(
                    "Unsqueeze",
                    [f"greedy.{kind}_{j}", "greedy.one_column"],
                    [f"greedy.{kind}_{j}_column"],
                )
            )
            parts.append(f"greedy.{kind}_{j}_column")
        outer.append(helper.make_node("Concat", parts, [f"greedy.{kind}_by_iteration"], axis=1))
        outer.append(
            helper.make_node(
                "Reshape",
                [f"greedy.{kind}_by_iteration", "greedy.steps_by_sentences"],
                [f"greedy.all_{kind}"],
            )
        )
    outer += [
        helper.make_node(
            "ReduceMax", ["greedy.all_tokens"], ["greedy.best_token"], axes=[1], keepdims=0
        ),
        helper.make_node(
            "GreaterOrEqual", ["greedy.best_token", "greedy.zero"], ["greedy.step_made"]
        ),
        helper.make_node("Compress", ["greedy.all_tokens", "greedy.step_made"], ["tokens"], axis=0),
        helper.make_node("Compress", ["greedy.all_scores", "greedy.step_made"], ["scores"], axis=0),
    ]
    outer_constants = [
        const("greedy.axis_0", [0], np.int64),
        const("greedy.zero", 0, np.int64),
        const("greedy.one_step", 1, np.int64),
        const("greedy.one_column", [1], np.int64),
        const("greedy.bos", [[BOS_ID]], np.int32),
        const("greedy.empty_cache_dims", [heads, 0, head_dim], np.int64),
        const("greedy.true", True, np.bool_),
        const("greedy.round_up", steps_per_iteration - 1, np.int64),
        const("greedy.steps_per_iteration", steps_per_iteration, np.int64),
        const("greedy.minus_one_dim", [-1], np.int64),
    ]
    outer_inputs = [inputs["source_mask"]] + [inputs[name] for name in cross_names]
    outer_inputs.append(value("limits", INT64, ["sentences"]))
    outer_outputs = [
        value("tokens", INT64, ["steps", "sentences"]),
        value("scores", float_type, ["steps", "sentences"]),
    ]
    model = helper.make_model(
        helper.make_graph(
            outer, "greedy_batch_search", outer_inputs, outer_outputs, outer_constants
        ),
        producer_name="keras-transformer",
        opset_imports=list(step.opset_import),
    )
    model.ir_version = step.ir_version
    return model
