"""Terminology constraints (`keras_transformer_runtime.constraints`) on the toy decoder
of the search tests: the rules, the batched search (`search.search_loop`) against
the one-sentence one, other options beside constraints, and the constraints file."""

import json

import numpy as np
import pytest
from keras_transformer_runtime import spec
from keras_transformer_runtime.constrained_search import ConstrainedSearch, constrained_beam
from keras_transformer_runtime.constraints import (
    Constraints,
    encode_constraints,
    read_constraints_file,
)
from keras_transformer_runtime.options import SearchOptions
from keras_transformer_runtime.search import search_loop
from keras_transformer_runtime.spec import SentenceSearch
from keras_transformer_runtime.specials import BOS_ID, EOS_ID, UNK_ID

from tests.runtime.test_search import VOCAB, ToyDecoder, _log_probs, searched_with_selections


def _contains(tokens, phrase):
    n = len(phrase)
    return any(list(tokens[i : i + n]) == list(phrase) for i in range(len(tokens) - n + 1))


def _loop(limits, beam_size, constraints, alpha=0.6, **options):
    """`search_loop` over the toy decoder: `((best tokens, best scores), step batch sizes)`."""
    decoder = ToyDecoder(len(limits), beam_size)
    found = search_loop(
        decoder.step,
        decoder.reorder,
        limits,
        SearchOptions(beam_size=beam_size, length_penalty=alpha, **options),
        drop_finished=True,
        constraints=constraints,
    )
    tokens = [hypotheses[0].tokens for hypotheses in found]
    return (tokens, np.array([h[0].score for h in found])), decoder.batch_sizes


def test_progress_restarts_a_phrase_and_finds_overlapping_matches():
    rules = Constraints([[5, 5, 6], [7]])
    progress = rules.start()
    for token, expected in ((5, (1, 0)), (5, (2, 0)), (5, (2, 0)), (4, (0, 0)), (5, (1, 0))):
        progress = rules.advance(progress, token)
        assert progress == expected
    assert rules.next_tokens(progress) == [5, 7]
    for token in (5, 6):
        progress = rules.advance(progress, token)
    assert progress == (3, 0) and rules.met_tokens(progress) == 3 and not rules.all_met(progress)
    progress = rules.advance(rules.advance(progress, 9), 7)
    assert progress == (3, 1) and rules.all_met(progress) and rules.next_tokens(progress) == []
    assert rules.found_in([4, 5, 5, 5, 6, 7]) and not rules.found_in([5, 6, 5, 7])
    # The partial match of an unmet phrase counts once: the longest.
    rules = Constraints([[4, 5, 6], [4, 5, 8, 9]])
    assert rules.met_tokens(rules.advance(rules.advance(rules.start(), 4), 5)) == 2


@pytest.mark.parametrize("beam_size", [1, 2, 3, 5])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_without_constraints_it_is_plain_beam_search(beam_size, alpha):
    limits = np.array([9, 0, 4, 12, 1, 7, 12, 3, 6, 10])
    expected = [
        spec.beam(lambda prefix, s=s: _log_probs(s, prefix), limit, beam_size, alpha)
        for s, limit in enumerate(limits)
    ]
    for s, limit in enumerate(limits):
        single = constrained_beam(
            lambda prefix, s=s: _log_probs(s, prefix), limit, beam_size, [], alpha
        )
        assert single[0] == expected[s][0]
        assert single[1] == pytest.approx(expected[s][1], rel=1e-12)


# Per sentence: phrases the toy decoder rarely produces on its own, some multi-token,
# one repeating a token, two sharing a first token.
PHRASES = [
    [[7, 8, 9]],
    [[4], [11, 10]],
    [],
    [[5, 5, 6], [3, 9]],
    [[10, 4, 6, 8]],
    [[6, 7], [6, 11], [9]],
    [[8]],
    [[11, 11, 11]],
]


@pytest.mark.parametrize("beam_size", [1, 2, 4, 6])
def test_constraints_appear_whenever_they_fit(beam_size):
    limits = np.array([12, 9, 6, 14, 5, 8, 2, 4])
    (tokens, scores), sizes = _loop(limits, beam_size, PHRASES)
    plain = [
        spec.beam(lambda prefix, s=s: _log_probs(s, prefix), limit, beam_size)[0]
        for s, limit in enumerate(limits)
    ]
    for row, phrases, limit, unconstrained in zip(tokens, PHRASES, limits, plain, strict=True):
        assert len(row) <= limit and BOS_ID not in row and EOS_ID not in row
        for phrase in phrases:
            assert _contains(row, phrase), (row, phrase)
        if not phrases:
            assert row == unconstrained
    # The constraints are informative: the plain search misses most of them.
    missed = sum(not _contains(row, p) for row, ps in zip(plain, PHRASES, strict=True) for p in ps)
    assert missed >= 8
    assert np.isfinite(scores).all()
    assert sizes[0] == len(limits) * beam_size and sizes[-1] < sizes[0]  # finished ones leave


