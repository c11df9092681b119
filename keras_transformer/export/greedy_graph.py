"""The whole greedy search as one ONNX graph: the decoder step inside an ONNX `Loop`.

A search that calls the decoder-step graph once per token pays, at every
step, for the Python loop, the feeds and the fetches around a graph that
itself takes a fraction of a millisecond at batch 1. Here the loop runs
inside ONNX Runtime: one call per batch of sentences, the self-attention
caches carried from one iteration to the next without leaving the runtime.

The loop body is the decoder-step graph of the same precision (float32,
float16 or int8: built from that graph's own proto), plus the rules of
`keras_transformer_runtime.spec.greedy`: each row takes the step's
best token other than padding and BOS; a row that produced EOS, or reached
its length limit, is done and is fed EOS from then on; the loop stops when
every row is done. Rows are independent, so a finished row changes nothing
in the others: the tokens and scores are those of the step-by-step search
(`tests/export/test_graphs.py` holds them equal).

Two graphs: `greedy_search` keeps every row to the end, finished ones fed
EOS, which suits one sentence; `greedy_batch_search` drops a sentence from
its state once it ends, as the Python loop does, so that a batch's later
steps compute only its unfinished sentences (it may make several steps per
loop iteration and drop the sentences that ended after them, and it finds
each row's best token block by block: `blocked_selection`).

Inputs: `source_mask (sentences, source_len) bool` and the cross keys and
values from encoder.onnx (one row per sentence), `limits (sentences,)
int64`, each sentence's maximum output length (EOS included; at least 1),
and `alignment () bool`. Outputs: `tokens (steps, sentences) int64`, the
token each row produced at each step (EOS when it ended there, -1 once it
was done), `scores (steps, sentences) float32`, that token's
log-probability (0 once done), and `alignments (steps, sentences, width)
float32`, the step's `alignment_weights` (the decoder step's output: the
cross-attention of `spec.alignment_layer`, heads averaged) where `alignment`
is true, `width` the source length, else width 0; a row's output is its
tokens up to its first EOS or -1, and its score the sum of its scores. The
mask and shortlist inputs: `mask_inputs`, `shortlist_input_values`.
"""

from __future__ import annotations

import numpy as np
from keras_transformer_runtime.export_format import (
    ALIGNMENT_INPUT,
    ALIGNMENT_WEIGHTS,
    ALIGNMENTS_OUTPUT,
)
from keras_transformer_runtime.specials import BOS_ID, EOS_ID

from keras_transformer.export.graph_builder import GraphBuilder, copied_nodes
from keras_transformer.export.step_graph import blocked_selection, step_vocabulary_size

# What `greedy_batch_search` writes at each step, per sentence.
KINDS = ("tokens", "scores", "aligns")


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


def first_token_ids(g, rows):
    """`(rows, 1) int32` BOS: the first tokens fed, for `rows` ((1,) int64) rows."""
    shape = g.node("Concat", [rows, g.int64s([1])], "token_shape", axis=0)
    return g.node("Expand", [g.const("bos", [[BOS_ID]], np.int32), shape], "first_token_ids")


def empty_cache(g, rows, heads, head_dim, cache_type):
    """`(rows, heads, 0, head_dim)`: a self-attention cache before the first step."""
    from onnx import helper

    shape = g.node("Concat", [rows, g.int64s([heads, 0, head_dim])], "empty_cache_shape", axis=0)
    return g.filled(shape, 0, helper.tensor_dtype_to_np_dtype(cache_type), "empty_cache")


