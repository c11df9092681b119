import logging
import os

import keras
import numpy as np
import pytest
from keras import ops
from keras_transformer_runtime import spec
from keras_transformer_runtime.specials import BOS_ID

from keras_transformer import TransformerConfig, build_transformer, transformer_parts
from keras_transformer.data.toy import generate_toy_corpus
from keras_transformer.decoding import (
    EXTRA_OUTPUT_TOKENS,
    beam_search,
    greedy_search,
    length_penalty_factor,
    sequence_log_probs,
)

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax


@pytest.fixture(scope="module")
def random_model():
    keras.utils.set_random_seed(7)
    return build_transformer(TransformerConfig.from_preset("tiny", max_length=40))


def default_limit(model, source):
    """The default output limit: source length + 50, capped by the model's max_length
    or twice the source length, whichever is larger."""
    cap = max(transformer_parts(model).config.max_length, 2 * len(source))
    return min(len(source) + EXTRA_OUTPUT_TOKENS, cap)


def random_sources(count, seed=0, vocabulary_size=64, longest=15):
    rng = np.random.default_rng(seed)
    return [
        [int(i) for i in rng.integers(3, vocabulary_size, size=rng.integers(1, longest + 1))]
        for _ in range(count)
    ]


def toy_sources(toy_run, count=200, seed=5):
    model, corpus, vocabulary, _ = toy_run
    held_out = generate_toy_corpus(
        num_train=0, num_valid=0, num_test=count, max_words=8, seed=seed
    ).test
    known = {s for s, _ in corpus.train}
    sources = [vocabulary.encode(s) + [vocabulary.eos_id] for s, _ in held_out if s not in known]
    assert len(sources) >= 0.9 * count
    return model, sources


def test_cached_greedy_equals_uncached_on_random_model(random_model):
    sources = random_sources(200)
    cached, cached_scores = greedy_search(random_model, sources, max_length=20)
    uncached, uncached_scores = greedy_search(random_model, sources, max_length=20, use_cache=False)
    assert cached == uncached
    np.testing.assert_allclose(cached_scores, uncached_scores, atol=1e-4)


def test_cached_greedy_equals_uncached_on_trained_model(toy_run):
    model, sources = toy_sources(toy_run, 220)
    cached, _ = greedy_search(model, sources)
    uncached, _ = greedy_search(model, sources, use_cache=False)
    assert len(cached) >= 200 and cached == uncached
    # Trained outputs end with EOS well before the length limit.
    ended = [len(c) < default_limit(model, s) for c, s in zip(cached, sources, strict=True)]
    assert np.mean(ended) > 0.75


def test_greedy_scores_are_model_log_probs(toy_run):
    model, sources = toy_sources(toy_run, 40)
    tokens, scores = greedy_search(model, sources)
    ended = [len(t) < default_limit(model, s) for t, s in zip(tokens, sources, strict=True)]
    np.testing.assert_allclose(
        scores, sequence_log_probs(model, sources, tokens, ended=ended), atol=1e-4
    )


@pytest.mark.parametrize(
    "which", ["random", pytest.param("trained", marks=pytest.mark.integration)]
)
def test_beam_size_one_equals_greedy(which, random_model, request):
    if which == "random":
        model, sources = random_model, random_sources(60, seed=1)
    else:  # the trained model only when needed: it is trained on first use
        model, sources = toy_sources(request.getfixturevalue("toy_run"), 60)
    assert (
        beam_search(model, sources, beam_size=1, max_length=20)[0]
        == (greedy_search(model, sources, max_length=20)[0])
    )


@pytest.mark.parametrize(
    "which,alpha",
    [
        pytest.param("trained", 0.6, marks=pytest.mark.integration),
        ("random", 0.6),
        pytest.param("trained", 1.0, marks=pytest.mark.integration),
    ],
)
def test_beam_scores_are_length_penalized_model_log_probs(which, alpha, random_model, request):
    if which == "random":
        model, sources, limit = random_model, random_sources(30, seed=2), 12
    else:
        (model, sources), limit = toy_sources(request.getfixturevalue("toy_run"), 40), None
    tokens, scores = beam_search(
        model, sources, beam_size=4, length_penalty=alpha, max_length=limit
    )
    limits = [limit or default_limit(model, s) for s in sources]
    ended = [len(t) < n for t, n in zip(tokens, limits, strict=True)]
    log_probs = sequence_log_probs(model, sources, tokens, ended=ended)
    lengths = np.array([len(t) + e for t, e in zip(tokens, ended, strict=True)])
    np.testing.assert_allclose(scores, log_probs / length_penalty_factor(lengths, alpha), atol=1e-4)


