"""The batched numpy search loops (`keras_transformer_runtime.search`) on a toy decoder,
checked against the one-sentence specification (`keras_transformer_runtime.spec`)."""

import zlib

import numpy as np
import pytest
from keras_transformer_runtime import spec
from keras_transformer_runtime.search import (
    banned_ids,
    beam_loop,
    greedy_loop,
    source_array,
)
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


def _top(log_probs, width):
    """What the exported step graph returns: each row's best allowed tokens, best first."""
    allowed = log_probs.copy()
    allowed[:, banned_ids()] = -np.inf
    ids = np.argsort(-allowed, axis=1, kind="stable")[:, :width]
    return np.take_along_axis(allowed, ids, axis=1), ids


class ToyDecoder:
    """A decoder state of prefixes, one per row, reordered like a KV cache.

    With `top_k`, each step returns `(top_log_probs, top_ids)` of that width
    instead of the whole `log_probs`, as the ONNX step graph does.
    """

    def __init__(self, batch, beam_size, top_k=None, shared_first_step=False, ties=False):
        self.ties = ties
        self.sentences = np.repeat(np.arange(batch), 1 if shared_first_step else beam_size)
        self.prefixes = [[] for _ in self.sentences]
        self.batch_sizes = []
        self.top_k = top_k

    def step(self, last, t):
        assert len(last) == len(self.prefixes)
        self.batch_sizes.append(len(last))
        self.prefixes = [p + [int(token)] for p, token in zip(self.prefixes, last, strict=True)]
        log_probs = np.stack(
            [
                _log_probs(s, p[1:], self.ties)
                for s, p in zip(self.sentences, self.prefixes, strict=True)
            ]
        )
        return log_probs if self.top_k is None else _top(log_probs, self.top_k)

    def reorder(self, rows):
        self.sentences = self.sentences[rows]
        self.prefixes = [list(self.prefixes[r]) for r in rows]


def _beam(limits, beam_size, drop_finished, top_k=None, shared_first_step=False):
    decoder = ToyDecoder(len(limits), beam_size, top_k, shared_first_step)
    result = beam_loop(
        decoder.step,
        decoder.reorder,
        limits,
        beam_size,
        drop_finished=drop_finished,
        shared_first_step=shared_first_step,
    )
    return result, decoder.batch_sizes


@pytest.mark.parametrize("beam_size", [1, 3, 5])
def test_dropping_finished_sentences_changes_the_batch_not_the_results(beam_size):
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3])
    (tokens, scores), kept = _beam(limits, beam_size, drop_finished=False)
    (dropped_tokens, dropped_scores), shrunk = _beam(limits, beam_size, drop_finished=True)
    assert dropped_tokens == tokens
    np.testing.assert_array_equal(dropped_scores, scores)
    assert set(kept) == {len(limits) * beam_size}
    assert shrunk[0] == len(limits) * beam_size and shrunk[-1] < shrunk[0]
    assert sorted(shrunk, reverse=True) == shrunk
    assert tokens[1] == [] and scores[1] == 0.0  # an empty source
    for row, limit in zip(tokens, limits, strict=True):
        assert len(row) <= limit and BOS_ID not in row and EOS_ID not in row


@pytest.mark.parametrize("beam_size", [1, 3, 5])
@pytest.mark.parametrize("drop_finished", [False, True])
def test_a_shared_first_step_runs_one_row_per_sentence_with_the_same_results(
    beam_size, drop_finished
):
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3])
    (tokens, scores), kept = _beam(limits, beam_size, drop_finished=False)
    for top_k in (None, 2 * beam_size):
        (shared_tokens, shared_scores), sizes = _beam(
            limits, beam_size, drop_finished, top_k=top_k, shared_first_step=True
        )
        assert shared_tokens == tokens
        np.testing.assert_array_equal(shared_scores, scores)
        assert sizes[0] == len(limits)
        if drop_finished:
            assert all(a <= b for a, b in zip(sizes[1:], kept[1:], strict=False))
        else:
            assert sizes[1:] == kept[1:]


