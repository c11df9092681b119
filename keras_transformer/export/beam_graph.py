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
  sort does), with the count of those finished; this booking runs inside an
  `If`, only at the steps where some hypothesis finishes (most steps have
  none: at batch 1 and beam 4 that measured 1.08-1.10x the whole search);
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
    step_alignment,
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
    steps compute only the sentences left; each step that books finished
    hypotheses writes the best ones of its sentences into the outputs. That
    costs a copy of the state at every step (`GraphBuilder.keep_rows`), which
    one sentence, the last of its batch, never needs: `build_beam_search`
    serves it. `blocked`: as in `build_beam_search`.
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
    o.filled(best_shape, 0, np.int64, "best_zeros")  # (S, n)
    # Alignments: each step's row is `align_width` wide, the source length when
    # the `alignment` input asks for them, else 0 (all their arrays are empty).
    source_len = o.node("Shape", ["source_mask"], "source_len_1d", start=1, end=2)
    width = o.node("Where", [ALIGNMENT_INPUT, source_len, o.int64s([0])], "align_width")
    no_align = o.node("Concat", [empty_shape, width], "no_align_shape", axis=0)
    o.filled(no_align, 0.0, np.float32, "no_align")  # (S, 0, W)
    no_best_align = o.node("Concat", [best_empty, width], "no_best_align_shape", axis=0)
    o.filled(no_best_align, 0.0, np.float32, "no_best_align")  # (S, n, 0, W)
    o.node("Sub", ["n_best", one], "last_best")  # the n-th best's index
    first_done = o.node("Equal", ["limits", zero], "first_done")  # an empty source
    # An empty source's one hypothesis (empty, score 0) is found at once.
    first_entry = o.unsqueeze(o.node("Equal", [o.node("Range", [zero, "n_best", one]), zero]), [0])
    first_found = o.node("And", [o.unsqueeze(first_done, [1]), first_entry], "first_found")
    o.node("Where", [first_found, zero_d, neg_inf], "first_best_scores")  # (S, n)
    o.filled(sentences_1d, 0, np.int64, "zeros")  # (S,)
    empty_cache(o, sentences_1d, heads, head_dim, cache_type)  # (S, N, 0, H)
    o.node("ReduceMax", ["limits"], "max_steps", keepdims=0)


def _beam_step_rules(b, self_names, float_type, write_results=None, reorder_caches=True):
    """`spec.beam`'s rules after one decoder step, in the loop body `b`.

    Reads the step's `top_ids` and `top_log_probs` ((rows, 2k), rows = S * n:
    n rows per sentence, 1 at the first step and k after) and the state;
    writes the next state (`*_next`) and `keep_going`. `float_type`: the
    element type of the step's log-probabilities. `write_results(f,
    booked, pads)`: more of what the booking of finished hypotheses changes
    (`_compacted`'s outputs), added to its branch `f`. Without
    `reorder_caches`, the caches' `next_*` are left to the caller (`_compacted`
    reorders and compacts them in one `Gather`).
    """
    from onnx import TensorProto

    DOUBLE = TensorProto.DOUBLE
    v = b.name  # a value made outside this function
    zero, one, axis0, axis1 = b.int64s(0), b.int64s(1), b.int64s([0]), b.int64s([1])
    neg_inf, eos = b.const("neg_inf", -np.inf, np.float64), b.int64s(EOS_ID)

    rows = b.node("Shape", ["token_ids"], "rows", start=0, end=1)  # (1,)
    n_1d = b.node("Div", [rows, v("sentences_1d")], "n_1d")  # rows per sentence: 1, then k
    # The step's best 2k tokens once the stateless masks drop theirs.
    top_ids, top_log_probs = masked_top(
        b, "top_ids", "top_log_probs", v("two_k_1d"), v("iteration"), float_type
    )
    s_n_w = b.node("Concat", [v("sentences_1d"), n_1d, v("two_k_1d")], "s_n_w", axis=0)
    s_nw = b.node("Concat", [v("sentences_1d"), b.int64s([-1])], "s_nw", axis=0)  # (S, n * 2k)
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
    ranked_beam = b.node("Div", [ranked_at, v("two_k")], "ranked_beam")  # (S, 2k)
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
    # limit) the new beams; a done sentence's do not count.
    live = b.node("Not", [v("done")], "live")
    limit_finishes = b.node("And", [slot_ok, at_limit_2d], "limit_finishes")
    finishing = b.node("Concat", [eos_finishes, limit_finishes], axis=1)  # (S, 2k + k)
    finishing = b.node("And", [finishing, b.unsqueeze(live, [1])], "finishing")
    first_rows = b.node("Mul", [v("sentence_index"), n_1d], "first_rows")  # (S,)
    # Each row's alignment weights at this step, `align_width` wide: (rows, W).
    step_align = step_alignment(b, ALIGNMENT_WEIGHTS, "step_align")
    # Booking them runs only at the steps where some finish (`GraphBuilder.when`).
    f = b.body()
    finish = dict(ranked=ranked, slot_score=slot_score, penalty=penalty, finishing=finishing)
    finish.update(ranked_token=ranked_token, ranked_beam=ranked_beam, ranked_step=ranked_step)
    finish.update(slot_token=slot_token, slot_beam=slot_beam, slot_step=slot_step)
    finish.update(first_rows=first_rows, step_align=step_align, made=made)
    booked, pads = _book_finished(f, **finish)
    changes = [
        (f"{kind}_next", name, v(kind), _tensor_type(_BOOKED[kind]))
        for kind, name in booked.items()
    ]
    if write_results is not None:
        changes += write_results(f, booked, pads)
    b.when(b.any_true(finishing, "any_finish"), f, changes)
    # The bar a live beam must beat: the n-th best finished score.
    bar = b.node("Gather", [v("best_score_next"), v("last_best")], "bar", axis=1)  # (S,)
    # Done: no live beam can win, or k finished and none wins at this length.
    top_slot = b.squeeze(b.node("Slice", [slot_score, axis0, axis1, axis1]), [1], "top_slot")
    top_live = b.node("Where", [at_limit, neg_inf, top_slot], "top_live")  # (S,)
    top_bound = b.node("Div", [top_live, v("limit_penalty")], "top_bound")
    hopeless = b.node("Not", [b.node("Greater", [top_bound, bar])], "hopeless")
    top_now = b.node("Div", [top_live, penalty], "top_now")
    none_better = b.node("LessOrEqual", [top_now, bar], "none_better")
    enough = b.node("GreaterOrEqual", [v("count_next"), "beam_size"], "enough")
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
    for name in self_names if reorder_caches else ():
        b.node("Gather", [f"new_{name}", origin], f"next_{name}", axis=0)