@pytest.mark.parametrize("beam_size", [1, 3, 5])
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_the_batched_search_is_the_one_sentence_search(beam_size, alpha):
    limits = np.array([12, 9, 6, 14, 5, 8, 2, 4, 0, 11])
    phrases = [*PHRASES, [[4]], [[9, 9], [4, 6]]]
    options = SearchOptions(beam_size=beam_size, length_penalty=alpha)
    expected = []
    for s, (limit, p) in enumerate(zip(limits, phrases, strict=True)):
        # A sentence without phrases runs the options' plain search.
        search = ConstrainedSearch(limit, options, p) if p else SentenceSearch(limit, options)
        best = search.run(lambda prefix, s=s: _log_probs(s, prefix))[0]
        expected.append((best.tokens, best.score))
    (tokens, scores), _ = _loop(limits, beam_size, phrases, alpha)
    assert tokens == [e[0] for e in expected]
    np.testing.assert_allclose(scores, [e[1] for e in expected], rtol=1e-12)
    assert tokens[8] == [] and scores[8] == 0.0  # an empty source


def test_the_score_is_the_length_penalized_sum_of_the_step_log_probs():
    limit, phrases = 12, [[7, 8, 9], [4]]
    tokens, score = constrained_beam(lambda prefix: _log_probs(0, prefix), limit, 3, phrases)
    prefix, total = [], 0.0
    for token in [*tokens, EOS_ID][:limit]:
        total += float(_log_probs(0, prefix)[token])
        prefix.append(token)
    length = min(len(tokens) + 1, limit)
    assert score == pytest.approx(total / spec.length_penalty_factor(length, 0.6), rel=1e-9)


def test_a_constraint_does_not_need_the_whole_beam():
    """Dynamic beam allocation: with a constraint, the other beams still search
    freely, so a wider beam finds translations at least as good."""
    limits = np.full(12, 10)
    phrases = [[[4 + s % 8]] for s in range(12)]
    (_, narrow), _ = _loop(limits, 1, phrases)
    (tokens, wide), _ = _loop(limits, 6, phrases)
    assert all(_contains(row, p[0]) for row, p in zip(tokens, phrases, strict=True))
    assert (wide >= narrow - 1e-9).mean() >= 0.9 and (wide > narrow + 1e-6).any()


def test_constraints_that_cannot_fit_are_refused():
    with pytest.raises(ValueError, match=r"need 5 tokens \(3 \+ 2\).*at most 5 tokens"):
        constrained_beam(lambda prefix: _log_probs(0, prefix), 5, 2, [[4, 5, 6], [7, 8]])
    with pytest.raises(ValueError, match="need 3 tokens"):
        _loop(np.array([6, 3]), 2, [[], [[4, 5, 6]]])
    with pytest.raises(ValueError, match="1 constraint lists for 2 sentences"):
        _loop(np.array([6, 3]), 2, [[]])
    with pytest.raises(ValueError, match="need a search, not sampling"):
        ConstrainedSearch(6, SearchOptions(beam_size=1, sampling_topk=0), [[4]])
    with pytest.raises(ValueError, match="padding, BOS or EOS"):
        Constraints([[4, EOS_ID]])
    with pytest.raises(ValueError, match="at least one token"):
        Constraints([[]])


def _met(rules, tokens):
    progress = rules.start()
    for token in tokens:
        progress = rules.advance(progress, token)
    return rules.met_tokens(progress)


def test_constraints_with_a_prefix_n_best_and_suppressed_tokens():
    """Constraints are one more rule of the options' search: a prefix is forced
    first, a suppressed token stays out, and the n best are ranked by the
    fallback rule: the most met tokens, then the best score (the first holds
    every phrase)."""
    limits = np.array([12, 10, 14])
    phrases = [[[7, 8]], [[4], [9, 10]], [[11]]]
    decoder = ToyDecoder(len(limits), 4)
    options = SearchOptions(beam_size=4, n_best=3, suppress_sequences=[[6]], token_scores=True)
    found = search_loop(
        decoder.step,
        decoder.reorder,
        limits,
        options,
        prefixes=[[5], [], [3, 4]],
        constraints=phrases,
    )
    for s, (hypotheses, entry) in enumerate(zip(found, phrases, strict=True)):
        assert len(hypotheses) == 3
        rules = Constraints(entry)
        assert rules.found_in(hypotheses[0].tokens)
        keys = [(_met(rules, h.tokens), h.score) for h in hypotheses]
        assert keys == sorted(keys, reverse=True)
        for h in hypotheses:
            assert 6 not in h.tokens
            assert h.tokens[: [1, 0, 2][s]] == [[5], [], [3, 4]][s]
            assert sum(h.token_scores) == pytest.approx(h.log_prob, rel=1e-12)
        single = ConstrainedSearch(limits[s], options, entry, [[5], [], [3, 4]][s]).run(
            lambda prefix, s=s: _log_probs(s, prefix)
        )
        assert [h.tokens for h in single] == [h.tokens for h in hypotheses]


def _as_words(tokens, phrase, continuations):
    """Whether `phrase` occurs in `tokens` with no continuation token after it."""
    n = len(phrase)
    return any(
        list(tokens[i : i + n]) == list(phrase)
        and (i + n == len(tokens) or tokens[i + n] not in continuations)
        for i in range(len(tokens) - n + 1)
    )


