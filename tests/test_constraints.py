"""Terminology constraints end to end on the trained toy model: Keras decoding, the
ONNX Runtime translator and the one-sentence reference give the same constrained
translations, and both translate commands read a constraints file."""

import io

import numpy as np
import pytest
from keras_transformer_runtime.constrained_search import constrained_beam
from keras_transformer_runtime.constraints import Constraints
from keras_transformer_runtime.options import SearchOptions
from keras_transformer_runtime.sources import output_limits

from keras_transformer import cli, decoding
from keras_transformer.decoding import beam_search
from keras_transformer.translation import translate_lines
from tests.onnx_helpers import (
    SPEC_SCORE_TOLERANCE,
    held_out_lines,
    source_ids,
    spec_view,
    translate_command,
)


def _contains(tokens, phrase):
    n = len(phrase)
    return any(list(tokens[i : i + n]) == list(phrase) for i in range(len(tokens) - n + 1))


def _phrases(tokenizer, plain, count):
    """Per sentence: target words the plain search did not produce (a one-word and a
    two-word phrase, chosen by position), so that every constraint changes the output."""
    words = tokenizer.tokens[4:]
    phrases = []
    for i, output in enumerate(plain[:count]):
        missing = [w for w in words if tokenizer.encode(w)[0] not in output]
        one, two, three = (missing[(7 * i + j * 11) % len(missing)] for j in range(3))
        phrases.append([one] if i % 3 == 0 else [one, f"{two} {three}"])
    return phrases


@pytest.mark.parametrize("beam_size", [1, 4])
def test_keras_reference_and_onnx_give_the_same_constrained_translations(exported, beam_size):
    model, tokenizer, translator, _ = exported("float32")
    lines = held_out_lines(12, seed=47)
    sources = source_ids(tokenizer, lines)
    plain, _ = beam_search(model, sources, beam_size=4)
    phrases = [
        [tokenizer.encode(p) for p in entry] for entry in _phrases(tokenizer, plain, len(lines))
    ]
    options = SearchOptions(beam_size=beam_size)
    onnx_tokens, onnx_scores = _best(translator.search(sources, options, constraints=phrases))
    keras_tokens, keras_scores = _best(
        decoding.search(model, sources, options, constraints=phrases)
    )
    assert onnx_tokens == keras_tokens
    np.testing.assert_allclose(onnx_scores, keras_scores, atol=1e-3)
    for i, (source, entry) in enumerate(zip(sources, phrases, strict=True)):
        limit = output_limits([len(source)], None, translator.max_length)[0]
        tokens, score = constrained_beam(spec_view(translator, source), limit, beam_size, entry)
        assert onnx_tokens[i] == tokens
        assert onnx_scores[i] == pytest.approx(score, abs=SPEC_SCORE_TOLERANCE)
        for phrase in entry:
            assert _contains(tokens, phrase)
        assert tokens != plain[i]
    # No constraints: the plain beam search.
    empty = [[]] * len(sources)
    assert _best(translator.search(sources, SearchOptions(), constraints=empty))[0] == plain


def _best(found):
    """The best hypothesis of each sentence as `(tokens, scores)`."""
    return [h[0].tokens for h in found], np.array([h[0].score for h in found])


