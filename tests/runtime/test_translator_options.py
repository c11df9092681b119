"""The decoding options in the ONNX Runtime translator and in Keras decoding: each
against the search specification (`spec.SentenceSearch`) on the trained toy model,
the two engines against each other, and forced scoring."""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the ONNX tests run once, in the TensorFlow tier (the export itself takes either backend: tests/test_model.py)",
)

from keras_transformer_runtime import OnnxTranslator  # noqa: E402
from keras_transformer_runtime import translator as translator_module  # noqa: E402
from keras_transformer_runtime.options import SearchOptions  # noqa: E402
from keras_transformer_runtime.sources import output_limits, prefixed_limits  # noqa: E402
from keras_transformer_runtime.spec import SentenceSearch  # noqa: E402
from keras_transformer_runtime.tag_placement import sentence_links  # noqa: E402

from keras_transformer import decoding  # noqa: E402
from tests.onnx_helpers import (  # noqa: E402
    SPEC_SCORE_TOLERANCE,
    held_out_lines,
    source_ids,
    spec_view,
)

OPTIONS = [
    {"beam_size": 3, "n_best": 3, "token_scores": True},
    {"beam_size": 1, "min_length": 9, "disable_unk": True, "token_scores": True},
    {"beam_size": 4, "no_repeat_ngram_size": 1, "repetition_penalty": 1.3, "max_length": 12},
    {"beam_size": 2, "suppress_sequences": [(7,), (8, 9)], "length_penalty": 1.0},
]


@pytest.fixture(scope="module")
def toy(toy_run, tmp_path_factory):
    """(Keras model, word vocabulary, OnnxTranslator) of the trained toy run."""
    from keras_transformer.export.onnx import export_onnx
    from keras_transformer.translation import load_run

    out = str(tmp_path_factory.mktemp("onnx_options") / "toy")
    export_onnx(toy_run[3]["run_dir"], out)
    model, tokenizer = load_run(toy_run[3]["run_dir"])
    return model, tokenizer, OnnxTranslator(out)


def _assert_same(found, expected):
    assert [h.tokens for h in found] == [h.tokens for h in expected]
    np.testing.assert_allclose(
        [h.score for h in found], [h.score for h in expected], atol=SPEC_SCORE_TOLERANCE
    )
    for a, b in zip(found, expected, strict=True):
        if b.token_scores is not None:
            np.testing.assert_allclose(a.token_scores, b.token_scores, atol=SPEC_SCORE_TOLERANCE)


@pytest.mark.parametrize("options", OPTIONS)
def test_onnx_and_keras_follow_the_specification_with_options(options, toy):
    model, tokenizer, translator = toy
    options = SearchOptions(**options)
    sources = source_ids(tokenizer, held_out_lines(6, seed=53)) + [[]]
    prefixes = [[], tokenizer.encode("ko")] + [[]] * (len(sources) - 2)
    onnx = translator.search(sources, options, prefixes)
    from_keras = decoding.search(model, sources, options, prefixes)
    for source, prefix, a, b in zip(sources, prefixes, onnx, from_keras, strict=True):
        limit = output_limits([len(source)], options.max_length, translator.max_length)
        limit = prefixed_limits(limit, [prefix], options.max_length)[0]
        expected = SentenceSearch(limit, options, prefix).run(spec_view(translator, source))
        _assert_same(a, expected)
        _assert_same(b, expected)
        assert a[0].tokens[: len(prefix)] == prefix


@pytest.mark.parametrize("beam_size", [1, 3])
@pytest.mark.parametrize("max_length", [None, 4])
@pytest.mark.parametrize("form", ["gnmt", "average"])
def test_token_scores_come_from_the_fast_searches(toy, monkeypatch, beam_size, max_length, form):
    """Token scores are the step scores the search graphs (and, greedy, the Keras
    compiled loop) already return: no step-by-step loop runs, and they are the
    specification's (EOS included when produced; none at the limit), under
    either length penalty form."""
    model, tokenizer, translator = toy
    options = SearchOptions(
        beam_size=beam_size,
        token_scores=True,
        max_length=max_length,
        length_penalty=1.0,
        length_penalty_form=form,
    )
    sources = source_ids(tokenizer, held_out_lines(7, seed=67)) + [[]]
    from_keras = decoding.search(model, sources, options)  # beam: Keras runs the loop

    def refuse(*args, **kwargs):
        raise AssertionError("token scores must not run the step-by-step loop")

    monkeypatch.setattr(translator_module, "search_loop", refuse)
    onnx = translator.search(sources, options)
    if beam_size == 1:
        from_keras = decoding.search(model, sources, options)
    for source, a, b in zip(sources, onnx, from_keras, strict=True):
        limit = output_limits([len(source)], max_length, translator.max_length)[0]
        expected = SentenceSearch(limit, options).run(spec_view(translator, source))
        _assert_same(a, expected)
        _assert_same(b, expected)
        assert a[0].log_prob == pytest.approx(sum(a[0].token_scores))


