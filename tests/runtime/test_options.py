"""The decoding options of the search specification (`keras_transformer_runtime.spec`):
each option against the plain search on a toy model, and the errors of bad options."""

import numpy as np
import pytest
from keras_transformer_runtime import spec
from keras_transformer_runtime.options import SearchOptions
from keras_transformer_runtime.search import search_loop
from keras_transformer_runtime.spec import SentenceSearch
from keras_transformer_runtime.specials import EOS_ID, UNK_ID

from tests.runtime.test_search import VOCAB, ToyDecoder, _log_probs

SENTENCES = range(24)


def _run(sentence, limit, ties=False, prefix=(), rng=None, **options):
    search = SentenceSearch(limit, SearchOptions(**options), prefix, rng)
    return search.run(lambda p: _log_probs(sentence, p, ties))


@pytest.mark.parametrize("ties", [False, True])
def test_plain_options_give_the_plain_searches(ties):
    for s in SENTENCES:
        view = lambda p, s=s: _log_probs(s, p, ties)  # noqa: E731
        for limit in (0, 1, 3, 9):
            best = _run(s, limit, ties, beam_size=1)[0]
            assert (best.tokens, best.score) == spec.greedy(view, limit)
            for k, alpha in ((2, 0.6), (4, 0.0)):
                best = _run(s, limit, ties, beam_size=k, length_penalty=alpha)[0]
                tokens, score = spec.beam(view, limit, k, alpha)
                assert best.tokens == tokens and best.score == pytest.approx(score, abs=1e-12)


def test_n_best_is_ordered_and_starts_with_the_plain_best():
    longer = 0
    for s in SENTENCES:
        tokens, score = spec.beam(lambda p, s=s: _log_probs(s, p), 10, 4)
        hypotheses = _run(s, 10, beam_size=4, n_best=4, token_scores=True)
        assert hypotheses[0].tokens == tokens and hypotheses[0].score == pytest.approx(score)
        scores = [h.score for h in hypotheses]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hypotheses}) == len(hypotheses)
        longer += len(hypotheses) > 1
        for h in hypotheses:  # token scores: the model's log-probabilities, summing to log_prob
            prefix, total = [], 0.0
            for token, step in zip([*h.tokens, EOS_ID], h.token_scores, strict=False):
                assert step == pytest.approx(_log_probs(s, prefix)[token])
                prefix, total = prefix + [token], total + step
            assert h.log_prob == pytest.approx(total)
    assert longer > len(SENTENCES) // 2


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_prefix_is_kept_and_decoding_continues_from_it(beam_size):
    prefix = [5, 9, 5]
    continued = 0
    for s in SENTENCES:
        best = _run(s, 12, prefix=prefix, beam_size=beam_size, token_scores=True)[0]
        assert best.tokens[:3] == prefix
        assert best.token_scores[:3] == pytest.approx(
            [_log_probs(s, prefix[:i])[prefix[i]] for i in range(3)]
        )
        continued += len(best.tokens) > 3
        if beam_size == 1:  # greedy from the prefix's state on
            rest = spec.greedy(lambda q, s=s: _log_probs(s, prefix + q), 12 - 3)
            assert best.tokens[3:] == rest[0]
            assert best.log_prob == pytest.approx(sum(best.token_scores[:3]) + rest[1])
    assert continued > len(SENTENCES) // 2


def test_suppressed_tokens_and_sequences_never_appear():
    plain = [_run(s, 12, beam_size=3)[0].tokens for s in SENTENCES]
    common = np.bincount(np.concatenate([t for t in plain if t]), minlength=VOCAB).argmax()
    pairs = {tuple(t[i : i + 2]) for t in plain for i in range(len(t) - 1)}
    pair = sorted(pairs)[0]
    changed = 0
    for s, before in zip(SENTENCES, plain, strict=True):
        for k in (1, 3):
            tokens = _run(s, 12, beam_size=k, suppress_sequences=[(int(common),), pair])[0].tokens
            assert int(common) not in tokens
            assert pair not in {tuple(tokens[i : i + 2]) for i in range(len(tokens) - 1)}
            changed += k == 3 and tokens != before
        assert UNK_ID not in _run(s, 12, beam_size=3, disable_unk=True)[0].tokens
    assert changed > 0


def test_min_length_no_repeat_ngrams_and_repetition_penalty():
    for s in SENTENCES:
        for k in (1, 3):
            assert len(_run(s, 12, beam_size=k, min_length=6)[0].tokens) >= 6
            tokens = _run(s, 12, beam_size=k, no_repeat_ngram_size=2)[0].tokens
            grams = [tuple(tokens[i : i + 2]) for i in range(len(tokens) - 1)]
            assert len(grams) == len(set(grams))
            assert len(set(_run(s, 12, beam_size=k, no_repeat_ngram_size=1)[0].tokens)) == len(
                _run(s, 12, beam_size=k, no_repeat_ngram_size=1)[0].tokens
            )
    repeats = [
        sum(len(t) - len(set(t)) for t in [_run(s, 12, beam_size=1, **extra)[0].tokens])
        for s in SENTENCES
        for extra in ({}, {"repetition_penalty": 3.0})
    ]
    assert sum(repeats[1::2]) < sum(repeats[::2])