def mask_inputs(g, width, step):
    """The outer graph's values for the stateless masks (`masked_top`), from the inputs
    `suppressed (suppressed,) int64` (ids never generated: `disable_unk`'s UNK,
    single-token `suppress_sequences`; empty for none) and `min_length () int64`
    (EOS is not allowed before that many tokens; 0 for none), for the
    decoder-step graph `step`: `mask_late` and `mask_early`, `(vocabulary,)`
    biases of the step's precision, -inf at the suppressed ids (and, early, at
    EOS), 0 elsewhere; and `wide_top_k (1,)`, `width` (a (1,) int64 value)
    plus one per id that may be dropped: each step selects that many tokens, so
    that `width` allowed ones remain."""
    from onnx import TensorProto, helper

    outputs = {value.name: value for value in step.graph.output}
    float_type = outputs["top_log_probs"].type.tensor_type.elem_type
    dtype = helper.tensor_dtype_to_np_dtype(float_type)
    vocabulary = step_vocabulary_size(step)
    # Required inputs: ONNX Runtime warns at every load of a graph whose
    # inputs have defaults (initializers of their names).
    ids = g.const("vocabulary_ids", np.arange(vocabulary, dtype=np.int64)[:, None])
    banned = g.node("Concat", ["suppressed", g.int64s([-1])], axis=0)  # never empty
    hits = g.node("Equal", [ids, g.unsqueeze(banned, [0])])  # (vocabulary, m + 1)
    hit = g.node("ReduceMax", [g.cast(hits, TensorProto.INT32)], axes=[1], keepdims=0)
    never, zero = g.const("mask_never", -np.inf, dtype), g.const("mask_zero", 0, dtype)
    late = g.node("Where", [g.cast(hit, TensorProto.BOOL), never, zero], "mask_late")
    is_eos = g.const("vocabulary_eos", np.arange(vocabulary) == EOS_ID)
    g.node("Where", [is_eos, never, late], "mask_early")
    early = g.cast(g.node("Greater", ["min_length", g.int64s(0)]), TensorProto.INT64)
    extra = g.node("Add", [g.node("Size", ["suppressed"]), early], "mask_extra")
    g.node("Greater", [extra, g.int64s(0)], "masking")  # () bool: any mask set
    return g.node("Add", [width, g.reshape(extra, [1])], "wide_top_k")


def shortlist_input_values(step):
    """`[shortlist]`, the input of a shortlisted decoder step (`shortlisted`),
    which its search graph takes too and its loop body reads from there; else []."""
    return [v for v in step.graph.input if v.name == "shortlist"]


def alignment_width(g):
    """The outer graph's `align_width` ((1,) int64): the source length where the input
    `alignment` (a bool scalar) asks for alignments, else 0, so that each step's
    row of them, and everything made of those rows, is empty when not asked for."""
    source_len = g.node("Shape", ["source_mask"], "source_len_1d", start=1, end=2)
    return g.node("Where", [ALIGNMENT_INPUT, source_len, g.int64s([0])], "align_width")


def step_alignment(b, weights, name):
    """A step's `(rows, align_width)` float32 alignment weights, from the step's output
    `weights` `(rows, source_len)` (`ALIGNMENT_WEIGHTS`, or a copy's)."""
    from onnx import TensorProto

    full = b.cast(weights, TensorProto.FLOAT, name + "_full")
    ends = b.name("align_width")
    return b.node("Slice", [full, b.int64s([0]), ends, b.int64s([1])], name)


def mask_input_values(g):
    """The value infos of the stateless masks' inputs (`mask_inputs`)."""
    from onnx import TensorProto

    return [
        g.value_info("suppressed", TensorProto.INT64, ["suppressed"]),
        g.value_info("min_length", TensorProto.INT64, []),
    ]


def masked_top(b, top_ids, top_log_probs, width, made, float_type, prefix=""):
    """The best `width` of a step's `wide_top_k` selected tokens `(rows, wide)` once
    the stateless masks are applied, as `spec.step_scores` applies them: a
    suppressed id, and EOS while fewer than `min_length` tokens are made (`made`,
    a scalar), take -inf (`mask_inputs`' biases); the order is kept (best first,
    ties to the lower id). Returns `(ids, log_probs)`, `(rows, width)` each
    (`float_type`: the log-probabilities' element type). Without a mask set
    (`masking`), the step selected `width` tokens and they are the answer: the
    masking nodes then do not run (`GraphBuilder.when`)."""
    from onnx import TensorProto

    v = b.name
    f = b.body()
    early = f.node("Less", [made, "min_length"], prefix + "early")
    bias = f.node("Where", [early, v("mask_early"), v("mask_late")], prefix + "mask_bias")
    picked = f.node("Gather", [bias, top_ids], prefix + "picked_bias", axis=0)
    allowed = f.node("Add", [top_log_probs, picked], prefix + "allowed")
    values, at = f.node("TopK", [allowed, width], [prefix + "masked_log_probs", prefix + "at"])
    ids = f.node("GatherElements", [top_ids, at], prefix + "masked_ids", axis=1)
    changes = [
        (prefix + "allowed_ids", ids, top_ids, TensorProto.INT64),
        (prefix + "allowed_log_probs", values, top_log_probs, float_type),
    ]
    return tuple(b.when(v("masking"), f, changes))