# What booking finished hypotheses changes, with its element types.
_BOOKED = {
    "best_score": np.float64,
    "best_tokens": np.int64,
    "best_steps": np.float64,
    "best_align": np.float32,
    "best_length": np.int64,
    "count": np.int64,
}
# The filler of the kinds whose arrays grow by a step: (constant name, value, type).
_FILLERS = {
    "tokens": ("no_token_id", -1, np.int64),
    "steps": ("zero_d", 0.0, np.float64),
    "align": ("zero_f", 0.0, np.float32),
}


def _tensor_type(dtype):
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _book_finished(f, finishing, penalty, made, first_rows, step_align, **found):
    """Books this step's finished hypotheses (`finishing` (S, 2k + k), the
    ranked EOS candidates', then at the limit the new beams') into the kept
    `n_best`, in the branch `f`. Returns `(the names f made, by the state each
    replaces; the pads that widen a kept (S, n, w) array of tokens or steps to
    this step's width, and an alignment array's)`.

    The kept arrays are as wide as they were at the last booking; each is
    padded to this step's width, then merged with the finished ones, the n
    best first (among equal scores the first found: the kept ones, then this
    step's in order)."""
    from onnx import TensorProto

    v = f.name
    neg_inf = f.const("neg_inf", -np.inf, np.float64)
    scores = f.node("Concat", [found["ranked"], found["slot_score"]], axis=1)  # (S, 3k)
    scores = f.node("Div", [scores, penalty])
    finish_scores = f.node("Where", [finishing, scores, neg_inf], "finish_scores")
    finished_now = f.cast(finishing, TensorProto.INT64)
    finished_now = f.node("ReduceSum", [finished_now, f.int64s([1])], keepdims=0)
    booked = {"count": f.node("Add", [v("count"), finished_now], "booked_count")}
    merged = f.node("Concat", [v("best_score"), finish_scores], "merged_scores", axis=1)
    best, chosen = f.node("TopK", [merged, v("n_best_1d")], ["booked_score", "chosen"], axis=1)
    booked["best_score"] = best  # (S, n)
    chosen_3d = f.unsqueeze(chosen, [2], "chosen_3d")
    # A finished hypothesis's tokens: its beam's, plus the new token when it
    # finished at the limit (EOS is not kept); its steps, the last one's too.
    no_token = f.filled(f.node("Shape", [found["ranked_token"]]), -1, np.int64, "no_token")
    finish_beams = f.node("Concat", [found["ranked_beam"], found["slot_beam"]], axis=1)
    last = {"tokens": f.node("Concat", [no_token, found["slot_token"]], axis=1)}  # (S, 3k)
    finish_rows = f.node("Add", [f.unsqueeze(first_rows, [1]), finish_beams], "finish_rows")
    last["steps"] = f.node("Concat", [found["ranked_step"], found["slot_step"]], axis=1)
    last["align"] = f.node("Gather", [step_align, finish_rows], "finish_align", axis=0)
    width = f.node("Shape", [v("best_tokens")], "kept_width", start=2, end=3)
    grow = f.node("Sub", [f.reshape(made, [1]), width], "grow")  # (1,)
    pads = {
        "tokens": f.node("Concat", [f.int64s([0] * 5), grow], "pads_3d", axis=0),
        "align": f.node("Concat", [f.int64s([0] * 6), grow, f.int64s([0])], "pads_4d", axis=0),
    }
    pads["steps"] = pads["tokens"]
    for kind in ("tokens", "steps", "align"):
        prefixes = f.node("Gather", [v(f"alive_{kind}"), finish_rows], axis=0)  # (S, 3k, t)
        new = f.node("Concat", [prefixes, f.unsqueeze(last[kind], [2])], axis=2)  # (S, 3k, t + 1)
        filler = f.const(*_FILLERS[kind])
        kept = f.node("Pad", [v(f"best_{kind}"), pads[kind], filler])  # (S, n, t + 1)
        candidates = f.node("Concat", [kept, new], axis=1)
        booked[f"best_{kind}"] = f.node(
            "GatherND", [candidates, chosen_3d], f"booked_{kind}", batch_dims=1
        )
    appended = f.node("GreaterOrEqual", [last["tokens"], f.int64s(0)], "appended")
    finish_length = f.node("Add", [v("iteration"), f.cast(appended, TensorProto.INT64)])
    lengths = f.node("Concat", [v("best_length"), finish_length], "merged_lengths", axis=1)
    booked["best_length"] = f.node("GatherElements", [lengths, chosen], "booked_length", axis=1)
    return booked, pads


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


