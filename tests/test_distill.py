"""`keras-transformer distill` on the toy pair: the student's data are the teacher's
translations, a killed run resumes without losing or repeating a line, bad input
gets a clear error."""

import os

import pytest

from keras_transformer.cli import main
from keras_transformer.distill import DistillError, distill

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sources(toy_run, tmp_path_factory):
    _, corpus, _, _ = toy_run
    folder = tmp_path_factory.mktemp("distill-data")
    pairs = corpus.test[:25]
    src, tgt = folder / "train.src", folder / "train.tgt"
    src.write_text(
        "".join(s + "\n" for s, _ in pairs[:12]) + "\n" + "".join(s + "\n" for s, _ in pairs[12:])
    )
    tgt.write_text(
        "".join(t + "\n" for _, t in pairs[:12]) + "\n" + "".join(t + "\n" for _, t in pairs[12:])
    )
    return str(src), str(tgt)


def lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


def test_the_students_data_are_the_teachers_translations(exported, sources, tmp_path):
    _, _, translator, export = exported("float32")
    src, tgt = sources
    out = str(tmp_path / "out")
    assert distill(export, src, out, beam_size=2, chunk_lines=10, parallel=2) == 26
    expected = translator.translate(lines(src), beam_size=2)
    assert lines(os.path.join(out, "train.src")) == lines(src)
    assert lines(os.path.join(out, "train.tgt")) == expected
    assert expected[12] == ""  # an empty line keeps its place
    # With the references, each chunk's original pairs follow its distilled ones.
    both = str(tmp_path / "both")
    distill(export, src, both, tgt=tgt, beam_size=2, chunk_lines=10, parallel=1)
    targets = lines(os.path.join(both, "train.tgt"))
    assert targets[:20] == expected[:10] + lines(tgt)[:10]
    assert targets[-12:] == expected[20:] + lines(tgt)[20:]
    assert len(lines(os.path.join(both, "train.src"))) == 52


class Killed(Exception):
    pass


def test_a_killed_run_resumes_without_losing_or_repeating_a_line(exported, sources, tmp_path):
    _, _, _, export = exported("float32")
    src, _ = sources
    whole = str(tmp_path / "whole")
    distill(export, src, whole, beam_size=2, chunk_lines=10)

    def kill_after_the_first_chunk(done, total):
        raise Killed

    out = str(tmp_path / "out")
    with pytest.raises(Killed):
        distill(export, src, out, beam_size=2, chunk_lines=10, progress=kill_after_the_first_chunk)
    assert len(lines(os.path.join(out, "train.tgt"))) == 10
    # A second chunk half written when the kill came.
    with open(os.path.join(out, "train.tgt"), "a", encoding="utf-8") as f:
        f.write("HALF A CHUNK\nHA")
    assert distill(export, src, out, beam_size=2, chunk_lines=10) == 26
    for name in ("train.src", "train.tgt"):
        with open(os.path.join(out, name), "rb") as f, open(os.path.join(whole, name), "rb") as g:
            assert f.read() == g.read()
    # Another beam into the same folder is refused, not mixed in.
    with pytest.raises(DistillError, match="another beam_size"):
        distill(export, src, out, beam_size=3)


def test_bad_input_gets_a_clear_error(exported, toy_run, sources, tmp_path, capsys):
    _, _, _, export = exported("float32")
    src, tgt = sources
    short = tmp_path / "short.tgt"
    short.write_text("one line\n")
    with pytest.raises(DistillError, match=r"has 26 lines and .* 1: a reference file must pair"):
        distill(export, src, str(tmp_path / "a"), tgt=str(short))
    with pytest.raises(DistillError, match="neither an export .* nor a trained model"):
        distill(str(tmp_path), src, str(tmp_path / "b"))
    with pytest.raises(DistillError, match="does not exist"):
        distill(export, str(tmp_path / "missing.src"), str(tmp_path / "c"))
    used = tmp_path / "used"
    used.mkdir()
    (used / "train.tgt").write_text("x\n")
    with pytest.raises(DistillError, match="no progress.json: not a distillation to resume"):
        distill(export, src, str(used))
    with pytest.raises(SystemExit, match="error: the teacher .* is not a folder"):
        main(["distill", str(tmp_path / "nothing"), "--src", src, "--out", str(tmp_path / "d")])
    # A run directory as the teacher: exported once into the folder, then used.
    out = tmp_path / "from-run"
    run_dir = toy_run[3]["run_dir"]
    flags = ["--src", src, "--out", str(out), "--beam", "1", "--chunk-lines", "100"]
    assert main(["distill", run_dir, *flags]) == 0
    assert os.path.isfile(out / "teacher-onnx" / "manifest.json")
    assert "Wrote the teacher's translations of 26 lines" in capsys.readouterr().out