def test_an_export_without_the_forms_input_searches_the_average_form_in_the_loop(toy, monkeypatch):
    """Beam graphs exported before their `length_penalty_form` input: the average form
    then runs the loop, with the same hypotheses as the graphs that take it."""
    from keras_transformer_runtime.export_format import LENGTH_PENALTY_FORM_INPUT

    _, tokenizer, translator = toy
    options = SearchOptions(
        beam_size=3, n_best=2, length_penalty=1.0, length_penalty_form="average"
    )
    sources = source_ids(tokenizer, held_out_lines(8, seed=71))
    # Three sentences take the beam_search graph, eight beam_batch_search.
    in_graph = [translator.search(batch, options) for batch in (sources[:3], sources)]
    ran = []
    monkeypatch.setattr(
        translator_module,
        "search_loop",
        lambda *args, search_loop=translator_module.search_loop, **kwargs: (
            ran.append(1) or search_loop(*args, **kwargs)
        ),
    )
    for entry in translator.decoder.manifest["graphs"].values():
        if LENGTH_PENALTY_FORM_INPUT in entry.get("inputs", {}):
            monkeypatch.delitem(entry["inputs"], LENGTH_PENALTY_FORM_INPUT)
    in_loop = [translator.search(batch, options) for batch in (sources[:3], sources)]
    assert len(ran) == 2
    for graph_batch, loop_batch in zip(in_graph, in_loop, strict=True):
        for a, b in zip(graph_batch, loop_batch, strict=True):
            _assert_same(a, b)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_alignments_come_from_the_fast_searches(toy, monkeypatch, beam_size):
    """The search graphs return each output step's alignment weights (asked for by
    their `alignment` input): the alignments and word links are the teacher-forced
    pass's, without that pass, from the one-sentence and the batch graphs alike;
    a graph that returns none falls back to the pass."""
    _, tokenizer, translator = toy
    options = SearchOptions(beam_size=beam_size, n_best=min(beam_size, 2), alignment=True)
    lines = held_out_lines(8, seed=79)
    sources = source_ids(tokenizer, lines)
    batches = [(lines[:2], sources[:2]), (lines + [""], sources + [[]])]
    plain = SearchOptions(beam_size=beam_size, n_best=options.n_best)
    expected = []
    for texts, batch in batches:
        found = translator.search(batch, plain)
        pairs = [(s, h.tokens) for s, row in zip(batch, found, strict=True) for h in row]
        aligned = translator.align_ids([s for s, _ in pairs], [t for _, t in pairs])
        links = sentence_links(translator, texts, [row[0].tokens for row in found], batch)
        expected.append((found, aligned, links))

    def refuse(*args, **kwargs):
        raise AssertionError("the search graphs' alignments need no teacher-forced pass")

    monkeypatch.setattr(translator.decoder, "alignment_weights", refuse)
    for (texts, batch), (plain_found, aligned, links) in zip(batches, expected, strict=True):
        found, rows = translator.search_with_weights(batch, options)
        assert [[h.tokens for h in row] for row in found] == [
            [h.tokens for h in row] for row in plain_found
        ]
        assert [h.alignment for row in found for h in row] == aligned
        for row, weights in zip(found, rows, strict=True):
            for h, w in zip(row, weights, strict=True):
                assert w.shape[0] == len(h.tokens) + (len(h.tokens) < w.shape[0])
        best = [row[0].tokens for row in found]
        assert sentence_links(translator, texts, best, batch, [w[0] for w in rows]) == links
    monkeypatch.undo()
    # A graph without alignments (an export made before them): the pass runs.
    ran = []
    monkeypatch.setattr(  # on the class: a batch may be searched by the decoder's copies
        type(translator.decoder),
        "_alignment_feed",
        lambda self, graph, attention, feeds: feeds.update(alignment=np.array(False)) or False,
    )
    monkeypatch.setattr(
        translator.decoder,
        "alignment_weights",
        lambda *args, run=translator.decoder.alignment_weights: ran.append(1) or run(*args),
    )
    found = translator.search(batches[1][1], options)
    assert ran and [h.alignment for row in found for h in row] == expected[1][1]


