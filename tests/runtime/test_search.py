"""The one batched search loop (`keras_transformer_runtime.search`) on a toy decoder,
checked against the one-sentence specification (`keras_transformer_runtime.spec`)."""

import zlib

import numpy as np
import pytest
from keras_transformer_runtime import spec
from keras_transformer_runtime.options import SearchOptions
from keras_transformer_runtime.search import search_loop
from keras_transformer_runtime.sources import source_array
from keras_transformer_runtime.spec import banned_ids
from keras_transformer_runtime.specials import BOS_ID, EOS_ID

VOCAB = 12


def _log_probs(sentence, prefix, ties=False):
    """Deterministic next-token log-probabilities of a prefix; EOS likelier as it grows.

    With `ties`, the logits are whole numbers, so candidates often score the same.
    """
    seed = zlib.crc32(np.asarray([sentence, *prefix], np.int64).tobytes())
    logits = np.random.default_rng(seed).normal(size=VOCAB).astype(np.float32) * 2
    if ties:
        logits = np.round(logits)
    logits[EOS_ID] += 0.4 * len(prefix) - 1.5
    return logits - np.log(np.exp(logits).sum())


def selection(log_probs, width):
    """Each row's `width` best tokens but padding and BOS, best first, ties to the
    lower id: `(values, ids)`, as the ONNX decoder step selects them."""
    allowed = np.array(log_probs, np.float64)
    allowed[:, banned_ids()] = -np.inf
    ids = np.lexsort((np.broadcast_to(np.arange(VOCAB), allowed.shape), -allowed), axis=-1)
    ids = ids[:, : min(width, VOCAB - len(banned_ids()))]
    return np.take_along_axis(log_probs, ids, axis=-1), ids


class ToyDecoder:
    """A decoder state of prefixes, one per row, reordered like a KV cache.

    With `widest`, its step also selects (`search_loop(selects=True)`): at most
    `widest` tokens per row, whatever the loop asks for.
    """

    def __init__(self, batch, beam_size, ties=False, widest=None):
        self.ties, self.widest = ties, widest
        self.sentences = np.repeat(np.arange(batch), beam_size)
        self.prefixes = [[] for _ in self.sentences]
        self.batch_sizes = []

    def step(self, last, t, top_k=0):
        assert len(last) == len(self.prefixes)
        self.batch_sizes.append(len(last))
        self.prefixes = [p + [int(token)] for p, token in zip(self.prefixes, last, strict=True)]
        log_probs = np.stack(
            [
                _log_probs(s, p[1:], self.ties)
                for s, p in zip(self.sentences, self.prefixes, strict=True)
            ]
        )
        if not top_k:
            return log_probs
        return log_probs, selection(log_probs, min(top_k, self.widest))

    def reorder(self, rows):
        self.sentences = self.sentences[rows]
        self.prefixes = [list(self.prefixes[r]) for r in rows]


def _search(limits, beam_size, drop_finished, alpha=0.6, ties=False, form="gnmt"):
    """The best `(tokens, scores)` of `search_loop` and the step's batch sizes."""
    decoder = ToyDecoder(len(limits), beam_size, ties)
    options = SearchOptions(beam_size, alpha, length_penalty_form=form)
    found = search_loop(decoder.step, decoder.reorder, limits, options, drop_finished=drop_finished)
    tokens = [h[0].tokens for h in found]
    return (tokens, np.array([h[0].score for h in found])), decoder.batch_sizes


@pytest.mark.parametrize("beam_size", [1, 3, 5])
def test_dropping_finished_sentences_changes_the_batch_not_the_results(beam_size):
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3])
    (tokens, scores), kept = _search(limits, beam_size, drop_finished=False)
    (dropped_tokens, dropped_scores), shrunk = _search(limits, beam_size, drop_finished=True)
    assert dropped_tokens == tokens
    np.testing.assert_array_equal(dropped_scores, scores)
    assert set(kept) == {len(limits) * beam_size}
    assert shrunk[0] == len(limits) * beam_size and shrunk[-1] < shrunk[0]
    assert sorted(shrunk, reverse=True) == shrunk
    assert tokens[1] == [] and scores[1] == 0.0  # an empty source
    for row, limit in zip(tokens, limits, strict=True):
        assert len(row) <= limit and BOS_ID not in row and EOS_ID not in row


def test_the_state_shrinks_only_once_enough_sentences_are_done():
    """Each shrink copies every cache: the loop drops finished sentences once more
    than `DROP_FRACTION` of those it holds are done, not at every one."""
    limits = np.array([1] + [12] * 9)  # one of ten done after the first step
    _, sizes = _search(limits, 2, drop_finished=True)
    assert sizes[:2] == [20, 20]  # 1 of 10 done: 10% is not enough to shrink
    limits = np.array([1, 1, 1] + [12] * 7)  # three of ten: 30%
    _, sizes = _search(limits, 2, drop_finished=True)
    assert sizes[:2] == [20, 14]