def test_a_phrase_stands_as_whole_words():
    """With continuation tokens (pieces that extend the word before them), none
    follows a phrase's last token; without, the toy decoder often puts one there."""
    continuations = {3, 9, 10, 11}
    limits = np.full(24, 10)
    phrases = [[[4 + s % 5]] if s % 2 else [[5 + s % 4, 4 + s % 3]] for s in range(24)]
    (free, _), _ = _loop(limits, 3, [Constraints(p) for p in phrases])
    rules = [Constraints(p, continuations) for p in phrases]
    (tokens, _), _ = _loop(limits, 3, rules)
    for row, entry, loose in zip(tokens, phrases, free, strict=True):
        assert all(_as_words(row, p, continuations) for p in entry), (row, entry)
        assert all(_contains(loose, p) for p in entry)
    attached = sum(
        not _as_words(row, p, continuations)
        for row, entry in zip(free, phrases, strict=True)
        for p in entry
    )
    assert attached >= 2


class _Words:
    """A whitespace tokenizer over a fixed word list (ids from 4)."""

    words = ["a", "dog", "runs", "big", "red"]

    def encode(self, text):
        return [self.words.index(w) + 4 if w in self.words else UNK_ID for w in text.split()]


def test_phrases_are_tokenized_and_bad_ones_named():
    constraints = encode_constraints(["big dog", "runs"], _Words().encode, max_tokens=5)
    assert constraints.phrases == [(7, 5), (6,)]
    cases = [
        (["  "], "'  ' of line 3 tokenizes to nothing"),
        (["big cat"], "'big cat' of line 3 .*unknown token"),
        (["a dog runs big red dog"], "is 6 tokens, longer than the 5"),
        (["big dog red", "runs a dog"], "need 6 tokens"),
        ("big dog", "must be a list of strings"),
        ([3], "not a string"),
    ]
    for phrases, message in cases:
        with pytest.raises(ValueError, match=message):
            encode_constraints(phrases, _Words().encode, max_tokens=5, where="line 3")


def test_constraints_files_tab_separated_and_jsonl(tmp_path):
    tsv = tmp_path / "terms.tsv"
    tsv.write_text("big dog\truns\n\nred\r\n", encoding="utf-8")
    assert read_constraints_file(tsv, 3) == [["big dog", "runs"], [], ["red"]]
    jsonl = tmp_path / "terms.jsonl"
    jsonl.write_text('["big dog", "runs"]\n[]\n\n["a\\tb"]\n', encoding="utf-8")
    assert read_constraints_file(jsonl) == [["big dog", "runs"], [], [], ["a\tb"]]
    bad = [
        ("x.tsv", "ok\nbig\t\tdog\n", "x.tsv line 2: phrase 2 is empty"),
        ("x.jsonl", '["ok"]\n{"a": 1}\n', "x.jsonl line 2 must be a JSON list of strings"),
        ("x.jsonl", '["ok"]\n["a", 3]\n', "line 2 must be a JSON list of strings"),
        ("x.jsonl", '["ok"]\n["a"\n', "x.jsonl line 2 is not JSON"),
        ("x.tsv", "ok\n", "has 1 lines, the input 2"),
    ]
    for name, text, message in bad:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=message):
            read_constraints_file(path, 2)
    path = tmp_path / "latin1.tsv"
    path.write_bytes(json.dumps("x").encode() + b"\nGr\xfc\xdfe\n")
    with pytest.raises(ValueError, match="line 2 is not UTF-8"):
        read_constraints_file(path, 2)
    assert VOCAB == 12  # the phrases above are ids of the toy decoder's vocabulary


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_step_that_selects_gives_the_same_constrained_hypotheses(beam_size):
    """The constrained search reads the decoder's selection where no option
    rescores a step. A hypothesis that just ended a phrase takes its best tokens
    that continue no word: from the selection when it holds enough of them,
    else from its whole row (the narrow selection here). The same hypotheses
    either way, ties included, and with sentences forcing a prefix (their
    rows rescored) in the same batch step as sentences reading the selection."""
    limits = np.array([9, 0, 12, 12, 7, 10, 11])
    phrases = [[[4]], [], [[5, 5, 6], [7]], [[9, 10]], [[3], [8]], [], [[4, 8]]]
    prefixes = [[], [], [3], [], [], [], [9, 9]]
    continuations = [5, 6, 7, 10, 11]
    rules = [Constraints(entry, continuations) for entry in phrases]
    options = SearchOptions(beam_size=beam_size, n_best=beam_size, token_scores=True)
    found = searched_with_selections(
        limits, options, (2 * beam_size, 4 * beam_size), prefixes=prefixes, constraints=rules
    )
    assert found[2 * beam_size] == found[None] and found[4 * beam_size] == found[None]
    assert found[None][6][0].tokens[:2] == [9, 9]
    for hypotheses, entry in zip(found[None], rules, strict=True):
        assert entry.found_in(hypotheses[0].tokens)