def test_n_best_starts_with_the_plain_beam_and_scores_are_forced_decoding(toy):
    _, tokenizer, translator = toy
    sources = source_ids(tokenizer, held_out_lines(20, seed=59))
    tokens, scores = translator.beam_search(sources, beam_size=4)
    found = translator.search(sources, SearchOptions(n_best=4, token_scores=True))
    forced = translator.score_ids(
        [s for s, hs in zip(sources, found, strict=True) for _ in hs],
        [h.tokens for hs in found for h in hs],
    )
    forced = iter(forced)
    for best, score, hypotheses in zip(tokens, scores, found, strict=True):
        assert hypotheses[0].tokens == best
        assert hypotheses[0].score == pytest.approx(score, abs=1e-4)
        assert [h.score for h in hypotheses] == sorted((h.score for h in hypotheses), reverse=True)
        for h in hypotheses:
            total, steps = next(forced)
            # these outputs all ended with EOS, so forced decoding scores the same tokens
            assert len(steps) == len(h.token_scores)
            np.testing.assert_allclose(steps, h.token_scores, atol=1e-4)
            assert total == pytest.approx(h.log_prob, abs=1e-4)
            assert total == pytest.approx(sum(steps))


def test_plain_options_take_the_search_graphs(toy, monkeypatch):
    _, tokenizer, translator = toy
    sources = source_ids(tokenizer, held_out_lines(5, seed=61))
    expected = [
        translator.beam_search(sources, beam_size=3)[0],
        translator.greedy_search(sources)[0],
    ]

    def refuse(*args, **kwargs):
        raise AssertionError("plain options must not run the step-by-step loop")

    monkeypatch.setattr(translator_module, "search_loop", refuse)
    # n-best lists and token scores come out of the beam graphs too.
    for options, tokens in zip(
        (SearchOptions(beam_size=3, n_best=3, token_scores=True), SearchOptions(beam_size=1)),
        expected,
        strict=True,
    ):
        found = translator.search(sources, options)
        assert [hs[0].tokens for hs in found] == tokens
        assert all(len(hs) == options.n_best for hs in found)
    with pytest.raises(AssertionError, match="step-by-step"):
        translator.search(sources, SearchOptions(n_best=2, repetition_penalty=1.5))


def test_texts_prefixes_sampling_and_scoring(toy):
    model, tokenizer, translator = toy
    from keras_transformer.translation import score_lines, translate_hypotheses

    lines = held_out_lines(12, seed=67)
    prefixes = ["ko"] * len(lines)
    found = translator.translate_hypotheses(lines, SearchOptions(beam_size=2), prefixes)
    assert all(hs[0]["text"].split()[0] == "ko" for hs in found)
    assert translate_hypotheses(model, tokenizer, lines, SearchOptions(beam_size=2), prefixes) == [
        [{**h, "score": pytest.approx(h["score"], abs=1e-4),
          "log_prob": pytest.approx(h["log_prob"], abs=1e-4)} for h in hs]
        for hs in found
    ]  # fmt: skip
    with pytest.raises(ValueError, match="line 2 .* holds 'zzzz', which is not in the vocabulary"):
        translator.translate_hypotheses(lines[:2], prefixes=["ko", "ka zzzz"])
    # A prefix too long for --max-length is named by its line before any search.
    short, prefixes = SearchOptions(beam_size=2, max_length=3), ["ko", "ko ka ko ka"]
    assert len(tokenizer.encode(prefixes[0])) < 3 <= len(tokenizer.encode(prefixes[1]))
    for run in (
        lambda: translator.translate_hypotheses(lines[:2], short, prefixes),
        lambda: translate_hypotheses(model, tokenizer, lines[:2], short, prefixes),
    ):
        with pytest.raises(ValueError, match="prefix of line 2 .* no room under max_length=3"):
            run()

    sampling = SearchOptions(beam_size=1, sampling_topk=0, sampling_temperature=2.0, seed=1)
    one = translator.translate(lines, options=sampling, batch_size=5)
    assert one == translator.translate(lines, options=sampling, batch_size=32)
    other = translator.translate(lines, options=SearchOptions(**{**vars(sampling), "seed": 2}))
    assert one != other
    assert one == [hs[0]["text"] for hs in translate_hypotheses(model, tokenizer, lines, sampling)]

    sources = source_ids(tokenizer, lines)
    tokens, greedy = translator.greedy_search(sources)
    limits = output_limits([len(s) for s in sources], None, translator.max_length)
    ended = [i for i, t in enumerate(tokens) if len(t) < limits[i]]  # EOS scored in both
    assert len(ended) > len(sources) // 2
    forced = translator.score_ids(sources, tokens)
    np.testing.assert_allclose([forced[i][0] for i in ended], greedy[ended], atol=1e-4)
    targets = translator.translate(lines, beam_size=1)
    scored = translator.score(lines, targets)
    again = translator.score_ids(sources, [tokenizer.encode(t) for t in targets])
    assert [s["log_prob"] for s in scored] == [total for total, _ in again]
    keras_scored = score_lines(model, tokenizer, lines, targets)
    np.testing.assert_allclose(
        [s["log_prob"] for s in keras_scored], [s["log_prob"] for s in scored], atol=1e-4
    )
    assert translator.score([""], ["ko"]) == [{"log_prob": None, "token_scores": None}]