def model_log_probs(model, source, width=16):
    """`log_probs(prefix)` of the whole (uncached) model for one source: the model
    as the search specification (`keras_transformer_runtime.spec`) sees it.

    Source and decoder input are padded to `width` (one shape, compiled once
    on JAX): padding is masked out of the source, and the causal mask keeps
    the positions after the prefix out of its last one.
    """
    known = {}
    source_ids = np.zeros((1, width), np.int32)
    source_ids[0, : len(source)] = source

    def log_probs(prefix):
        if tuple(prefix) not in known:
            target_ids = np.zeros((1, width), np.int32)
            target_ids[0, : len(prefix) + 1] = [BOS_ID, *prefix]
            logits = model({"source_ids": source_ids, "target_ids": target_ids}, training=False)
            row = ops.log_softmax(logits[0, len(prefix)])
            known[tuple(prefix)] = np.asarray(ops.convert_to_numpy(row))
        return known[tuple(prefix)]

    return log_probs


# Keras decoding against the specification: float32 round-off between the
# cached steps and the whole model's pass, summed over a few tokens.
SPEC_SCORE_TOLERANCE = 1e-4


def test_keras_decoding_follows_the_search_specification(random_model):
    sources = [*random_sources(5, seed=4), []]
    limit = 8
    views = [model_log_probs(random_model, s) for s in sources]
    expected = [
        spec.greedy(view, limit if s else 0) for view, s in zip(views, sources, strict=True)
    ]
    for use_cache in (True, False):
        tokens, scores = greedy_search(random_model, sources, max_length=limit, use_cache=use_cache)
        assert tokens == [e[0] for e in expected], use_cache
        np.testing.assert_allclose(scores, [e[1] for e in expected], atol=SPEC_SCORE_TOLERANCE)
    for beam_size, alpha in ((3, 0.6), (2, 0.0)):
        expected = [
            spec.beam(view, limit if s else 0, beam_size, alpha)
            for view, s in zip(views, sources, strict=True)
        ]
        tokens, scores = beam_search(
            random_model, sources, beam_size=beam_size, length_penalty=alpha, max_length=limit
        )
        assert tokens == [e[0] for e in expected], beam_size
        np.testing.assert_allclose(scores, [e[1] for e in expected], atol=SPEC_SCORE_TOLERANCE)


def test_beam_finds_better_scores_than_greedy_on_average(toy_run):
    # Beam search may prune the greedy path for a sentence, but over many
    # sentences it must find higher-scoring outputs under its own objective.
    model, sources = toy_sources(toy_run, 40)
    greedy_tokens, _ = greedy_search(model, sources)
    _, beam_scores = beam_search(model, sources, beam_size=4)
    ended = [len(t) < default_limit(model, s) for t, s in zip(greedy_tokens, sources, strict=True)]
    greedy_log_probs = sequence_log_probs(model, sources, greedy_tokens, ended=ended)
    lengths = [len(t) + e for t, e in zip(greedy_tokens, ended, strict=True)]
    greedy_scores = greedy_log_probs / length_penalty_factor(lengths)
    assert beam_scores.mean() > greedy_scores.mean()
    assert (beam_scores >= greedy_scores - 1e-6).mean() >= 0.75


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_batch_equals_one_by_one(search, toy_run, random_model):
    model, sources = toy_sources(toy_run, 12)
    sources = sources[:8] + random_sources(4, seed=3, vocabulary_size=40)
    if search == "greedy":

        def run(s):
            return greedy_search(model, s)
    else:

        def run(s):
            return beam_search(model, s, beam_size=3)

    batch_tokens, batch_scores = run(sources)
    for i, source in enumerate(sources):
        tokens, scores = run([source])
        assert tokens[0] == batch_tokens[i]
        np.testing.assert_allclose(scores[0], batch_scores[i], atol=1e-4)


def test_padded_array_input_equals_list_input(random_model):
    sources = random_sources(5, seed=4)
    array = np.zeros((5, 20), np.int32)
    for i, s in enumerate(sources):
        array[i, : len(s)] = s
    assert (
        greedy_search(random_model, array, max_length=10)[0]
        == (greedy_search(random_model, sources, max_length=10)[0])
    )


def test_loaded_model_decodes_the_same(toy_run, tmp_path):
    model, sources = toy_sources(toy_run, 30)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert beam_search(loaded, sources)[0] == beam_search(model, sources)[0]


def test_empty_source_gives_empty_output(random_model):
    tokens, scores = greedy_search(random_model, [[], [5, 6, 7]], max_length=5)
    assert tokens[0] == [] and scores[0] == 0.0 and len(tokens[1]) == 5
    tokens, scores = beam_search(random_model, [[]], beam_size=3)
    assert tokens == [[]] and scores[0] == 0.0
    assert greedy_search(random_model, np.zeros((2, 4), np.int32))[0] == [[], []]


