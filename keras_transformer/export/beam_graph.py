"""The whole beam search as one ONNX graph: the decoder step inside an ONNX `Loop`.

The step-by-step beam search (`keras_transformer_runtime.search.beam_loop`)
calls the decoder-step graph once per token and, between the calls, ranks
the candidates, books the finished hypotheses and reorders the caches in
numpy. At small batches that Python work and the feeds and fetches around
each call cost as much as the step itself. Here all of it runs inside ONNX
Runtime: one call per batch of sentences.

The loop body is the decoder-step graph of the same precision, then
`beam_loop`'s rules, vectorized over sentences (row `p * k + j` of the
state is beam j of sentence p; the first step runs one row per sentence,
as `beam_loop(shared_first_step=True)` does):

- a sentence's candidates are its live beams' scores plus each beam's
  `2k` best tokens (the step's `top_k`), summed in double precision, and
  ranked with `TopK`, whose ties go to the lower beam, then the step's
  order (best first, ties to the lower token id): `beam_loop`'s
  `lexsort` order;
- among the `2k` best, an EOS candidate ranked within the first `k`
  finishes its beam; the first `k` other candidates are the new beams;
- at a sentence's length limit the new beams finish as they are;
- a finished hypothesis is scored by its summed log-probability over
  the length penalty `((5 + length) / 6) ** alpha`, and only the best
  one is kept (the first found among equals, as `max` does), with the
  count of those finished;
- a sentence is done when no live beam can beat its best finished
  hypothesis even at its maximum length, or when `k` have finished and
  no live beam beats the best at its current length; the loop stops when
  every sentence is done.

In `beam_search`, finished sentences stay in the state until the loop ends
(their rows are computed and ignored), which suits small batches;
`beam_batch_search` drops each sentence from its state when it is done, as
the Python loop does, for larger ones. Both run the same rules (`_build`).

Inputs: `source_mask (sentences, source_len) bool` and the cross keys and
values from encoder.onnx (one row per sentence), `limits (sentences,)
int64` (each sentence's maximum output length, EOS included; 0 for an
empty source), `beam_size ()` int64 (2 * beam_size at most the vocabulary
less padding and BOS) and `length_penalty ()` double (alpha; 0 turns it
off). Outputs: `tokens (sentences, steps) int64` and `lengths (sentences,)
int64` (a sentence's output is its first `lengths` tokens, EOS excluded),
and `scores (sentences,) double`, the length-penalized score.
"""

from __future__ import annotations

import numpy as np
from keras_transformer_runtime.specials import EOS_ID

from keras_transformer.export.graph_builder import GraphBuilder, copied_nodes
from keras_transformer.export.greedy_graph import empty_cache, first_token_ids, step_interface
from keras_transformer.export.step_graph import blocked_selection

PREFIX = "beam."


def build_beam_search(step, blocked=True):
    """Returns the beam-search `onnx.ModelProto` whose loop body is `step`, a
    decoder-step graph (`keras_transformer.export.step_graph.build_decoder_step`,
    or its float16 or int8 conversion). With `blocked` (the default), each step
    finds its rows' best tokens block by block (`blocked_selection`), which
    bounds `2 * beam_size` by `selection_top_k_limit`."""
    return _build(step, compact=False, blocked=blocked)


def build_beam_batch_search(step, blocked=True):
    """Returns the beam search for batches of several sentences, with the
    inputs and outputs of `build_beam_search(step)` and the same results.

    Its loop carries only the sentences still being searched: a sentence that
    is done leaves the state at that step (its beams, their caches, its
    source mask, cross keys and values), as in the Python loop, so that later
    steps compute only the sentences left; each step writes the best
    hypotheses of its sentences into the outputs. That costs a copy of the
    state at every step (`compaction`), which one sentence, the last of its
    batch, never needs: `build_beam_search` serves it. `blocked`: as in
    `build_beam_search`.
    """
    return _build(step, compact=True, blocked=blocked)