def test_both_commands_take_the_same_decoding_flags(toy, toy_run, tmp_path, monkeypatch, capsys):
    import io
    import json

    from keras_transformer import cli
    from tests.onnx_helpers import translate_command

    _, _, translator = toy
    lines = held_out_lines(8, seed=71)
    prefix_file = tmp_path / "prefix.txt"
    prefix_file.write_text("ko\n\n" * 4, encoding="utf-8")
    flags = ["--beam", "3", "--n-best", "2", "--format", "jsonl", "--prefix", str(prefix_file)]

    def keras_command(*flags):
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
        assert cli.main(["translate", toy_run[3]["run_dir"], *flags]) == 0
        return capsys.readouterr().out

    def texts(output):
        return [[h["text"] for h in json.loads(row)["hypotheses"]] for row in output.splitlines()]

    onnx = translate_command(translator.onnx_dir, lines, *flags)
    assert onnx.returncode == 0, onnx.stderr
    found = texts(onnx.stdout)
    assert found == texts(keras_command(*flags))
    assert [len(hs) for hs in found] == [2] * len(lines)
    assert all(hs[0].split()[0] == "ko" for hs in found[::2])

    target_file = tmp_path / "targets.txt"
    target_file.write_text("".join(hs[0] + "\n" for hs in found), encoding="utf-8")
    scored = translate_command(translator.onnx_dir, lines, "--score", str(target_file))
    assert scored.returncode == 0, scored.stderr
    expected = translator.score(lines, [hs[0] for hs in found])
    assert [float(x) for x in scored.stdout.split()] == pytest.approx(
        [s["log_prob"] for s in expected], abs=1e-3
    )

    refused = translate_command(translator.onnx_dir, lines, "--beam", "2", "--n-best", "3")
    assert refused.returncode != 0 and "--n-best must be at most beam_size" in refused.stderr
    refused = translate_command(
        translator.onnx_dir, lines, "--beam", "1", "--sampling-topk", "0", "--sampling-topp", "2"
    )
    assert refused.returncode != 0 and r"--sampling-topp must be in (0, 1]" in refused.stderr


def test_alignments_find_the_toy_languages_word_order(toy, toy_run):
    """The toy target reverses the source and rewrites each word (some as two):
    its gold alignment is known. The alignment layer's cross-attention finds
    most of it, in ONNX Runtime and Keras alike."""
    model, tokenizer, translator = toy
    corpus = toy_run[1]
    pairs = corpus.test[:40]
    sources = source_ids(tokenizer, [s for s, _ in pairs])
    targets = [tokenizer.encode(t) for _, t in pairs]
    found = translator.align_ids(sources, targets)
    assert found == decoding.align(model, sources, targets)
    right = total = 0
    for (source, _), positions in zip(pairs, found, strict=True):
        words = source.split()
        gold = [
            len(words) - 1 - i for i, word in enumerate(reversed(words)) for _ in corpus.table[word]
        ]
        assert len(positions) == len(gold)
        right += sum(p == g for p, g in zip(positions, gold, strict=True))
        total += len(gold)
    assert right / total > 0.6, right / total  # 0.70 when the layer was chosen
    records = translator.translate_hypotheses(
        [s for s, _ in pairs[:3]], SearchOptions(beam_size=2, alignment=True)
    )
    for (source, _), hypotheses in zip(pairs[:3], records, strict=True):
        alignment = hypotheses[0]["alignment"]
        assert len(alignment) == len(hypotheses[0]["text"].split())
        assert all(0 <= p <= len(source.split()) for p in alignment)