def _write_results(f, booked, pads):
    """`_compacted`'s outputs where a step books finished hypotheses: its live
    sentences' (`sentence_ids`) best ones written at their rows, the arrays
    that grow by a step padded as the kept ones are (`_book_finished`); the
    `GraphBuilder.when` changes that make them."""
    v = f.name
    at = f.unsqueeze(v("sentence_ids"), [1], "live_at")  # (S', 1)
    changes = []
    for kind in ("score", "length", "tokens", "steps", "align"):
        result = v(f"result_{kind}")
        written = result
        if kind in pads:  # an array that grows by a step
            written = f.node("Pad", [result, pads[kind], f.const(*_FILLERS[kind])])
        made = f.node("ScatterND", [written, at, booked[f"best_{kind}"]])
        dtype = _tensor_type(_BOOKED[f"best_{kind}"])
        changes.append((f"result_{kind}_next", made, result, dtype))
    return changes


def _compacted(o, b, step_nodes, carried, sentence_inputs, input_types):
    """Makes the loop carry only the sentences not yet done (`sentence_ids`:
    their indices among the inputs'): the body's nodes read the live
    sentences' values where they read every sentence's (the rules were built
    with `_write_results`: a step that books finished hypotheses writes its
    sentences' best into the outputs), and then the sentences done at this
    step leave the state with their beams. Returns the step's nodes
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
        }
    )
    step_nodes = copied_nodes(step_nodes, names=live_name)
    # Each cache goes to the new beams and loses the done sentences' rows in one
    # `Gather`, by the kept rows' origins (below): one copy a step, not two.
    caches = [n for _, n, *_ in carried if n.startswith("next_")]
    rules, b.nodes = copied_nodes(b.nodes, names=live_name), []
    sentence_ids = v("sentence_ids")
    b.node("Gather", ["limits", sentence_ids], "live_limits", axis=0)
    b.node("Gather", [v("limit_penalty"), sentence_ids], "live_limit_penalty", axis=0)
    live_count_1d = b.node("Shape", [sentence_ids], "live_count_1d")  # (1,): S'
    live_count = b.squeeze(live_count_1d, [0], "live_count")
    b.node("Range", [b.int64s(0), live_count, b.int64s(1)], "live_index")
    b.extend(rules)
    # Then the sentences done at this step leave the state, with their beams.
    keep = b.node("Not", [v("done_next")], "keep")  # (S',)
    beams_shape = b.node("Concat", [live_count_1d, v("k_1d")], "live_beams_shape", axis=0)
    keep_beams = b.node("Expand", [b.unsqueeze(keep, [1]), beams_shape], "keep_beams")
    keep_rows = b.reshape(keep_beams, [-1], "keep_rows")  # (S' * k,)
    kept_origin = b.keep_rows(keep_rows, [v("origin")], ["kept_origin"])[0]
    for name in caches:  # `next_x`, the step's `new_x` reordered
        b.node("Gather", [name.replace("next_", "new_", 1), kept_origin], "kept_" + name, axis=0)
    per_row = {"token_ids_next", "alive_tokens_next", "alive_steps_next", "alive_align_next"}
    for _, next_name, *_ in carried:
        if next_name not in caches:
            kept = keep_rows if next_name in per_row else keep
            b.keep_rows(kept, [v(next_name)], ["kept_" + next_name])
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
    float_type = {v.name: v for v in graph.output}["top_log_probs"].type.tensor_type.elem_type
    _beam_step_rules(
        b, self_names, float_type, _write_results if compact else None, reorder_caches=not compact
    )
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
