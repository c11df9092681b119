import io
import json
import os

import pytest

from keras_transformer import transformer_parts
from keras_transformer.cli import main
from keras_transformer.translation import load_run, translate_lines

# Trained fixtures, exports and commands end to end: `make integration`.
pytestmark = pytest.mark.integration


def test_translate_reads_stdin_and_keeps_order(toy_run, monkeypatch, capsys):
    model, corpus, vocabulary, metrics = toy_run
    lines = [s for s, _ in corpus.test[:20]]
    lines.insert(3, "")  # an empty line stays an empty line
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["translate", metrics["run_dir"], "--greedy", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)
    expected = translate_lines(model, vocabulary, lines, beam_size=1, batch_size=len(lines))
    assert out[:-1] == expected
    assert out[3] == ""


def test_translate_takes_a_document_of_paragraphs(toy_run, monkeypatch, capsys):
    from keras_transformer.decoding import translator

    model, corpus, vocabulary, metrics = toy_run
    sentences = [s + " ." for s, _ in corpus.test[:5]]
    document = " ".join(sentences[:3]) + "\r\n\n  " + " ".join(sentences[3:]) + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(document))
    flags = ["--greedy", "--input-format", "paragraphs", "--source-language", "en"]
    assert main(["translate", metrics["run_dir"], *flags]) == 0
    out = capsys.readouterr().out
    found = translator(model, vocabulary).translate(sentences, beam_size=1)
    assert out == " ".join(found[:3]) + "\r\n\n  " + " ".join(found[3:]) + "\n"