def test_sampling_is_reproducible_with_a_seed_and_differs_across_seeds():
    def draw(seed, **options):
        return [
            _run(s, 12, beam_size=1, rng=spec.sentence_rng(seed, s), **options)[0].tokens
            for s in SENTENCES
        ]

    options = {"sampling_topk": 0, "sampling_temperature": 1.5}
    assert draw(3, **options) == draw(3, **options)
    assert draw(3, **options) != draw(4, **options)
    greedy = [_run(s, 12, beam_size=1)[0].tokens for s in SENTENCES]
    # top-p so small that only the best token is left: greedy search
    assert draw(5, sampling_topk=0, sampling_topp=1e-6) == greedy
    for s, tokens in zip(SENTENCES, draw(6, sampling_topk=2), strict=True):
        prefix = []
        for token in tokens:  # each drawn token is one of the two best allowed
            row = _log_probs(s, prefix)
            row[:2] = -np.inf
            assert token in np.argsort(-row)[:2]
            prefix.append(token)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"beam_size": 2, "n_best": 3}, "n_best must be at most beam_size"),
        ({"sampling_topk": 0, "sampling_topp": 0.0}, r"sampling_topp must be in \(0, 1\]"),
        ({"sampling_topk": 0, "sampling_topp": 1.5}, r"sampling_topp must be in \(0, 1\]"),
        ({"sampling_topp": 0.9}, "apply only when sampling"),
        ({"sampling_topk": 5}, "needs beam_size=1"),
        ({"beam_size": 0}, "beam_size must be a positive integer"),
        ({"min_length": 5, "max_length": 5}, "min_length must be less than max_length"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a positive number"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be a non-negative"),
        ({"sampling_topk": 0, "beam_size": 1, "sampling_temperature": 0}, "temperature"),
        ({"suppress_sequences": [()]}, "non-empty sequences"),
    ],
)
def test_bad_options_raise_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        SearchOptions(**options)


def test_bad_ids_are_named():
    with pytest.raises(ValueError, match="sentence 1 holds token id 99"):
        SearchOptions().check_ids(VOCAB, [[4], [5, 99]])
    with pytest.raises(ValueError, match="token id 12, outside the vocabulary"):
        SearchOptions(suppress_sequences=[(12,)]).check_ids(VOCAB)
    with pytest.raises(ValueError, match="leaves no room"):
        SentenceSearch(3, SearchOptions(), prefix=[4, 5, 6])


def test_plain_options_are_told_apart():
    assert SearchOptions().is_plain()
    assert SearchOptions(beam_size=1, length_penalty=0, max_length=9).is_plain()
    assert SearchOptions(max_input_length=20).is_plain()
    for extra in ({"n_best": 2}, {"token_scores": True}, {"disable_unk": True}, {"min_length": 1}):
        assert not SearchOptions(**extra).is_plain()
    assert spec.truncate_source([5, 6, 7, 8, EOS_ID], 3) == [5, 6, EOS_ID]
    assert spec.truncate_source([5, EOS_ID], 3) == [5, EOS_ID]


@pytest.mark.parametrize(
    "options",
    [
        {"beam_size": 3, "n_best": 3, "token_scores": True},
        {"beam_size": 1, "min_length": 4, "disable_unk": True},
        {"beam_size": 4, "no_repeat_ngram_size": 2, "repetition_penalty": 1.5},
        {"beam_size": 1, "sampling_topk": 0, "sampling_topp": 0.9, "seed": 7},
        {"beam_size": 2, "suppress_sequences": [(5,), (6, 7)], "length_penalty": 1.0},
    ],
)
@pytest.mark.parametrize("drop_finished", [False, True])
def test_the_batched_loop_gives_each_sentence_its_own_search(options, drop_finished):
    options = SearchOptions(**options)
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3])
    prefixes = [[], [], [4], [], [], [8, 8], [], []]
    indices = [10 + i for i in range(len(limits))]  # the seeds follow these, not the batch
    decoder = ToyDecoder(len(limits), options.beam_size)
    found = search_loop(
        decoder.step, decoder.reorder, limits, options, prefixes, indices, drop_finished
    )
    for s, (limit, prefix, index) in enumerate(zip(limits, prefixes, indices, strict=True)):
        rng = spec.sentence_rng(options.seed, index) if options.sampling else None
        search = SentenceSearch(limit, options, prefix, rng)
        assert found[s] == search.run(lambda p, s=s: _log_probs(s, p))
    if drop_finished:
        assert decoder.batch_sizes[-1] < decoder.batch_sizes[0]