def _build(step, compact, blocked):
    from onnx import TensorProto

    if blocked:
        step = blocked_selection(step) or step
    graph = step.graph
    inputs, self_names, cross_names, heads, head_dim, cache_type = step_interface(step)
    DOUBLE, INT64 = TensorProto.DOUBLE, TensorProto.INT64

    # ---- the outer graph, before the loop: sizes, constants and the first state
    o = GraphBuilder(PREFIX)
    zero_i, one_i = o.const("zero_i", 0, np.int64), o.const("one_i", 1, np.int64)
    two_i = o.const("two_i", 2, np.int64)
    axis0, axis1 = o.const("axis0", [0], np.int64), o.const("axis1", [1], np.int64)
    minus_one_1d = o.const("minus_one_1d", [-1], np.int64)
    five, six = o.const("five", 5.0, np.float64), o.const("six", 6.0, np.float64)
    neg_inf = o.const("neg_inf", -np.inf, np.float64)
    zero_d = o.const("zero_d", 0.0, np.float64)
    eos = o.const("eos", EOS_ID, np.int64)
    o.node("Shape", ["limits"], "sentences_1d")
    o.node("Squeeze", [PREFIX + "sentences_1d", axis0], "sentences")
    o.node("Range", [zero_i, PREFIX + "sentences", one_i], "sentence_index")
    o.node("Mul", ["beam_size", two_i], "two_k")
    # The step graph's own `top_k` input: each row's 2k best tokens.
    o.output("Reshape", [PREFIX + "two_k", axis1], "top_k")
    o.node("Reshape", ["beam_size", axis1], "k_1d")
    o.node("Range", [zero_i, PREFIX + "two_k", one_i], "positions")  # ranks 0 .. 2k - 1
    o.node("Add", [PREFIX + "positions", PREFIX + "two_k"], "positions_after")
    o.node("Less", [PREFIX + "positions", "beam_size"], "first_k")
    o.node("Cast", ["limits"], "limits_d", to=DOUBLE)
    o.node("Add", [PREFIX + "limits_d", five], "limit_penalty_base")
    o.node("Div", [PREFIX + "limit_penalty_base", six], "limit_penalty_ratio")
    o.node("Pow", [PREFIX + "limit_penalty_ratio", "length_penalty"], "limit_penalty")
    # First state: one row per sentence fed BOS; beam 0 alone is live.
    first_token_ids(o, PREFIX + "sentences_1d")  # (S, 1)
    o.node("Range", [zero_i, "beam_size", one_i], "beam_index")
    o.node("Equal", [PREFIX + "beam_index", zero_i], "is_first_beam")
    o.node("Where", [PREFIX + "is_first_beam", zero_d, neg_inf], "first_beam_scores")
    o.node("Concat", [PREFIX + "sentences_1d", PREFIX + "k_1d"], "beam_shape", axis=0)
    o.node("Expand", [PREFIX + "first_beam_scores", PREFIX + "beam_shape"], "first_alive_scores")
    empty_shape = o.node("Concat", [PREFIX + "sentences_1d", o.int64s([0])], "empty_shape", axis=0)
    o.filled(empty_shape, 0, np.int64, "no_tokens")  # (S, 0)
    o.node("Equal", ["limits", zero_i], "first_done")
    o.node("Where", [PREFIX + "first_done", zero_d, neg_inf], "first_best_scores")
    o.filled(PREFIX + "sentences_1d", 0, np.int64, "zeros")  # (S,)
    o.filled(PREFIX + "token_shape", -1, np.int64, "pad_column")  # (S, 1)
    empty_cache(o, PREFIX + "sentences_1d", heads, head_dim, cache_type)  # (S, N, 0, H)
    o.node("ReduceMax", ["limits"], "max_steps", keepdims=0)

    # ---- the loop body: the step, then beam_loop's rules
    b = o.body()
    P = PREFIX
    b.node("Shape", ["token_ids"], "rows_shape")
    b.node("Gather", [P + "rows_shape", zero_i], "rows")
    b.node("Div", [P + "rows", P + "sentences"], "n")  # rows per sentence: 1, then k
    b.node("Shape", ["top_ids"], "top_shape")
    b.node("Gather", [P + "top_shape", one_i], "w")
    b.node("Mul", [P + "n", P + "w"], "nw")
    b.node("Reshape", [P + "n", axis1], "n_1d")
    b.node("Reshape", [P + "w", axis1], "w_1d")
    b.node("Reshape", [P + "nw", axis1], "nw_1d")
    b.node("Concat", [P + "sentences_1d", P + "n_1d", P + "w_1d"], "s_n_w", axis=0)
    b.node("Concat", [P + "sentences_1d", P + "nw_1d"], "s_nw", axis=0)
    # Candidates: live beam scores plus each row's best tokens, in double.
    b.node("Cast", ["top_log_probs"], "step_scores", to=DOUBLE)
    b.node("Reshape", [P + "step_scores", P + "s_n_w"], "step_scores_3d")
    b.node("Slice", [P + "alive_scores", axis0, P + "n_1d", axis1], "row_scores")
    b.node("Unsqueeze", [P + "row_scores", o.const("axis2", [2], np.int64)], "row_scores_3d")
    b.node("Add", [P + "row_scores_3d", P + "step_scores_3d"], "candidates_3d")
    b.node("Reshape", [P + "candidates_3d", P + "s_nw"], "candidates")
    b.node("Reshape", ["top_ids", P + "s_nw"], "candidate_ids")
    b.node("TopK", [P + "candidates", "top_k"], ["ranked", "ranked_at"], axis=1)
    b.node("Div", [P + "ranked_at", P + "w"], "ranked_beam")
    b.node("GatherElements", [P + "candidate_ids", P + "ranked_at"], "ranked_token", axis=1)
    b.node("Greater", [P + "ranked", neg_inf], "finite")
    b.node("Equal", [P + "ranked_token", eos], "is_eos")
    b.node("And", [P + "is_eos", P + "finite"], "eos_finite")
    b.node("And", [P + "eos_finite", P + "first_k"], "eos_finishes")
    b.node("Not", [P + "is_eos"], "not_eos")
    b.node("And", [P + "not_eos", P + "finite"], "continues")
    # The new beams: the first k continuing candidates, in rank order.
    b.node("Where", [P + "continues", P + "positions", P + "positions_after"], "slot_key")
    b.node("TopK", [P + "slot_key", P + "k_1d"], ["slot_rank", "slot_at"], axis=1, largest=0)
    b.node("Less", [P + "slot_rank", P + "two_k"], "slot_ok")
    b.node("GatherElements", [P + "ranked", P + "slot_at"], "slot_raw_score", axis=1)
    b.node("Where", [P + "slot_ok", P + "slot_raw_score", neg_inf], "slot_score")
    b.node("GatherElements", [P + "ranked_beam", P + "slot_at"], "slot_raw_beam", axis=1)
    b.node("Where", [P + "slot_ok", P + "slot_raw_beam", zero_i], "slot_beam")
    b.node("GatherElements", [P + "ranked_token", P + "slot_at"], "slot_token", axis=1)
    # Length penalties of this step and whether each sentence is out of room.
    b.node("Add", [P + "iteration", one_i], "made")
    b.node("GreaterOrEqual", [P + "made", "limits"], "at_limit")
    b.node("Unsqueeze", [P + "at_limit", axis1], "at_limit_2d")
    b.node("Cast", [P + "made"], "made_d", to=DOUBLE)
    b.node("Add", [P + "made_d", five], "penalty_base")
    b.node("Div", [P + "penalty_base", six], "penalty_ratio")
    b.node("Pow", [P + "penalty_ratio", "length_penalty"], "penalty")
    # Hypotheses finished at this step: EOS ones in rank order, then (at the
    # limit) the new beams; the best is the first of the highest.
    b.node("Div", [P + "ranked", P + "penalty"], "ranked_normalized")
    b.node("Where", [P + "eos_finishes", P + "ranked_normalized", neg_inf], "eos_normalized")
    b.node("And", [P + "slot_ok", P + "at_limit_2d"], "limit_finishes")
    b.node("Div", [P + "slot_score", P + "penalty"], "slot_normalized")
    b.node("Where", [P + "limit_finishes", P + "slot_normalized", neg_inf], "limit_normalized")
    b.node("Concat", [P + "eos_normalized", P + "limit_normalized"], "finish_scores", axis=1)
    b.node("ReduceMax", [P + "finish_scores"], "step_best", axes=[1], keepdims=0)
    b.node("ArgMax", [P + "finish_scores"], "step_best_at", axis=1, keepdims=1)
    b.node("Not", [P + "done"], "live")
    b.node("Greater", [P + "step_best", P + "best_score"], "better")
    b.node("And", [P + "live", P + "better"], "update")
    b.node("Where", [P + "update", P + "step_best", P + "best_score"], "best_score_next")
    b.node("Cast", [P + "eos_finishes"], "eos_finishes_i", to=INT64)
    b.node("Cast", [P + "limit_finishes"], "limit_finishes_i", to=INT64)
    b.node("Concat", [P + "eos_finishes_i", P + "limit_finishes_i"], "finishes_i", axis=1)
    b.node("ReduceSum", [P + "finishes_i", axis1], "finished_now", keepdims=0)
    b.node("Where", [P + "live", P + "finished_now", zero_i], "finished_counted")
    b.node("Add", [P + "count", P + "finished_counted"], "count_next")
    # The tokens of the step's best finished hypothesis: its beam's tokens,
    # plus the new token when it finished at the limit (EOS is not kept).
    b.node("Shape", [P + "ranked_token"], "ranked_shape")
    b.filled(P + "ranked_shape", -1, np.int64, "no_token")
    b.node("Concat", [P + "ranked_beam", P + "slot_beam"], "finish_beams", axis=1)
    b.node("Concat", [P + "no_token", P + "slot_token"], "finish_tokens", axis=1)
    b.node("GatherElements", [P + "finish_beams", P + "step_best_at"], "best_beam_2d", axis=1)
    b.node("Squeeze", [P + "best_beam_2d", axis1], "best_beam")
    b.node("GatherElements", [P + "finish_tokens", P + "step_best_at"], "best_last", axis=1)
    b.node("Mul", [P + "sentence_index", P + "n"], "first_rows")
    b.node("Add", [P + "first_rows", P + "best_beam"], "best_row")
    b.node("Gather", [P + "alive_tokens", P + "best_row"], "best_prefix", axis=0)
    b.node("Concat", [P + "best_prefix", P + "best_last"], "finished_tokens", axis=1)
    b.node("Concat", [P + "best_tokens", P + "pad_column"], "best_tokens_grown", axis=1)
    b.node("Unsqueeze", [P + "update", axis1], "update_2d")
    b.node(
        "Where",
        [P + "update_2d", P + "finished_tokens", P + "best_tokens_grown"],
        "best_tokens_next",
    )
    b.node("Squeeze", [P + "best_last", axis1], "best_last_1d")
    b.node("GreaterOrEqual", [P + "best_last_1d", zero_i], "appended")
    b.node("Cast", [P + "appended"], "appended_i", to=INT64)
    b.node("Add", [P + "iteration", P + "appended_i"], "finished_length")
    b.node("Where", [P + "update", P + "finished_length", P + "best_length"], "best_length_next")
    # Done: no live beam can win, or k finished and none wins at this length.
    b.node("Slice", [P + "slot_score", axis0, axis1, axis1], "top_slot_2d")
    b.node("Squeeze", [P + "top_slot_2d", axis1], "top_slot")
    b.node("Where", [P + "at_limit", neg_inf, P + "top_slot"], "top_live")
    b.node("Div", [P + "top_live", P + "limit_penalty"], "top_bound")
    b.node("Greater", [P + "top_bound", P + "best_score_next"], "can_improve")
    b.node("Div", [P + "top_live", P + "penalty"], "top_now")
    b.node("LessOrEqual", [P + "top_now", P + "best_score_next"], "none_better")
    b.node("GreaterOrEqual", [P + "count_next", "beam_size"], "enough")
    b.node("And", [P + "enough", P + "none_better"], "settled")
    b.node("Not", [P + "can_improve"], "hopeless")
    b.node("Or", [P + "settled", P + "hopeless"], "stops")
    b.node("Or", [P + "done", P + "stops"], "done_next")
    b.node("Cast", [P + "done_next"], "done_next_i", to=TensorProto.INT32)
    b.node("ReduceMin", [P + "done_next_i"], "all_done_i", keepdims=0)
    b.node("Cast", [P + "all_done_i"], "all_done", to=TensorProto.BOOL)
    b.node("Not", [P + "all_done"], "keep_going")
    # The next state: the new beams, their tokens and their rows' caches.
    b.node("Where", [P + "at_limit_2d", neg_inf, P + "slot_score"], "alive_scores_next")
    b.node("Unsqueeze", [P + "first_rows", axis1], "first_rows_2d")
    b.node("Add", [P + "first_rows_2d", P + "slot_beam"], "origin_2d")
    b.node("Reshape", [P + "origin_2d", minus_one_1d], "origin")
    b.node("Gather", [P + "alive_tokens", P + "origin"], "alive_prefix", axis=0)
    b.node("Reshape", [P + "slot_token", o.const("column", [-1, 1], np.int64)], "slot_token_column")
    b.node("Concat", [P + "alive_prefix", P + "slot_token_column"], "alive_tokens_next", axis=1)
    b.node("Where", [P + "slot_ok", P + "slot_token", eos], "fed")
    b.node("Cast", [P + "fed"], "fed_i32", to=TensorProto.INT32)
    b.node("Reshape", [P + "fed_i32", P + "column"], "token_ids_next")
    for name in self_names:
        b.node("Gather", [f"new_{name}", P + "origin"], f"next_{name}", axis=0)

    value = o.value_info
    step_nodes = list(graph.node)
    if compact:
        # The body reads the live sentences' values (`sentence_ids`: their indices
        # among the inputs'), where the loop above reads every sentence's.
        sentence_inputs = ["source_mask", *cross_names]
        live_name = {name: P + "live_" + name for name in sentence_inputs}
        live_name.update(
            {
                "limits": P + "live_limits",
                P + "sentences": P + "live_count",
                P + "sentences_1d": P + "live_count_1d",
                P + "sentence_index": P + "live_index",
                P + "limit_penalty": P + "live_limit_penalty",
                P + "pad_column": P + "live_pad_column",
            }
        )
        step_nodes = copied_nodes(step_nodes, names=live_name)
        rules, b.nodes = copied_nodes(b.nodes, names=live_name), []
        b.node("Gather", ["limits", P + "sentence_ids"], "live_limits", axis=0)
        b.node("Gather", [P + "limit_penalty", P + "sentence_ids"], "live_limit_penalty", axis=0)
        b.node("Shape", [P + "sentence_ids"], "live_count_1d")
        b.node("Squeeze", [P + "live_count_1d", axis0], "live_count")
        b.node("Range", [zero_i, P + "live_count", one_i], "live_index")
        b.node("Concat", [P + "live_count_1d", axis1], "live_column_shape", axis=0)
        b.filled(P + "live_column_shape", -1, np.int64, "live_pad_column")  # (S', 1)
        b.extend(rules)
        # Each step writes its sentences' best hypotheses into the outputs.
        b.node(
            "ScatterElements",
            [P + "result_score", P + "sentence_ids", P + "best_score_next"],
            "result_score_next",
            axis=0,
        )
        b.node(
            "ScatterElements",
            [P + "result_length", P + "sentence_ids", P + "best_length_next"],
            "result_length_next",
            axis=0,
        )
        b.node("Concat", [P + "result_tokens", P + "pad_column"], "result_tokens_grown", axis=1)
        b.node("Unsqueeze", [P + "sentence_ids", axis1], "live_column")
        b.node(
            "ScatterND",
            [P + "result_tokens_grown", P + "live_column", P + "best_tokens_next"],
            "result_tokens_next",
        )
        # Then the sentences done at this step leave the state, with their beams.
        b.node("Not", [P + "done_next"], "keep")
        b.node("Concat", [P + "live_count_1d", P + "k_1d"], "live_beams_shape", axis=0)
        b.node("Unsqueeze", [P + "keep", axis1], "keep_column")
        b.node("Expand", [P + "keep_column", P + "live_beams_shape"], "keep_beams")
        b.node("Reshape", [P + "keep_beams", minus_one_1d], "keep_rows")
        per_sentence = [
            "sentence_ids",
            "alive_scores_next",
            "done_next",
            "best_score_next",
            "best_tokens_next",
            "best_length_next",
            "count_next",
        ]
        per_sentence += [live_name[name][len(P) :] for name in sentence_inputs]
        per_row = ["token_ids_next", "alive_tokens_next"] + [f"next_{n}" for n in self_names]
        b.keep_rows(P + "keep", [P + n for n in per_sentence], ["kept_" + n for n in per_sentence])
        b.keep_rows(P + "keep_rows", [P + n for n in per_row], ["kept_" + n for n in per_row])

    carried = [
        ("token_ids", "token_ids_next", TensorProto.INT32, "first_token_ids"),
        ("alive_scores", "alive_scores_next", DOUBLE, "first_alive_scores"),
        ("alive_tokens", "alive_tokens_next", INT64, "no_tokens"),
        ("done", "done_next", TensorProto.BOOL, "first_done"),
        ("best_score", "best_score_next", DOUBLE, "first_best_scores"),
        ("best_tokens", "best_tokens_next", INT64, "no_tokens"),
        ("best_length", "best_length_next", INT64, "zeros"),
        ("count", "count_next", INT64, "zeros"),
    ]
    carried += [(name, f"next_{name}", cache_type, "empty_cache") for name in self_names]
    outputs = {"tokens": "best_tokens", "lengths": "best_length", "scores": "best_score"}
    if compact:
        # The state starts with the sentences that have room for a token.
        o.node("Greater", ["limits", zero_i], "has_room")
        o.node("Compress", [P + "sentence_index", P + "has_room"], "first_live", axis=0)
        per_sentence_initials = {"first_token_ids", "first_alive_scores", "first_done"}
        per_sentence_initials |= {"first_best_scores", "no_tokens", "zeros", "empty_cache"}
        for initial in sorted(per_sentence_initials):
            o.node("Gather", [P + initial, P + "first_live"], "live_" + initial, axis=0)
        for name in sentence_inputs:
            o.node("Gather", [name, P + "first_live"], "live_first_" + name, axis=0)
        carried = [
            (name, "kept_" + next_name, elem_type, "live_" + initial)
            for name, next_name, elem_type, initial in carried
        ]
        carried += [("sentence_ids", "kept_sentence_ids", INT64, "first_live")]
        carried += [
            (
                live_name[name][len(P) :],
                "kept_" + live_name[name][len(P) :],
                t,
                "live_first_" + name,
            )
            for name, t in zip(
                sentence_inputs,
                [inputs[n].type.tensor_type.elem_type for n in sentence_inputs],
                strict=True,
            )
        ]
        carried += [
            ("result_score", "result_score_next", DOUBLE, "first_best_scores"),
            ("result_tokens", "result_tokens_next", INT64, "no_tokens"),
            ("result_length", "result_length_next", INT64, "zeros"),
        ]
        outputs = {"tokens": "result_tokens", "lengths": "result_length", "scores": "result_score"}

    def body_name(name):
        return name if name == "token_ids" or name in self_names else P + name

    body_inputs = [value(P + "iteration", INT64, []), value(P + "condition", TensorProto.BOOL, [])]
    body_inputs += [value(body_name(name), t) for name, _, t, _ in carried]
    body_outputs = [value(P + "keep_going", TensorProto.BOOL, [])]
    body_outputs += [value(P + name, t) for _, name, t, _ in carried]
    b.nodes = step_nodes + b.nodes
    body = b.graph("beam_step", body_inputs, body_outputs, graph.initializer)
    final = [P + f"last_{name}" for name, *_ in carried]
    o.node(
        "Loop",
        [P + "max_steps", o.const("true", True, np.bool_)] + [P + c[3] for c in carried],
        [f"last_{name}" for name, *_ in carried],
        body=body,
    )
    named = dict(zip((name for name, *_ in carried), final, strict=True))
    for output, state in outputs.items():
        o.output("Identity", [named[state]], output)

    outer_inputs = [inputs["source_mask"]] + [inputs[name] for name in cross_names]
    outer_inputs += [
        value("limits", INT64, ["sentences"]),
        value("beam_size", INT64, []),
        value("length_penalty", DOUBLE, []),
    ]
    outer_outputs = [
        value("tokens", INT64, ["sentences", "steps"]),
        value("lengths", INT64, ["sentences"]),
        value("scores", DOUBLE, ["sentences"]),
    ]
    return o.model("beam_search", outer_inputs, outer_outputs, like=step)