def test_source_longer_than_max_length_decodes_as_with_a_longer_table(random_model):
    """Positions past max_length are computed: the same weights with a table long
    enough give the same outputs, and the output may be as long as needed."""
    longer = build_transformer(TransformerConfig.from_preset("tiny", max_length=160))
    longer.set_weights(random_model.get_weights())
    sources = [list(range(4, 61)), [5, 6, 7], list(range(10, 53))]  # 57 and 43 > 40 tokens
    # One explicit output limit: the default one depends on max_length.
    for search, kwargs in (
        (greedy_search, {"max_length": 90}),
        (beam_search, {"beam_size": 3, "max_length": 90}),
    ):
        tokens, scores = search(random_model, sources, **kwargs)
        expected_tokens, expected_scores = search(longer, sources, **kwargs)
        assert tokens == expected_tokens
        np.testing.assert_allclose(scores, expected_scores, rtol=1e-4, atol=1e-4)
    tokens, _ = greedy_search(random_model, sources, max_length=70, ignore_eos=True)
    assert [len(t) for t in tokens] == [70, 70, 70]  # past max_length=40 too


@pytest.mark.parametrize("beam_size", [0, -2, 1.5, True])
def test_bad_beam_size_raises(random_model, beam_size):
    with pytest.raises(ValueError, match="beam_size must be a positive integer"):
        beam_search(random_model, [[5, 6]], beam_size=beam_size)


def test_bad_arguments_raise(random_model):
    with pytest.raises(ValueError, match="max_length must be a positive integer"):
        greedy_search(random_model, [[5, 6]], max_length=0)
    with pytest.raises(ValueError, match="shape"):
        greedy_search(random_model, np.zeros((2, 3, 4), np.int32))
    with pytest.raises(ValueError, match="integer"):
        greedy_search(random_model, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="length_penalty"):
        beam_search(random_model, [[5, 6]], length_penalty=-1)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's own warning")
def test_one_compiled_search_per_shape_does_not_warn_of_retracing(random_model, caplog):
    """The decoder compiles its search once per batch shape on purpose; TensorFlow's
    retracing warning is hidden for the decoder's functions, not for anyone else's."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        for n in range(1, 8):
            greedy_search(random_model, rng.integers(4, 40, size=(n, 2 + n)).astype("int32"))

        @tf.function
        def double(x):
            return x * 2

        for n in range(1, 8):
            double(tf.ones((n,)))
    retracing = [r.getMessage() for r in caplog.records if "retracing" in r.getMessage()]
    assert retracing and all("CompiledSteps." not in message for message in retracing)


@pytest.mark.parametrize(
    "options",
    [
        {"beam_size": 3, "n_best": 2, "token_scores": True, "disable_unk": True},
        {"beam_size": 1, "min_length": 5, "no_repeat_ngram_size": 1},
        {"beam_size": 1, "sampling_topk": 5, "sampling_temperature": 0.7, "seed": 3},
    ],
)
def test_keras_search_with_options_follows_the_search_specification(random_model, options):
    from keras_transformer_runtime.options import SearchOptions
    from keras_transformer_runtime.spec import SentenceSearch, sentence_rng

    from keras_transformer.decoding import score, search

    options = SearchOptions(max_length=8, **options)
    sources = [*random_sources(4, seed=9), []]
    prefixes = [[5, 6], [], [7], [], [8]]
    found = search(random_model, sources, options, prefixes, indices=[3, 1, 4, 1, 5])
    for source, prefix, index, hypotheses in zip(
        sources, prefixes, [3, 1, 4, 1, 5], found, strict=True
    ):
        rng = sentence_rng(options.seed, index) if options.sampling else None
        expected = SentenceSearch(8 if source else 0, options, prefix, rng).run(
            model_log_probs(random_model, source)
        )
        assert [h.tokens for h in hypotheses] == [h.tokens for h in expected]
        np.testing.assert_allclose(
            [h.score for h in hypotheses], [h.score for h in expected], atol=SPEC_SCORE_TOLERANCE
        )
        assert hypotheses[0].tokens[: len(prefix) if source else 0] == (prefix if source else [])
    # forced decoding of the outputs gives their step scores (EOS scored last)
    ended = [(s, h) for s, hs in zip(sources, found, strict=True) for h in hs if s]
    forced = score(random_model, [s for s, _ in ended], [h.tokens for _, h in ended])
    for (_, h), (total, steps) in zip(ended, forced, strict=True):
        assert total == pytest.approx(sum(steps))
        if options.token_scores and not options.sampling and len(h.tokens) < 8:
            np.testing.assert_allclose(steps, h.token_scores, atol=SPEC_SCORE_TOLERANCE)
    assert score(random_model, [[]], [[5]]) == [(None, None)]
