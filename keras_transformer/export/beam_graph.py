"""The whole beam search as one ONNX graph: the decoder step inside an ONNX `Loop`.

The step-by-step beam search (`keras_transformer_runtime.search.search_loop`)
calls the decoder-step graph once per token and, between the calls, ranks
the candidates, books the finished hypotheses and reorders the caches in
numpy. At small batches that Python work and the feeds and fetches around
each call cost as much as the step itself. Here all of it runs inside ONNX
Runtime: one call per batch of sentences.

The loop body is the decoder-step graph of the same precision, then
the rules of `keras_transformer_runtime.spec.beam`, vectorized over
sentences (row `p * k + j` of the state is beam j of sentence p; the first
step runs one row per sentence, its beams all starting from BOS):

- a sentence's candidates are its live beams' scores plus each beam's
  `2k` best tokens (the step's `top_k`), summed in double precision, and
  ranked with `TopK`, whose ties go to the lower beam, then the step's
  order (best first, ties to the lower token id): the specification's
  order (`beam * vocabulary + token`);
- among the `2k` best, an EOS candidate ranked within the first `k`
  finishes its beam; the first `k` other candidates are the new beams;
- at a sentence's length limit the new beams finish as they are;
- a finished hypothesis is scored by its summed log-probability over
  the length penalty `((5 + length) / 6) ** alpha` (GNMT's), or with
  `length_penalty_form` 1, `length ** alpha` (transformers' average form);
  the `n_best` best are kept, best first (the first found among equals, as a stable
  sort does), with the count of those finished;
- a sentence is done when no live beam can beat its `n_best`-th best
  finished hypothesis even at its maximum length, or when `k` have
  finished and no live beam beats it at its current length (GNMT's form
  only; with `n_best` 1: `spec.beam`'s rule; above:
  `spec.SentenceSearch`'s); the loop stops when every sentence is done.

In `beam_search`, finished sentences stay in the state until the loop ends
(their rows are computed and ignored), which suits small batches;
`beam_batch_search` drops each sentence from its state when it is done, as
the Python loop does, for larger ones. Both run the same rules
(`_beam_step_rules`), written with `GraphBuilder` like every exported graph.

Inputs: `source_mask (sentences, source_len) bool` and the cross keys and
values from encoder.onnx (one row per sentence), `limits (sentences,)
int64` (each sentence's maximum output length, EOS included; 0 for an
empty source), `beam_size ()` int64 (2 * beam_size at most the vocabulary
less padding and BOS) and `length_penalty ()` double (alpha; 0 turns it
off), `n_best ()` int64 (at most `beam_size`) and `length_penalty_form
()` int64, 0 (GNMT's) or 1 (average; exports of format 8 made before this
input lack it). Outputs, per sentence its
`n_best` best hypotheses, best first: `tokens (sentences, n_best, steps)
int64` and `lengths (sentences, n_best) int64` (a hypothesis is its first
`lengths` tokens, EOS excluded), `scores (sentences, n_best) double`, the
length-penalized score (-inf where fewer finished), and `token_scores
(sentences, n_best, steps) double`, the step log-probabilities (the first
`lengths` tokens' and, where it ended with EOS, EOS's; format version 7;
`n_best`: format version 8), and `alignments (sentences, n_best, steps,
width) float`, the decoder step's `alignment_weights` at those steps (width
the source length where the input `alignment () bool` asks for them, else
0: every array of them is then empty, so a search without them costs
nothing more; exports of format 8 made before these lack both).
"""

from __future__ import annotations

import numpy as np
from keras_transformer_runtime.export_format import (
    ALIGNMENT_INPUT,
    ALIGNMENT_WEIGHTS,
    ALIGNMENTS_OUTPUT,
    LENGTH_PENALTY_FORM_IDS,
    LENGTH_PENALTY_FORM_INPUT,
)
from keras_transformer_runtime.specials import EOS_ID