def test_translate_commands_read_constraints_files(
    exported, toy_run, tmp_path, monkeypatch, capsys
):
    model, tokenizer, translator, out = exported("float32")
    lines = held_out_lines(9, seed=53)
    plain = translator.translate(lines, beam_size=3)
    phrases = _phrases(tokenizer, [tokenizer.encode(t) for t in plain], len(lines))
    phrases[4] = []
    lines[6] = ""  # an empty line's phrases are not searched for
    expected = translator.translate(lines, beam_size=3, constraints=phrases)
    for i, (text, entry) in enumerate(zip(expected, phrases, strict=True)):
        words = text.split()
        for phrase in entry if i != 6 else []:
            assert _contains(words, phrase.split())
    assert expected[4] == plain[4] and expected[6] == ""
    assert expected == translate_lines(model, tokenizer, lines, beam_size=3, constraints=phrases)

    tsv = tmp_path / "terms.tsv"
    tsv.write_text("".join("\t".join(p) + "\n" for p in phrases), encoding="utf-8")
    jsonl = tmp_path / "terms.jsonl"
    jsonl.write_text("".join(f"{list(p)}\n".replace("'", '"') for p in phrases), "utf-8")
    for path in (tsv, jsonl):
        result = translate_command(out, lines, "--beam", "3", "--constraints", str(path))
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == expected

    run_dir = toy_run[3]["run_dir"]  # the run the float32 export was made from
    data = "".join(line + "\n" for line in lines).encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert cli.main(["translate", run_dir, "--beam", "3", "--constraints", str(jsonl)]) == 0
    assert capsys.readouterr().out.splitlines() == expected
    tsv.write_text("\n", encoding="utf-8")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    with pytest.raises(SystemExit, match="has 1 lines, the input 9"):
        cli.main(["translate", run_dir, "--constraints", str(tsv)])

    # evaluate takes them too (a file of the lines with text: read_parallel skips none).
    kept = [i for i, line in enumerate(lines) if line]
    src, ref, hyp = tmp_path / "src.txt", tmp_path / "ref.txt", tmp_path / "out.hyp"
    src.write_text("".join(lines[i] + "\n" for i in kept), encoding="utf-8")
    ref.write_text("".join(expected[i] + "\n" for i in kept), encoding="utf-8")
    tsv.write_text("".join("\t".join(phrases[i]) + "\n" for i in kept), encoding="utf-8")
    flags = ["--src", str(src), "--ref", str(ref), "--output", str(hyp), "--beam", "3"]
    assert cli.main(["evaluate", run_dir, *flags, "--constraints", str(tsv)]) == 0
    assert hyp.read_text(encoding="utf-8").splitlines() == [expected[i] for i in kept]


def test_bad_constraints_are_refused_naming_the_line(exported, tmp_path):
    _, tokenizer, translator, out = exported("float32")
    lines = held_out_lines(3, seed=59)
    word = tokenizer.tokens[10]
    cases = [
        ([[word], ["zzz-unknown"], []], "'zzz-unknown' of line 2 .*unknown token"),
        ([[], [" "], []], "' ' of line 2 tokenizes to nothing"),
        ([[word] * 3, [], []], "constraints of line 1 need 3 tokens"),
        ([[word]], "constraints has 1 entries for 3 sentences"),
    ]
    for constraints, message in cases:
        with pytest.raises(ValueError, match=message):
            translator.translate(lines, beam_size=2, max_length=3, constraints=constraints)
    long_phrase = " ".join([word] * (translator.max_length + 1))
    with pytest.raises(ValueError, match=r"is \d+ tokens, longer than"):
        translator.translate(lines, constraints=[[long_phrase], [], []])
    with pytest.raises(ValueError, match="need 2 tokens"):
        options = SearchOptions(beam_size=2, max_length=2)
        translator.search([[5, 2]], options, constraints=[[[5], [6]]])

    terms = tmp_path / "terms.tsv"
    terms.write_text(f"{word}\n\n", encoding="utf-8")
    result = translate_command(out, lines, "--constraints", str(terms))
    assert result.returncode != 0 and result.stdout == ""
    assert "has 2 lines, the input 3" in result.stderr and "Traceback" not in result.stderr
    terms.write_text(f"{word}\nzzz-unknown\n\n", encoding="utf-8")
    result = translate_command(out, lines, "--constraints", str(terms))
    assert "error: The constraint 'zzz-unknown' of line 2" in result.stderr
    result = translate_command(out, lines, "--constraints", str(tmp_path / "missing.tsv"))
    assert "error: --constraints" in result.stderr and "No such file" in result.stderr
    assert Constraints([tokenizer.encode(word)]).total == 1