def test_beam_one_is_greedy_and_the_scores_are_the_toy_log_probs():
    limits = np.array([6, 10, 3, 8])
    decoder = ToyDecoder(len(limits), 1)
    found = search_loop(decoder.step, decoder.reorder, limits, SearchOptions(1))
    greedy_tokens = [h[0].tokens for h in found]
    greedy_scores = [h[0].score for h in found]
    (tokens, scores), _ = _search(limits, 1, drop_finished=True)
    assert tokens == greedy_tokens
    for s, row in enumerate(tokens):
        prefix, total = [], 0.0
        for token in [*row, EOS_ID][: limits[s]]:
            total += float(_log_probs(s, prefix)[token])
            prefix.append(token)
        assert greedy_scores[s] == pytest.approx(total, rel=1e-6)
        length = min(len(row) + 1, limits[s])
        assert scores[s] == pytest.approx(total, rel=1e-6)  # greedy scores are unpenalized
        beam_tokens, beam_score = spec.beam(lambda p, s=s: _log_probs(s, p), limits[s], 1, 0.6)
        assert beam_tokens == row
        assert beam_score == pytest.approx(total / ((5 + length) / 6) ** 0.6, rel=1e-6)


def test_wider_beams_never_score_worse_on_the_toy_decoder():
    limits = np.full(16, 10)
    narrow = [spec.beam(lambda p, s=s: _log_probs(s, p), 10, 1, 0.6)[1] for s in range(len(limits))]
    (_, wide), _ = _search(limits, 6, drop_finished=True)
    narrow = np.array(narrow)
    assert (wide >= narrow - 1e-9).mean() >= 0.9 and (wide > narrow + 1e-6).any()


@pytest.mark.parametrize("form", ["gnmt", "average"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("beam_size", [1, 3, 5])
def test_the_batched_search_is_the_plain_one_sentence_search(beam_size, alpha, ties, form):
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3, 6, 10])
    if beam_size == 1:
        expected = [
            spec.greedy(lambda prefix, s=s: _log_probs(s, prefix, ties), limit)
            for s, limit in enumerate(limits)
        ]
    else:
        expected = [
            spec.beam(
                lambda prefix, s=s: _log_probs(s, prefix, ties), limit, beam_size, alpha, form
            )
            for s, limit in enumerate(limits)
        ]
    for drop in (False, True):
        (tokens, scores), _ = _search(limits, beam_size, drop, alpha, ties, form)
        assert tokens == [e[0] for e in expected]
        np.testing.assert_allclose(scores, [e[1] for e in expected], rtol=1e-12)


def test_the_specification_scores_are_the_toy_log_probs():
    """The specification itself, on one sentence worked by hand: greedy sums the
    log-probabilities of what it picks (EOS included); a beam of one is greedy
    with its score divided by the length penalty."""
    limit = 10
    tokens, score = spec.greedy(lambda prefix: _log_probs(0, prefix), limit)
    prefix, total = [], 0.0
    for _ in range(limit):
        row = _log_probs(0, prefix).astype(np.float64)
        row[banned_ids()] = -np.inf
        token = int(row.argmax())
        total += row[token]
        if token == EOS_ID:
            break
        prefix.append(token)
    assert tokens == prefix and score == total
    beam_tokens, beam_score = spec.beam(lambda prefix: _log_probs(0, prefix), limit, 1, 0.6)
    length = min(len(tokens) + 1, limit)
    assert beam_tokens == tokens
    assert beam_score == pytest.approx(total / spec.length_penalty_factor(length, 0.6), rel=1e-12)
    assert spec.greedy(lambda prefix: _log_probs(0, prefix), 0) == ([], 0.0)
    assert spec.beam(lambda prefix: _log_probs(0, prefix), 0, 4) == ([], 0.0)


def test_source_array_pads_to_the_longest_row_rounded_to_the_multiple():
    rows = [[5, 6, 7], [], [8] * 10]
    for multiple, width in ((8, 16), (1, 10), (4, 12)):
        array, lengths = source_array(rows, model_max_length=128, multiple=multiple)
        assert array.shape == (3, width) and array.dtype == np.int32
        assert lengths.tolist() == [3, 0, 10]
        assert array[0, :3].tolist() == [5, 6, 7] and not array[0, 3:].any()
        assert not array[1].any() and array[2, :10].tolist() == [8] * 10
    # Never wider than the model's positions for a source that fits them.
    assert source_array([[5] * 12], model_max_length=12)[0].shape == (1, 12)


def searched_with_selections(limits, options, widths, **loop_options):
    """`search_loop`'s hypotheses on the tied toy decoder: at key None from whole
    rows, and at each of `widths` from a step selecting at most that many."""
    found = {}
    for widest in (None, *widths):
        decoder = ToyDecoder(len(limits), options.beam_size, ties=True, widest=widest)
        found[widest] = search_loop(
            decoder.step,
            decoder.reorder,
            limits,
            options,
            drop_finished=True,
            selects=widest is not None,
            **loop_options,
        )
    return found


@pytest.mark.parametrize("beam_size", [1, 2, 4])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"n_best": 2, "token_scores": True},
        {"length_penalty_form": "average"},
        {"min_length": 3},
    ],
)
def test_a_step_that_selects_gives_the_same_hypotheses(beam_size, options):
    """Where no option rescores a step, the searches read the decoder's selection
    (its best tokens) instead of choosing from whole rows: the same hypotheses,
    ties included, with prefixes (forced steps choose from the rows)."""
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3])
    prefixes = [[], [], [5], [], [], [3, 4], [], []]
    options = SearchOptions(beam_size, n_best=min(options.pop("n_best", 1), beam_size), **options)
    found = searched_with_selections(
        limits, options, (2 * beam_size, 3 * beam_size), prefixes=prefixes
    )
    assert found[2 * beam_size] == found[None] and found[3 * beam_size] == found[None]
    assert found[None][5][0].tokens[:2] == [3, 4]