from keras_transformer.export.graph_builder import GraphBuilder, copied_nodes
from keras_transformer.export.greedy_graph import (
    empty_cache,
    first_token_ids,
    mask_input_values,
    mask_inputs,
    masked_top,
    shortlist_input_values,
    step_interface,
)
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
    state at every step (`GraphBuilder.keep_rows`), which one sentence, the last of its
    batch, never needs: `build_beam_search` serves it. `blocked`: as in
    `build_beam_search`.
    """
    return _build(step, compact=True, blocked=blocked)


def _penalty_form(o):
    """The outer graph's `penalty_offset` (5 for GNMT's form, 0 for the average form),
    `penalty_divisor` (offset + 1) and `gnmt_stop` (whether GNMT's early stop holds),
    from the `length_penalty_form` input."""
    average_id = o.int64s(LENGTH_PENALTY_FORM_IDS["average"])
    average = o.node("Equal", [LENGTH_PENALTY_FORM_INPUT, average_id], "average_form")
    offset = o.node(
        "Where",
        [average, o.const("zero_offset", 0.0, np.float64), o.const("five", 5.0, np.float64)],
        "penalty_offset",
    )
    o.node("Add", [offset, o.const("one_d", 1.0, np.float64)], "penalty_divisor")
    o.node("Not", [average], "gnmt_stop")


def _length_penalty(g, length, name):
    """`((offset + length) / (offset + 1)) ** length_penalty` in double, for `length`
    (int64): GNMT's `((5 + length) / 6) ** alpha`, or `length ** alpha`."""
    from onnx import TensorProto

    base = g.node("Add", [g.cast(length, TensorProto.DOUBLE), g.name("penalty_offset")])
    ratio = g.node("Div", [base, g.name("penalty_divisor")])
    return g.node("Pow", [ratio, "length_penalty"], name)


def _first_state(o, step, heads, head_dim, cache_type):
    """The outer graph before the loop: sizes, the ranks' constants and the
    first state (one row per sentence fed BOS; beam 0 alone is live)."""
    zero, one = o.int64s(0), o.int64s(1)
    neg_inf, zero_d = o.const("neg_inf", -np.inf, np.float64), o.const("zero_d", 0.0, np.float64)
    sentences_1d = o.node("Shape", ["limits"], "sentences_1d")  # (1,): S
    sentences = o.squeeze(sentences_1d, [0], "sentences")
    o.node("Range", [zero, sentences, one], "sentence_index")  # 0 .. S - 1
    two_k = o.node("Mul", ["beam_size", o.int64s(2)], "two_k")
    # The step graph's own `top_k` input: each row's 2k best allowed tokens,
    # and one more per token the stateless masks may drop (`masked_top`).
    o.reshape(two_k, [1], "two_k_1d")
    o.output("Identity", [mask_inputs(o, o.name("two_k_1d"), step)], "top_k")
    k_1d = o.reshape("beam_size", [1], "k_1d")
    positions = o.node("Range", [zero, two_k, one], "positions")  # ranks 0 .. 2k - 1
    o.node("Add", [positions, two_k], "positions_after")
    o.node("Less", [positions, "beam_size"], "first_k")
    _penalty_form(o)
    _length_penalty(o, "limits", "limit_penalty")  # (S,): at each sentence's limit
    first_token_ids(o, sentences_1d)  # (S, 1)
    beam_index = o.node("Range", [zero, "beam_size", one], "beam_index")
    is_first_beam = o.node("Equal", [beam_index, zero], "is_first_beam")
    first_beam_scores = o.node("Where", [is_first_beam, zero_d, neg_inf], "first_beam_scores")
    beam_shape = o.node("Concat", [sentences_1d, k_1d], "beam_shape", axis=0)
    o.node("Expand", [first_beam_scores, beam_shape], "first_alive_scores")  # (S, k)
    empty_shape = o.node("Concat", [sentences_1d, o.int64s([0])], "empty_shape", axis=0)
    o.filled(empty_shape, 0, np.int64, "no_tokens")  # (S, 0)
    o.filled(empty_shape, 0.0, np.float64, "no_steps")  # (S, 0)
    # The n best finished hypotheses of each sentence, best first: (S, n, ...).
    n_1d = o.reshape("n_best", [1], "n_best_1d")
    best_shape = o.node("Concat", [sentences_1d, n_1d], "best_shape", axis=0)  # (S, n)
    best_empty = o.node("Concat", [best_shape, o.int64s([0])], "best_empty_shape", axis=0)
    o.filled(best_empty, 0, np.int64, "no_best_tokens")  # (S, n, 0)
    o.filled(best_empty, 0.0, np.float64, "no_best_steps")  # (S, n, 0)
    best_column = o.node("Concat", [best_shape, o.int64s([1])], "best_column_shape", axis=0)
    o.filled(best_column, -1, np.int64, "best_pad_column")  # (S, n, 1)
    o.filled(best_column, 0.0, np.float64, "best_pad_step_column")  # (S, n, 1)
    o.filled(best_shape, 0, np.int64, "best_zeros")  # (S, n)
    # Alignments: each step's row is `align_width` wide, the source length when
    # the `alignment` input asks for them, else 0 (all their arrays are empty).
    source_len = o.node("Shape", ["source_mask"], "source_len_1d", start=1, end=2)
    width = o.node("Where", [ALIGNMENT_INPUT, source_len, o.int64s([0])], "align_width")
    no_align = o.node("Concat", [empty_shape, width], "no_align_shape", axis=0)
    o.filled(no_align, 0.0, np.float32, "no_align")  # (S, 0, W)
    no_best_align = o.node("Concat", [best_empty, width], "no_best_align_shape", axis=0)
    o.filled(no_best_align, 0.0, np.float32, "no_best_align")  # (S, n, 0, W)
    pad_align = o.node("Concat", [best_column, width], "best_pad_align_shape", axis=0)
    o.filled(pad_align, 0.0, np.float32, "best_pad_align")  # (S, n, 1, W)
    o.node("Sub", ["n_best", one], "last_best")  # the n-th best's index
    first_done = o.node("Equal", ["limits", zero], "first_done")  # an empty source
    # An empty source's one hypothesis (empty, score 0) is found at once.
    first_entry = o.unsqueeze(o.node("Equal", [o.node("Range", [zero, "n_best", one]), zero]), [0])
    first_found = o.node("And", [o.unsqueeze(first_done, [1]), first_entry], "first_found")
    o.node("Where", [first_found, zero_d, neg_inf], "first_best_scores")  # (S, n)
    o.filled(sentences_1d, 0, np.int64, "zeros")  # (S,)
    empty_cache(o, sentences_1d, heads, head_dim, cache_type)  # (S, N, 0, H)
    o.node("ReduceMax", ["limits"], "max_steps", keepdims=0)


def _beam_step_rules(b, self_names):
    """`spec.beam`'s rules after one decoder step, in the loop body `b`.

    Reads the step's `top_ids` and `top_log_probs` ((rows, 2k), rows = S * n:
    n rows per sentence, 1 at the first step and k after) and the state;
    writes the next state (`*_next`) and `keep_going`.
    """
    from onnx import TensorProto

    DOUBLE, INT64 = TensorProto.DOUBLE, TensorProto.INT64
    v = b.name  # a value made outside this function
    zero, one, axis0, axis1 = b.int64s(0), b.int64s(1), b.int64s([0]), b.int64s([1])
    neg_inf, eos = b.const("neg_inf", -np.inf, np.float64), b.int64s(EOS_ID)

    rows = b.node("Gather", [b.node("Shape", ["token_ids"]), zero], "rows")
    n = b.node("Div", [rows, v("sentences")], "n")  # rows per sentence: 1, then k
    # The step's best 2k tokens once the stateless masks drop theirs.
    top_ids, top_log_probs = masked_top(
        b, "top_ids", "top_log_probs", v("two_k_1d"), v("iteration")
    )
    w = b.node("Gather", [b.node("Shape", [top_ids]), one], "w")  # 2k
    n_1d, w_1d = b.reshape(n, [1], "n_1d"), b.reshape(w, [1], "w_1d")
    nw_1d = b.reshape(b.node("Mul", [n, w]), [1], "nw_1d")
    s_n_w = b.node("Concat", [v("sentences_1d"), n_1d, w_1d], "s_n_w", axis=0)
    s_nw = b.node("Concat", [v("sentences_1d"), nw_1d], "s_nw", axis=0)
    # Candidates: live beam scores plus each row's best tokens, in double.
    step_scores = b.reshape(b.cast(top_log_probs, DOUBLE), s_n_w)  # (S, n, 2k)
    row_scores = b.node("Slice", [v("alive_scores"), axis0, n_1d, axis1], "row_scores")  # (S, n)
    candidates = b.node("Add", [b.unsqueeze(row_scores, [2]), step_scores])
    candidates = b.reshape(candidates, s_nw, "candidates")  # (S, n * 2k)
    candidate_ids = b.reshape(top_ids, s_nw, "candidate_ids")
    ranked, ranked_at = b.node("TopK", [candidates, v("two_k_1d")], ["ranked", "ranked_at"], axis=1)
    # Each ranked candidate's own step score (its token's log-probability).
    ranked_step = b.node(
        "GatherElements", [b.reshape(step_scores, s_nw), ranked_at], "ranked_step", axis=1
    )
    ranked_beam = b.node("Div", [ranked_at, w], "ranked_beam")  # (S, 2k)
    ranked_token = b.node("GatherElements", [candidate_ids, ranked_at], "ranked_token", axis=1)
    finite = b.node("Greater", [ranked, neg_inf], "finite")
    is_eos = b.node("Equal", [ranked_token, eos], "is_eos")
    eos_finishes = b.node("And", [b.node("And", [is_eos, finite]), v("first_k")], "eos_finishes")
    continues = b.node("And", [b.node("Not", [is_eos]), finite], "continues")
    # The new beams: the first k continuing candidates, in rank order.
    slot_key = b.node("Where", [continues, v("positions"), v("positions_after")], "slot_key")
    slot_rank, slot_at = b.node(
        "TopK", [slot_key, v("k_1d")], ["slot_rank", "slot_at"], axis=1, largest=0
    )  # (S, k)
    slot_ok = b.node("Less", [slot_rank, v("two_k")], "slot_ok")
    slot_score = b.node("GatherElements", [ranked, slot_at], "slot_raw_score", axis=1)
    slot_score = b.node("Where", [slot_ok, slot_score, neg_inf], "slot_score")
    slot_beam = b.node("GatherElements", [ranked_beam, slot_at], "slot_raw_beam", axis=1)
    slot_beam = b.node("Where", [slot_ok, slot_beam, zero], "slot_beam")
    slot_token = b.node("GatherElements", [ranked_token, slot_at], "slot_token", axis=1)
    slot_step = b.node("GatherElements", [ranked_step, slot_at], "slot_step", axis=1)
    # Length penalties of this step and whether each sentence is out of room.
    made = b.node("Add", [v("iteration"), one], "made")
    at_limit = b.node("GreaterOrEqual", [made, "limits"], "at_limit")  # (S,)
    at_limit_2d = b.unsqueeze(at_limit, [1], "at_limit_2d")
    penalty = _length_penalty(b, made, "penalty")  # ()
    # Hypotheses finished at this step: EOS ones in rank order, then (at the
    # limit) the new beams; the best is the first of the highest.
    ranked_normalized = b.node("Div", [ranked, penalty], "ranked_normalized")
    eos_normalized = b.node("Where", [eos_finishes, ranked_normalized, neg_inf], "eos_normalized")
    limit_finishes = b.node("And", [slot_ok, at_limit_2d], "limit_finishes")
    slot_normalized = b.node("Div", [slot_score, penalty], "slot_normalized")
    limit_normalized = b.node(
        "Where", [limit_finishes, slot_normalized, neg_inf], "limit_normalized"
    )
    live = b.node("Not", [v("done")], "live")
    finish_scores = b.node("Concat", [eos_normalized, limit_normalized], axis=1)  # (S, 3k)
    finish_scores = b.node(
        "Where", [b.unsqueeze(live, [1]), finish_scores, neg_inf], "finish_scores"
    )
    finishes = b.node(
        "Concat", [b.cast(eos_finishes, INT64), b.cast(limit_finishes, INT64)], axis=1
    )  # (S, 2k + k)
    finished_now = b.node("ReduceSum", [finishes, axis1], "finished_now", keepdims=0)
    finished_counted = b.node("Where", [live, finished_now, zero], "finished_counted")
    count_next = b.node("Add", [v("count"), finished_counted], "count_next")
    # The n best of the kept ones and this step's, best first; among equal
    # scores the first found (the kept ones, then this step's in order).
    merged = b.node("Concat", [v("best_score"), finish_scores], "merged_scores", axis=1)
    n_best_1d = v("n_best_1d")
    best_score_next, chosen = b.node(
        "TopK", [merged, n_best_1d], ["best_score_next", "chosen"], axis=1
    )  # (S, n)
    chosen_3d = b.unsqueeze(chosen, [2], "chosen_3d")
    # A finished hypothesis's tokens: its beam's, plus the new token when it
    # finished at the limit (EOS is not kept); its steps, the last one's too.
    no_token = b.filled(b.node("Shape", [ranked_token]), -1, np.int64, "no_token")
    finish_beams = b.node("Concat", [ranked_beam, slot_beam], "finish_beams", axis=1)
    finish_last = b.node("Concat", [no_token, slot_token], "finish_last", axis=1)  # (S, 3k)
    first_rows = b.node("Mul", [v("sentence_index"), n], "first_rows")  # (S,)
    finish_rows = b.node("Add", [b.unsqueeze(first_rows, [1]), finish_beams], "finish_rows")
    finish_steps = b.node("Concat", [ranked_step, slot_step], "finish_steps", axis=1)
    # Each row's alignment weights at this step, `align_width` wide: (rows, W).
    ends, axis1_1d = v("align_width"), b.int64s([1])
    step_align = b.cast(ALIGNMENT_WEIGHTS, TensorProto.FLOAT, "step_align_weights")
    step_align = b.node("Slice", [step_align, b.int64s([0]), ends, axis1_1d], "step_align")
    finish_align = b.node("Gather", [step_align, finish_rows], "finish_align", axis=0)
    for kind, last, pad in (
        ("tokens", finish_last, "best_pad_column"),
        ("steps", finish_steps, "best_pad_step_column"),
        ("align", finish_align, "best_pad_align"),
    ):
        prefixes = b.node("Gather", [v(f"alive_{kind}"), finish_rows], axis=0)  # (S, 3k, t)
        new = b.node("Concat", [prefixes, b.unsqueeze(last, [2])], axis=2)  # (S, 3k, t + 1)
        kept = b.node("Concat", [v(f"best_{kind}"), v(pad)], axis=2)  # (S, n, t + 1)
        candidates = b.node("Concat", [kept, new], axis=1)
        b.node("GatherND", [candidates, chosen_3d], f"best_{kind}_next", batch_dims=1)
    appended = b.node("GreaterOrEqual", [finish_last, zero], "appended")
    finish_length = b.node("Add", [v("iteration"), b.cast(appended, INT64)], "finish_length")
    lengths = b.node("Concat", [v("best_length"), finish_length], "merged_lengths", axis=1)
    b.node("GatherElements", [lengths, chosen], "best_length_next", axis=1)
    # The bar a live beam must beat: the n-th best finished score.
    bar = b.node("Gather", [best_score_next, v("last_best")], "bar", axis=1)  # (S,)
    # Done: no live beam can win, or k finished and none wins at this length.
    top_slot = b.squeeze(b.node("Slice", [slot_score, axis0, axis1, axis1]), [1], "top_slot")
    top_live = b.node("Where", [at_limit, neg_inf, top_slot], "top_live")  # (S,)
    top_bound = b.node("Div", [top_live, v("limit_penalty")], "top_bound")
    hopeless = b.node("Not", [b.node("Greater", [top_bound, bar])], "hopeless")
    top_now = b.node("Div", [top_live, penalty], "top_now")
    none_better = b.node("LessOrEqual", [top_now, bar], "none_better")
    enough = b.node("GreaterOrEqual", [count_next, "beam_size"], "enough")
    settled = b.node("And", [enough, none_better])
    settled = b.node("And", [settled, v("gnmt_stop")], "settled")  # GNMT's form only
    stops = b.node("Or", [settled, hopeless], "stops")
    done_next = b.node("Or", [v("done"), stops], "done_next")
    b.any_true(b.node("Not", [done_next]), "keep_going")
    # The next state: the new beams, their tokens and their rows' caches.
    b.node("Where", [at_limit_2d, neg_inf, slot_score], "alive_scores_next")
    origin = b.node("Add", [b.unsqueeze(first_rows, [1]), slot_beam], "origin_2d")  # (S, k)
    origin = b.reshape(origin, [-1], "origin")  # (S * k,): the row each new beam extends
    alive_prefix = b.node("Gather", [v("alive_tokens"), origin], "alive_prefix", axis=0)
    slot_column = b.reshape(slot_token, [-1, 1], "slot_token_column")
    b.node("Concat", [alive_prefix, slot_column], "alive_tokens_next", axis=1)
    alive_steps = b.node("Gather", [v("alive_steps"), origin], "alive_prefix_steps", axis=0)
    slot_step_column = b.reshape(slot_step, [-1, 1], "slot_step_column")
    b.node("Concat", [alive_steps, slot_step_column], "alive_steps_next", axis=1)
    alive_align = b.node("Gather", [v("alive_align"), origin], "alive_prefix_align", axis=0)
    origin_align = b.node("Gather", [step_align, origin], "origin_align", axis=0)  # (S * k, W)
    b.node("Concat", [alive_align, b.unsqueeze(origin_align, [1])], "alive_align_next", axis=1)
    fed = b.node("Where", [slot_ok, slot_token, eos], "fed")
    b.reshape(b.cast(fed, TensorProto.INT32), [-1, 1], "token_ids_next")  # (S * k, 1)
    for name in self_names:
        b.node("Gather", [f"new_{name}", origin], f"next_{name}", axis=0)


# The loop's state: (name in the body, its next value, element type, first value).
def _carried_state(self_names, cache_type):
    from onnx import TensorProto

    DOUBLE, INT64 = TensorProto.DOUBLE, TensorProto.INT64
    carried = [
        ("token_ids", "token_ids_next", TensorProto.INT32, "first_token_ids"),
        ("alive_scores", "alive_scores_next", DOUBLE, "first_alive_scores"),
        ("alive_tokens", "alive_tokens_next", INT64, "no_tokens"),
        ("done", "done_next", TensorProto.BOOL, "first_done"),
        ("best_score", "best_score_next", DOUBLE, "first_best_scores"),
        ("best_tokens", "best_tokens_next", INT64, "no_best_tokens"),
        ("best_length", "best_length_next", INT64, "best_zeros"),
        ("count", "count_next", INT64, "zeros"),
        ("alive_steps", "alive_steps_next", DOUBLE, "no_steps"),
        ("best_steps", "best_steps_next", DOUBLE, "no_best_steps"),
        ("alive_align", "alive_align_next", TensorProto.FLOAT, "no_align"),
        ("best_align", "best_align_next", TensorProto.FLOAT, "no_best_align"),
    ]
    return carried + [(name, f"next_{name}", cache_type, "empty_cache") for name in self_names]


def _compacted(o, b, step_nodes, carried, sentence_inputs, input_types):
    """Makes the loop carry only the sentences not yet done (`sentence_ids`:
    their indices among the inputs'): the body's nodes read the live
    sentences' values where they read every sentence's, each step writes its
    sentences' best hypotheses into the outputs, and then the sentences done
    at this step leave the state with their beams. Returns the step's nodes
    (renamed), the carried state and the outputs' states."""
    from onnx import TensorProto

    DOUBLE, INT64 = TensorProto.DOUBLE, TensorProto.INT64
    v = b.name
    live_name = {name: v("live_" + name) for name in sentence_inputs}
    live_name.update(
        {
            "limits": v("live_limits"),
            v("sentences"): v("live_count"),
            v("sentences_1d"): v("live_count_1d"),
            v("sentence_index"): v("live_index"),
            v("limit_penalty"): v("live_limit_penalty"),
            v("best_pad_column"): v("live_best_pad_column"),
            v("best_pad_step_column"): v("live_best_pad_step_column"),
            v("best_pad_align"): v("live_best_pad_align"),
        }
    )
    step_nodes = copied_nodes(step_nodes, names=live_name)
    rules, b.nodes = copied_nodes(b.nodes, names=live_name), []
    sentence_ids = v("sentence_ids")
    b.node("Gather", ["limits", sentence_ids], "live_limits", axis=0)
    b.node("Gather", [v("limit_penalty"), sentence_ids], "live_limit_penalty", axis=0)
    live_count_1d = b.node("Shape", [sentence_ids], "live_count_1d")  # (1,): S'
    live_count = b.squeeze(live_count_1d, [0], "live_count")
    b.node("Range", [b.int64s(0), live_count, b.int64s(1)], "live_index")
    column_shape = b.node(
        "Concat", [live_count_1d, v("n_best_1d"), b.int64s([1])], "live_column_shape", axis=0
    )
    b.filled(column_shape, -1, np.int64, "live_best_pad_column")  # (S', n, 1)
    b.filled(column_shape, 0.0, np.float64, "live_best_pad_step_column")  # (S', n, 1)
    align_column = b.node("Concat", [column_shape, v("align_width")], "live_align_column", axis=0)
    b.filled(align_column, 0.0, np.float32, "live_best_pad_align")  # (S', n, 1, W)
    b.extend(rules)
    # Each step writes its sentences' best hypotheses into the outputs.
    at = b.unsqueeze(sentence_ids, [1], "live_at")  # (S', 1)
    for kind in ("score", "length"):
        b.node(
            "ScatterND", [v(f"result_{kind}"), at, v(f"best_{kind}_next")], f"result_{kind}_next"
        )
    for kind, pad in (
        ("tokens", "best_pad_column"),
        ("steps", "best_pad_step_column"),
        ("align", "best_pad_align"),
    ):
        grown = b.node("Concat", [v(f"result_{kind}"), v(pad)], axis=2)
        b.node("ScatterND", [grown, at, v(f"best_{kind}_next")], f"result_{kind}_next")
    # Then the sentences done at this step leave the state, with their beams.
    keep = b.node("Not", [v("done_next")], "keep")  # (S',)
    beams_shape = b.node("Concat", [live_count_1d, v("k_1d")], "live_beams_shape", axis=0)
    keep_beams = b.node("Expand", [b.unsqueeze(keep, [1]), beams_shape], "keep_beams")
    keep_rows = b.reshape(keep_beams, [-1], "keep_rows")  # (S' * k,)
    per_row = {"token_ids_next", "alive_tokens_next", "alive_steps_next", "alive_align_next"}
    per_row |= {n for _, n, *_ in carried if n.startswith("next_")}  # the caches
    for _, next_name, *_ in carried:
        b.keep_rows(
            keep_rows if next_name in per_row else keep, [v(next_name)], ["kept_" + next_name]
        )
    live_inputs = [live_name[name][len(v("")) :] for name in sentence_inputs]
    for name in ["sentence_ids", *live_inputs]:
        b.keep_rows(keep, [v(name)], ["kept_" + name])

    # The state starts with the sentences that have room for a token.
    has_room = o.node("Greater", ["limits", o.int64s(0)], "has_room")
    first_live = o.node("Compress", [o.name("sentence_index"), has_room], "first_live", axis=0)
    for initial in sorted({initial for *_, initial in carried}):
        o.node("Gather", [o.name(initial), first_live], "live_" + initial, axis=0)
    for name in sentence_inputs:
        o.node("Gather", [name, first_live], "live_first_" + name, axis=0)
    carried = [
        (name, "kept_" + next_name, elem_type, "live_" + initial)
        for name, next_name, elem_type, initial in carried
    ]
    carried += [("sentence_ids", "kept_sentence_ids", INT64, "first_live")]
    carried += [
        (live, "kept_" + live, input_types[name], "live_first_" + name)
        for name, live in zip(sentence_inputs, live_inputs, strict=True)
    ]
    carried += [
        ("result_score", "result_score_next", DOUBLE, "first_best_scores"),
        ("result_tokens", "result_tokens_next", INT64, "no_best_tokens"),
        ("result_length", "result_length_next", INT64, "best_zeros"),
        ("result_steps", "result_steps_next", DOUBLE, "no_best_steps"),
        ("result_align", "result_align_next", TensorProto.FLOAT, "no_best_align"),
    ]
    outputs = {"tokens": "result_tokens", "lengths": "result_length", "scores": "result_score"}
    outputs.update(token_scores="result_steps", **{ALIGNMENTS_OUTPUT: "result_align"})
    return step_nodes, carried, outputs


def _build(step, compact, blocked):
    from onnx import TensorProto

    if blocked:
        step = blocked_selection(step) or step
    graph = step.graph
    inputs, self_names, cross_names, heads, head_dim, cache_type = step_interface(step)
    DOUBLE, INT64 = TensorProto.DOUBLE, TensorProto.INT64
    o = GraphBuilder(PREFIX)
    _first_state(o, step, heads, head_dim, cache_type)
    b = o.body()
    _beam_step_rules(b, self_names)
    step_nodes = list(graph.node)
    carried = _carried_state(self_names, cache_type)
    outputs = {"tokens": "best_tokens", "lengths": "best_length", "scores": "best_score"}
    outputs.update(token_scores="best_steps", **{ALIGNMENTS_OUTPUT: "best_align"})
    if compact:
        sentence_inputs = ["source_mask", *cross_names]
        types = {name: inputs[name].type.tensor_type.elem_type for name in sentence_inputs}
        step_nodes, carried, outputs = _compacted(o, b, step_nodes, carried, sentence_inputs, types)

    value, v = o.value_info, o.name

    def body_name(name):
        return name if name == "token_ids" or name in self_names else v(name)

    body_inputs = [value(v("iteration"), INT64, []), value(v("condition"), TensorProto.BOOL, [])]
    body_inputs += [value(body_name(name), t) for name, _, t, _ in carried]
    body_outputs = [value(v("keep_going"), TensorProto.BOOL, [])]
    body_outputs += [value(v(name), t) for _, name, t, _ in carried]
    b.nodes = step_nodes + b.nodes
    body = b.graph("beam_step", body_inputs, body_outputs, graph.initializer)
    final = o.node(
        "Loop",
        [v("max_steps"), o.const("true", True, np.bool_)] + [v(c[3]) for c in carried],
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
        value("n_best", INT64, []),
        value(LENGTH_PENALTY_FORM_INPUT, INT64, []),
        value(ALIGNMENT_INPUT, TensorProto.BOOL, []),
        *mask_input_values(o),
        *shortlist_input_values(step),
    ]
    outer_outputs = [
        value("tokens", INT64, ["sentences", "n_best", "steps"]),
        value("lengths", INT64, ["sentences", "n_best"]),
        value("scores", DOUBLE, ["sentences", "n_best"]),
        value("token_scores", DOUBLE, ["sentences", "n_best", "steps"]),
        value(ALIGNMENTS_OUTPUT, TensorProto.FLOAT, ["sentences", "n_best", "steps", "width"]),
    ]
    return o.model("beam_search", outer_inputs, outer_outputs, like=step)