def test_evaluate_writes_hypotheses_and_scores(toy_run, tmp_path, capsys):
    _, corpus, _, metrics = toy_run
    src, ref = tmp_path / "test.src", tmp_path / "test.tgt"
    src.write_text("".join(s + "\n" for s, _ in corpus.test))
    ref.write_text("".join(t + "\n" for _, t in corpus.test))
    output = str(tmp_path / "hyp.txt")
    assert (
        main(
            [
                "evaluate",
                metrics["run_dir"],
                "--src",
                str(src),
                "--ref",
                str(ref),
                "--beam",
                "2",
                "--output",
                output,
            ]
        )
        == 0
    )
    with open(output + ".json") as f:
        scores = json.load(f)
    assert scores == json.loads(capsys.readouterr().out)
    assert scores["beam_size"] == 2 and scores["sentences"] == len(corpus.test)
    assert scores["length_penalty"] == 0.6  # the default, recorded with the scores
    assert scores["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert 0 < scores["bleu"] <= 100 and 0 < scores["chrf"] <= 100
    with open(output) as f:
        assert len(f.read().splitlines()) == len(corpus.test)


def test_evaluate_refuses_unparallel_files(toy_run, tmp_path):
    _, _, _, metrics = toy_run
    src, ref = tmp_path / "a.src", tmp_path / "a.tgt"
    src.write_text("ka ko\nli lo\n")
    ref.write_text("KA\n")
    with pytest.raises(SystemExit, match="has 2 lines but .* has 1"):
        main(["evaluate", metrics["run_dir"], "--src", str(src), "--ref", str(ref)])
    assert not os.path.exists(os.path.join(metrics["run_dir"], "a.src.hyp"))


def test_bad_run_dir_and_beam(tmp_path, toy_run):
    with pytest.raises(SystemExit, match="Run directory not found"):
        main(["translate", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="No model.keras"):
        main(["translate", str(tmp_path)])
    with pytest.raises(SystemExit, match="--beam must be a positive integer"):
        main(["translate", toy_run[3]["run_dir"], "--beam", "0"])


@pytest.mark.parametrize(
    "damage,message",
    [
        ("not a zip file", r"not a Keras model file \(14 bytes, not a .keras zip archive\)"),
        ("truncated", r"not a Keras model file \(\d+ bytes, not a .keras zip archive\)"),
        ("flipped", r"damaged .keras archive: model.weights.h5 fails its checksum"),
        ("other zip", r"not a Keras model file: it has no config.json, model.weights.h5"),
    ],
)
def test_corrupt_model_file_is_reported(damage, message, tmp_path, toy_run):
    """Each kind of damage is named, where Keras itself says "File not found"."""
    import zipfile

    source = toy_run[3]["run_dir"]
    with open(os.path.join(source, "model.keras"), "rb") as f:
        data = f.read()
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped":
        data = bytearray(data)
        data[len(data) // 2] ^= 0xFF
    elif damage == "other zip":
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("notes.txt", "hello")
        data = buffer.getvalue()
    else:
        data = damage.encode()
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.keras").write_bytes(bytes(data))
    with open(os.path.join(source, "vocab.txt")) as f:
        (run / "vocab.txt").write_text(f.read())
    with pytest.raises(ValueError, match=message) as caught:
        load_run(str(run))
    assert "File not found" not in str(caught.value)
    with pytest.raises(SystemExit, match=message):
        main(["translate", str(run)])


def test_length_penalty_flag_reaches_the_beam_search(toy_run, monkeypatch, capsys):
    model, corpus, vocabulary, metrics = toy_run
    lines = [s for s, _ in corpus.test[:12]]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["translate", metrics["run_dir"], "--beam", "3", "--length-penalty", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == translate_lines(model, vocabulary, lines, beam_size=3, length_penalty=3.0)
    for bad in ("-0.5", "nan"):
        with pytest.raises(SystemExit, match="--length-penalty must be a non-negative number"):
            main(["translate", metrics["run_dir"], "--length-penalty", bad])


def test_over_long_lines_are_translated_with_a_warning(toy_run, tmp_path, capsys, monkeypatch):
    """A line past the model's max_length among normal ones: every line translated,
    one warning per long line and a count, through translate and evaluate."""
    model, corpus, vocabulary, metrics = toy_run
    limit = transformer_parts(model).config.max_length
    normal = [source for source, _ in corpus.test[:6]]
    long_line = " ".join(normal * 12)  # far past max_length
    assert len(vocabulary.encode(long_line)) > limit
    lines = normal[:3] + [long_line] + normal[3:]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["translate", metrics["run_dir"], "--beam", "2"]) == 0
    captured = capsys.readouterr()
    outputs = captured.out.split("\n")[:-1]
    assert outputs == translate_lines(model, vocabulary, lines, beam_size=2)
    assert len(outputs) == len(lines)
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: line 4 has {len(vocabulary.encode(long_line)) + 1} tokens, more than the "
        f"model's max_length={limit}; translated whole, quality may suffer",
        f"warning: 1 of {len(lines)} lines were longer than the model's max_length={limit} "
        "tokens and were translated whole",
    ]
    src, ref = tmp_path / "test.src", tmp_path / "test.ref"
    src.write_text("".join(line + "\n" for line in lines))
    ref.write_text("".join(line.upper() + "\n" for line in lines))
    hyp = tmp_path / "test.hyp"
    command = ["evaluate", metrics["run_dir"], "--src", str(src), "--ref", str(ref)]
    assert main([*command, "--output", str(hyp)]) == 0
    captured = capsys.readouterr()
    assert "warning: line 4 has" in captured.err
    with open(hyp) as f:
        assert len(f.read().splitlines()) == len(lines)


@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_the_command_prints_only_its_own_error(how, tmp_path):
    """The real command, as its console script or as `python -m keras_transformer.cli`:
    no TensorFlow start-up lines on stderr, just the message."""
    import subprocess
    import sys

    command = [os.path.join(os.path.dirname(sys.executable), "keras-transformer")]
    if how == "python -m":
        command = [sys.executable, "-m", "keras_transformer.cli"]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run(
        [*command, "translate", str(tmp_path / "missing")],
        input="",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1
    assert done.stderr == f"error: Run directory not found: {tmp_path / 'missing'}\n"