def _greedy_choice(b, top_ids, top_log_probs, steps_made, limits, prefix=""):
    """`spec.greedy`'s choice after a step: each row's best token and its
    log-probability ((rows,) each, from the step's `top_k` = 1 outputs), whether
    it is EOS, and whether the row has reached its length limit."""
    next_id = b.squeeze(top_ids, [1], prefix + "next_id")  # (rows,)
    chosen = b.squeeze(top_log_probs, [1], prefix + "chosen")  # (rows,)
    ended = b.node("Equal", [next_id, b.int64s(EOS_ID)], prefix + "ended")
    at_limit = b.node("GreaterOrEqual", [steps_made, limits], prefix + "at_limit")
    return next_id, chosen, ended, at_limit


def build_greedy_search(step):
    """Returns the greedy-search `onnx.ModelProto` whose loop body is `step`,
    a decoder-step graph (`keras_transformer.export.step_graph.build_decoder_step`,
    or its float16 or int8 conversion)."""
    from onnx import TensorProto, helper

    inputs, self_names, cross_names, heads, head_dim, cache_type = step_interface(step)
    float_type = {v.name: v for v in step.graph.output}["top_log_probs"].type.tensor_type.elem_type
    g = GraphBuilder("greedy.")
    eos, no_token = g.int64s(EOS_ID), g.int64s(-1)

    # ---- the loop body: the step, then spec.greedy's rules
    b = g.body()
    b.output("Identity", [g.name("wide_top_k")], "top_k")
    b.extend(step.graph.node)
    done = b.name("done")  # (B,) bool: a row that ended, fed EOS since
    steps_made = b.node("Add", [b.name("iteration"), b.int64s(1)], "steps_made")
    ids, log_probs = masked_top(
        b, "top_ids", "top_log_probs", g.int64s([1]), b.name("iteration"), float_type
    )
    next_id, chosen, ended, at_limit = _greedy_choice(b, ids, log_probs, steps_made, "limits")
    live = b.node("Not", [done], "live")
    zero_score = b.const("zero_score", 0.0, helper.tensor_dtype_to_np_dtype(float_type))
    b.node("Where", [live, chosen, zero_score], "step_score")
    b.node("Where", [live, next_id, no_token], "step_token")
    step_alignment(b, ALIGNMENT_WEIGHTS, "step_align")
    done_next = b.node("Or", [b.node("Or", [done, ended]), at_limit], "done_next")
    fed_id = b.node("Where", [done_next, eos, next_id], "fed_id")
    b.unsqueeze(b.cast(fed_id, TensorProto.INT32), [1], "token_ids_next")  # (B, 1)
    b.any_true(b.node("Not", [done_next]), "keep_going")

    value = g.value_info
    body_inputs = [
        value(b.name("iteration"), TensorProto.INT64, []),
        value(b.name("condition"), TensorProto.BOOL, []),
        value("token_ids", TensorProto.INT32, ["batch", 1]),
        value(done, TensorProto.BOOL, ["batch"]),
    ] + [value(name, cache_type, None) for name in self_names]
    body_outputs = [
        value(b.name("keep_going"), TensorProto.BOOL, []),
        value(b.name("token_ids_next"), TensorProto.INT32, ["batch", 1]),
        value(b.name("done_next"), TensorProto.BOOL, ["batch"]),
    ] + [value(f"new_{name}", cache_type, None) for name in self_names]
    body_outputs += [
        value(b.name("step_token"), TensorProto.INT64, ["batch"]),
        value(b.name("step_score"), float_type, ["batch"]),
        value(b.name("step_align"), TensorProto.FLOAT, ["batch", "width"]),
    ]
    body = b.graph("greedy_step", body_inputs, body_outputs, step.graph.initializer)

    # ---- the outer graph: the first state, the loop, nothing else
    mask_inputs(g, g.int64s([1]), step)
    alignment_width(g)
    rows = g.node("Shape", ["limits"], "rows")  # (1,): the sentences
    first_done = g.node("Equal", ["limits", g.int64s(0)], "first_done")
    max_steps = g.node("ReduceMax", ["limits"], "max_steps", keepdims=0)
    cache = empty_cache(g, rows, heads, head_dim, cache_type)
    g.output(
        "Loop",
        [max_steps, g.const("true", True, np.bool_), first_token_ids(g, rows), first_done]
        + [cache] * len(self_names),
        [g.name("last_token_ids"), g.name("last_done")]
        + [g.name(f"last_{name}") for name in self_names]
        + ["tokens", "scores", ALIGNMENTS_OUTPUT],
        body=body,
    )
    outer_inputs = [inputs["source_mask"]] + [inputs[name] for name in cross_names]
    outer_inputs.append(value("limits", TensorProto.INT64, ["sentences"]))
    outer_inputs.append(value(ALIGNMENT_INPUT, TensorProto.BOOL, []))
    outer_inputs += mask_input_values(g) + shortlist_input_values(step)
    outer_outputs = [
        value("tokens", TensorProto.INT64, ["steps", "sentences"]),
        value("scores", float_type, ["steps", "sentences"]),
        value(ALIGNMENTS_OUTPUT, TensorProto.FLOAT, ["steps", "sentences", "width"]),
    ]
    return g.model("greedy_search", outer_inputs, outer_outputs, like=step)