@pytest.mark.parametrize("beam_size", [1, 2, 4])
def test_a_step_that_selects_the_top_tokens_gives_the_same_search(beam_size):
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3])
    full_tokens, full_scores = _beam(limits, beam_size, drop_finished=True)[0]
    for width in (2 * beam_size, 2 * beam_size + 3):
        tokens, scores = _beam(limits, beam_size, drop_finished=True, top_k=width)[0]
        assert tokens == full_tokens
        np.testing.assert_array_equal(scores, full_scores)

    def step(inputs, t):
        return np.stack([_log_probs(s, list(row[1:])) for s, row in enumerate(inputs)])

    greedy = greedy_loop(step, limits)
    chosen = greedy_loop(lambda inputs, t: _top(step(inputs, t), 1), limits)
    assert chosen[0] == greedy[0]
    np.testing.assert_array_equal(chosen[1], greedy[1])
    with pytest.raises(ValueError, match="ignore_eos"):
        greedy_loop(lambda inputs, t: _top(step(inputs, t), 1), limits, ignore_eos=True)


def test_beam_one_is_greedy_and_the_scores_are_the_toy_log_probs():
    limits = np.array([6, 10, 3, 8])

    def step(inputs, t):
        return np.stack([_log_probs(s, list(row[1:])) for s, row in enumerate(inputs)])

    greedy_tokens, greedy_scores = greedy_loop(step, limits)
    (tokens, scores), _ = _beam(limits, 1, drop_finished=True)
    assert tokens == greedy_tokens
    for s, row in enumerate(tokens):
        prefix, total = [], 0.0
        for token in [*row, EOS_ID][: limits[s]]:
            total += float(_log_probs(s, prefix)[token])
            prefix.append(token)
        assert greedy_scores[s] == pytest.approx(total, rel=1e-6)
        length = min(len(row) + 1, limits[s])
        assert scores[s] == pytest.approx(total / ((5 + length) / 6) ** 0.6, rel=1e-6)


def test_wider_beams_never_score_worse_on_the_toy_decoder():
    limits = np.full(16, 10)
    (_, narrow), _ = _beam(limits, 1, drop_finished=True)
    (_, wide), _ = _beam(limits, 6, drop_finished=True)
    assert (wide >= narrow - 1e-9).mean() >= 0.9 and (wide > narrow + 1e-6).any()


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("beam_size", [1, 3, 5])
def test_the_batched_beam_search_is_the_plain_one_sentence_search(beam_size, alpha, ties):
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3, 6, 10])
    expected = [
        spec.beam(lambda prefix, s=s: _log_probs(s, prefix, ties), limit, beam_size, alpha)
        for s, limit in enumerate(limits)
    ]
    for top_k, shared, drop in ((None, False, False), (2 * beam_size, True, True)):
        decoder = ToyDecoder(len(limits), beam_size, top_k, shared, ties)
        tokens, scores = beam_loop(
            decoder.step,
            decoder.reorder,
            limits,
            beam_size,
            alpha,
            drop_finished=drop,
            shared_first_step=shared,
        )
        assert tokens == [e[0] for e in expected]
        np.testing.assert_allclose(scores, [e[1] for e in expected], rtol=1e-12)


@pytest.mark.parametrize("ties", [False, True])
def test_the_batched_greedy_search_is_the_plain_one_sentence_search(ties):
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3, 6, 10])
    expected = [
        spec.greedy(lambda prefix, s=s: _log_probs(s, prefix, ties), limit)
        for s, limit in enumerate(limits)
    ]

    def step(inputs, t):
        return np.stack([_log_probs(s, list(row[1:]), ties) for s, row in enumerate(inputs)])

    for chooses in (False, True):  # whole log_probs, or the step's own best token
        tokens, scores = greedy_loop(
            (lambda inputs, t: _top(step(inputs, t), 1)) if chooses else step, limits
        )
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