def build_greedy_batch_search(step, steps_per_iteration=1, blocked=True):
    """Returns the greedy search for batches of several sentences, with the
    inputs and outputs of `build_greedy_search(step)` and the same results.

    Its loop carries only the sentences still being decoded: a sentence that
    ends (EOS or its length limit) leaves the state, with its source mask,
    cross keys and values and caches, as in the Python loop, so that later
    steps compute only the rows left. That costs a copy of the state
    (`GraphBuilder.keep_rows`), which a single sentence, the last row of its
    batch, never needs: `build_greedy_search` serves it. Each loop iteration
    makes `steps_per_iteration` decoder steps and then compacts once: a
    sentence that ends at an earlier step of an iteration is computed, and
    ignored, until the iteration's end. With `blocked` (the default), each
    step finds its best token block by block (`blocked_selection`).
    """
    from onnx import TensorProto, helper

    if steps_per_iteration < 1:
        raise ValueError(f"steps_per_iteration must be at least 1, not {steps_per_iteration}")
    if blocked:
        step = blocked_selection(step) or step
    graph = step.graph
    inputs, self_names, cross_names, heads, head_dim, cache_type = step_interface(step)
    float_type = {v.name: v for v in graph.output}["top_log_probs"].type.tensor_type.elem_type
    INT64 = TensorProto.INT64
    g = GraphBuilder("greedy.")
    no_token = g.int64s(-1)
    zero_score = g.const("zero_score", 0.0, helper.tensor_dtype_to_np_dtype(float_type))
    # The body reads the live sentences' mask and cross caches from its state.
    sentence_inputs = ["source_mask", *cross_names]
    carried_name = {name: g.name(name) for name in sentence_inputs}
    # What every step's copy reads as is: weights, and values of the outer
    # graph (the shortlist and what is computed from it before the loop).
    produced = {name for node in graph.node for name in node.output}
    step_inputs = {value.name for value in graph.input} - {"top_k", "shortlist"}
    shared = {
        name
        for node in graph.node
        for name in node.input
        if name and name not in produced and name not in step_inputs
    }
    per_step = g.int64s(steps_per_iteration)
    no_tokens, zero_scores = g.name("no_tokens"), g.name("zero_scores")  # (sentences,)
    zero_aligns = g.name("zero_aligns")  # (sentences, align_width)

    # ---- the loop body: the steps, each followed by spec.greedy's rules,
    # then one compaction
    b = g.body()
    b.output("Identity", [g.name("wide_top_k")], "top_k")
    rows = b.name("rows")  # (R,): the sentence of each row
    steps_before = b.node("Mul", [b.name("iteration"), per_step], "steps_before")
    row_limits = b.node("Gather", ["limits", rows], "row_limits", axis=0)
    made = {}
    for j in range(steps_per_iteration):
        x = f"{j}."  # this step's values
        if j == 0:
            b.extend(copied_nodes(graph.node, names=carried_name))
            made = {name: name for name in ["top_ids", "top_log_probs", ALIGNMENT_WEIGHTS]}
            made.update({f"new_{name}": f"new_{name}" for name in self_names})
        else:
            prefix = f"greedy.step{j}/"
            names = dict(carried_name, token_ids=b.name(f"{j - 1}.fed_ids"))
            names.update({name: made[f"new_{name}"] for name in self_names})
            b.extend(copied_nodes(graph.node, prefix, names, shared))
            made = {name: prefix + name for name in made}
        steps_made = b.node("Add", [steps_before, b.int64s(j + 1)], x + "steps_made")
        made_before = b.node("Add", [steps_before, b.int64s(j)], x + "made_before")
        ids, log_probs = masked_top(
            b, made["top_ids"], made["top_log_probs"], g.int64s([1]), made_before, float_type, x
        )
        next_id, chosen, ended, at_limit = _greedy_choice(
            b, ids, log_probs, steps_made, row_limits, x
        )
        finished = b.node("Or", [ended, at_limit], x + "finished")
        not_finished = b.node("Not", [finished], x + "not_finished")
        if j == 0:
            token, score, keep = next_id, chosen, not_finished
        else:
            # Rows that ended at an earlier step of this iteration are ignored.
            live = b.name(f"{j - 1}.keep")
            token = b.node("Where", [live, next_id, no_token], x + "token_or_none")
            score = b.node("Where", [live, chosen, zero_score], x + "score_or_zero")
            keep = b.node("And", [live, not_finished], x + "live_on")
        b.node("Identity", [keep], x + "keep")
        b.node("ScatterElements", [no_tokens, rows, token], x + "step_token", axis=0)
        b.node("ScatterElements", [zero_scores, rows, score], x + "step_score", axis=0)
        align = step_alignment(b, made[ALIGNMENT_WEIGHTS], x + "row_align")  # (R, W)
        b.node("ScatterND", [zero_aligns, b.unsqueeze(rows, [1]), align], x + "step_align")
        b.unsqueeze(b.cast(next_id, TensorProto.INT32), [1], x + "fed_ids")  # (R, 1)
    last = f"{steps_per_iteration - 1}."
    b.any_true(b.name(last + "keep"), "keep_going")
    mask_type = inputs["source_mask"].type.tensor_type.elem_type
    states = [
        (b.name(last + "fed_ids"), TensorProto.INT32, "token_ids_next"),
        (rows, INT64, "rows_next"),
        (carried_name["source_mask"], mask_type, "source_mask_next"),
    ]
    states += [(carried_name[name], cache_type, f"{name}_next") for name in cross_names]
    states += [(made[f"new_{name}"], cache_type, f"{name}_next") for name in self_names]
    kept = b.keep_rows(b.name(last + "keep"), [s for s, *_ in states], [o for *_, o in states])

    value = g.value_info
    body_inputs = [
        value(b.name("iteration"), INT64, []),
        value(b.name("condition"), TensorProto.BOOL, []),
        value("token_ids", TensorProto.INT32, ["rows", 1]),
        value(rows, INT64, ["rows"]),
        value(carried_name["source_mask"], mask_type, None),
    ]
    body_inputs += [value(carried_name[name], cache_type, None) for name in cross_names]
    body_inputs += [value(name, cache_type, None) for name in self_names]
    body_outputs = [value(b.name("keep_going"), TensorProto.BOOL, [])]
    body_outputs += [value(out, t, None) for out, (_, t, _) in zip(kept, states, strict=True)]
    for j in range(steps_per_iteration):
        body_outputs += [
            value(b.name(f"{j}.step_token"), INT64, ["sentences"]),
            value(b.name(f"{j}.step_score"), float_type, ["sentences"]),
            value(b.name(f"{j}.step_align"), TensorProto.FLOAT, ["sentences", "width"]),
        ]
    body = b.graph("greedy_step", body_inputs, body_outputs, graph.initializer)

    # ---- the outer graph: the sentences with room for a token, the loop
    mask_inputs(g, g.int64s([1]), step)
    width = alignment_width(g)
    sentences = g.node("Shape", ["limits"], "sentences")  # (1,)
    count = g.squeeze(sentences, [0], "sentence_count")
    index = g.node("Range", [g.int64s(0), count, g.int64s(1)], "sentence_index")
    has_room = g.node("Greater", ["limits", g.int64s(0)], "has_room")
    first_rows = g.node("Compress", [index, has_room], "first_rows", axis=0)
    row_count = g.node("Shape", [first_rows], "row_count")
    max_steps = g.node("ReduceMax", ["limits"], "max_steps", keepdims=0)
    # Iterations: the most steps any sentence may take, rounded up.
    max_steps_up = g.node("Add", [max_steps, g.int64s(steps_per_iteration - 1)], "max_steps_up")
    iterations = g.node("Div", [max_steps_up, per_step], "iterations")
    cache = empty_cache(g, row_count, heads, head_dim, cache_type)
    g.filled(sentences, -1, np.int64, "no_tokens")
    g.filled(sentences, 0, helper.tensor_dtype_to_np_dtype(float_type), "zero_scores")
    aligns_shape = g.node("Concat", [sentences, width], "aligns_shape", axis=0)
    g.filled(aligns_shape, 0.0, np.float32, "zero_aligns")
    first = [g.node("Gather", [n, first_rows], f"first_{n}", axis=0) for n in sentence_inputs]
    g.node(
        "Loop",
        [iterations, g.const("true", True, np.bool_), first_token_ids(g, row_count), first_rows]
        + first
        + [cache] * len(self_names),
        [f"last_{out}" for *_, out in states]
        + [f"{kind}_{j}" for j in range(steps_per_iteration) for kind in KINDS],
        body=body,
    )
    # (iterations, sentences) for each step of an iteration, interleaved into
    # (steps, sentences); the last iteration's later steps, made after every
    # sentence had ended, are dropped: no token there is >= 0.
    steps_by_sentences = g.node("Concat", [g.int64s([-1]), sentences], axis=0)
    steps_shape = {"tokens": steps_by_sentences, "scores": steps_by_sentences}
    steps_shape["aligns"] = g.node("Concat", [steps_by_sentences, width], axis=0)
    every = {}
    for kind in KINDS:
        columns = [g.unsqueeze(g.name(f"{kind}_{j}"), [1]) for j in range(steps_per_iteration)]
        by_iteration = g.node("Concat", columns, f"{kind}_by_iteration", axis=1)  # (I, J, S, ...)
        every[kind] = g.reshape(by_iteration, steps_shape[kind], f"all_{kind}")  # (I * J, S, ...)
    best_token = g.node("ReduceMax", [every["tokens"]], "best_token", axes=[1], keepdims=0)
    step_made = g.node("GreaterOrEqual", [best_token, g.int64s(0)], "step_made")
    for kind, output in zip(KINDS, ("tokens", "scores", ALIGNMENTS_OUTPUT), strict=True):
        g.output("Compress", [every[kind], step_made], output, axis=0)

    outer_inputs = [inputs["source_mask"]] + [inputs[name] for name in cross_names]
    outer_inputs.append(value("limits", INT64, ["sentences"]))
    outer_inputs.append(value(ALIGNMENT_INPUT, TensorProto.BOOL, []))
    outer_inputs += mask_input_values(g) + shortlist_input_values(step)
    outer_outputs = [
        value("tokens", INT64, ["steps", "sentences"]),
        value("scores", float_type, ["steps", "sentences"]),
        value(ALIGNMENTS_OUTPUT, TensorProto.FLOAT, ["steps", "sentences", "width"]),
    ]
    return g.model("greedy_batch_search", outer_inputs, outer_outputs, like=step)
