"""The ONNX Runtime translator (`keras_transformer_runtime.OnnxTranslator`)
and its command: the same translations as Keras, its sessions and threads, its
inputs and errors, and the distribution installed alone, without TensorFlow."""

import io
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the ONNX tests run once, in the TensorFlow tier (the export itself takes either backend: tests/test_model.py)",
)

from keras_transformer_runtime import ExportFileError, OnnxTranslator  # noqa: E402
from keras_transformer_runtime.export_format import FORMAT_VERSION  # noqa: E402
from keras_transformer_runtime.options import SearchOptions  # noqa: E402
from keras_transformer_runtime.sources import source_array  # noqa: E402
from keras_transformer_runtime.specials import PAD_ID  # noqa: E402
from keras_transformer_runtime.split_batches import length_runs  # noqa: E402

from keras_transformer.decoding import beam_search, greedy_search  # noqa: E402
from keras_transformer.translation import translate_lines  # noqa: E402
from tests.onnx_helpers import (  # noqa: E402
    KINDS,
    held_out_lines,
    source_ids,
    translate_command,
)


@pytest.mark.parametrize("kind", KINDS)
def test_same_translations_as_keras_on_held_out_sentences(kind, exported):
    model, tokenizer, translator, _ = exported(kind)
    lines = held_out_lines(200)
    sources = source_ids(tokenizer, lines)
    keras_greedy, keras_greedy_scores = greedy_search(model, sources)
    onnx_greedy, onnx_greedy_scores = translator.greedy_search(sources)
    # Every one of the 200 alike, but where float32 rounding decides a tie (the
    # engines sum in other orders, and a CPU's kernels choose theirs): there,
    # Keras' own log-probabilities of the two first different tokens agree.
    differ = [
        i
        for i, pair in enumerate(zip(onnx_greedy, keras_greedy, strict=True))
        if pair[0] != pair[1]
    ]
    assert len(differ) <= 2, differ
    for i in differ:
        gap = first_difference_gap(model, sources[i], onnx_greedy[i], keras_greedy[i])
        assert gap < 1e-4, (i, gap)
    same = [i for i in range(len(sources)) if i not in differ]
    np.testing.assert_allclose(
        np.asarray(onnx_greedy_scores)[same], np.asarray(keras_greedy_scores)[same], atol=1e-3
    )

    keras_beam, keras_scores = beam_search(model, sources, beam_size=4)
    onnx_beam, onnx_scores = translator.beam_search(sources, beam_size=4)
    same = np.mean([a == b for a, b in zip(onnx_beam, keras_beam, strict=True)])
    assert same >= 0.99
    np.testing.assert_allclose(onnx_scores, keras_scores, atol=1e-3)

    # The text path: tokenization, batching by length, detokenization.
    texts = lines[:64]
    assert translator.translate(texts, beam_size=1) == translate_lines(
        model, tokenizer, texts, beam_size=1
    )


def first_difference_gap(model, source, a, b):
    """|log p(x | prefix) - log p(y | prefix)| under `model`, where outputs `a` and
    `b` (EOS excluded) first differ, x in `a` and y in `b` (EOS where one ends)."""
    from keras_transformer_runtime.specials import EOS_ID

    from keras_transformer.decoding import sequence_log_probs

    ended_a, ended_b = [*a, EOS_ID], [*b, EOS_ID]
    at = next(p for p, (x, y) in enumerate(zip(ended_a, ended_b, strict=False)) if x != y)
    prefix = list(a[:at])
    scored = [
        sequence_log_probs(model, [source], [prefix], ended=True)[0]
        if token == EOS_ID
        else sequence_log_probs(model, [source], [[*prefix, token]], ended=False)[0]
        for token in (ended_a[at], ended_b[at])
    ]
    return abs(scored[0] - scored[1])


def test_runtime_imports_neither_tensorflow_nor_keras(exported):
    """A fresh interpreter translates through the module CLI without loading either."""
    out = exported("mixed_bfloat16")[3]
    code = (
        "import io, sys\n"
        "sys.stdin = io.StringIO('ka ko\\n\\nli lo mina\\n')\n"
        "from keras_transformer_runtime.translate import main\n"
        f"main([{out!r}, '--beam', '2'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stderr
    lines = result.stdout.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # one line per input line


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


HEAVY = {"tensorflow", "tensorflow-cpu", "tensorflow-text", "tf2onnx", "keras", "jax", "jaxlib"}


def test_runtime_distribution_alone_translates_without_tensorflow(exported, tmp_path):
    """A fresh venv that installs only ./runtime holds no TensorFlow, Keras or JAX and
    translates an export through its console script, as the in-process runtime does."""
    _, _, translator, out = exported("mixed_bfloat16")
    venv = tmp_path / "runtime-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip", "--python", python]
    installed = subprocess.run(
        [*pip, "install", "--quiet", os.path.join(ROOT, "runtime")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert installed.returncode == 0, installed.stderr
    listed = subprocess.run(
        [*pip, "list", "--format=freeze"], capture_output=True, text=True, env=env, check=True
    )
    names = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert "keras-transformer-runtime" in names and "sentencepiece" in names
    assert not names & HEAVY, sorted(names & HEAVY)
    assert "keras-transformer" not in names
    lines = held_out_lines(24, seed=47)
    result = subprocess.run(
        [str(venv / "bin" / "keras-transformer-translate"), out, "--beam", "2", "--cpu"],
        input="".join(line + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == translator.translate(lines, beam_size=2)


def test_module_command_translates_stdin_in_order(exported):
    model, tokenizer, _, out = exported("float32")
    lines = held_out_lines(40, seed=43)
    result = translate_command(out, lines, "--beam", "1")
    assert result.returncode == 0, result.stderr
    assert "provider: CPUExecutionProvider" in result.stderr or "CUDA" in result.stderr
    assert result.stdout.splitlines() == translate_lines(model, tokenizer, lines, beam_size=1)


def test_search_graphs_spin_and_the_encoder_sleeps(exported):
    """The sessions of the graphs that run decoder steps let their idle worker
    threads spin and the encoder's sleep, and in float32 the greedy batch
    graph's sleep too; the float16 greedy batch graph's spin."""
    from keras_transformer_runtime.onnx_sessions import SLEEPING_FLOAT32_GRAPHS, SPINNING_GRAPHS

    _, _, _, out = exported("float32")
    graphs = ("encoder", "decoder_step", "greedy_search", "greedy_batch_search", "beam_search")
    graphs += ("beam_batch_search",)
    assert set(SPINNING_GRAPHS) == set(graphs) - {"encoder"}
    assert set(SLEEPING_FLOAT32_GRAPHS) == {"greedy_batch_search"}
    translator = OnnxTranslator(out, providers=["CPUExecutionProvider"], num_threads=2)
    found = {
        name: translator.decoder.session(name)
        .get_session_options()
        .get_session_config_entry("session.intra_op.allow_spinning")
        for name in graphs
    }
    assert found == {**dict.fromkeys(graphs, "1"), "encoder": "0", "greedy_batch_search": "0"}
    half = OnnxTranslator(out, providers=["CPUExecutionProvider"], precision="float16")
    options = half.decoder.session("greedy_batch_search").get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    with pytest.raises(TypeError, match="spinning"):
        OnnxTranslator(out, spinning=False)


def test_length_runs_cut_a_batch_into_parts_that_end_together():
    rng = np.random.default_rng(4)
    lengths = rng.integers(3, 60, 32)

    def longest_part(runs, step_rows=8):
        return max((len(run) + step_rows) * lengths[run].max() for run in runs)

    for parts in (2, 3, 4):
        runs = length_runs(lengths, parts, step_rows=8)
        assert len(runs) == parts and all(len(run) for run in runs)
        # Every sentence once, each run a range of the lengths, shortest first.
        assert sorted(np.concatenate(runs).tolist()) == list(range(32))
        for shorter, longer in zip(runs, runs[1:], strict=False):
            assert lengths[shorter].max() <= lengths[longer].min()
        # Shorter than dealing the sentences out in turn, and no cut does better.
        order = np.argsort(lengths, kind="stable")
        assert longest_part(runs) < longest_part([order[j::parts] for j in range(parts)])
        if parts == 2:
            best = min(longest_part([order[:k], order[k:]]) for k in range(1, 32))
            assert longest_part(runs) == pytest.approx(best, rel=1e-6)
    # Equal lengths: equal halves; more parts than sentences: one sentence each.
    assert [len(run) for run in length_runs([7] * 10, 2)] == [5, 5]
    assert [run.tolist() for run in length_runs([5, 2, 9], 4)] == [[1], [0], [2]]


def test_a_batch_searches_as_one_part_per_thread(exported, monkeypatch, capsys):
    """On the CPU with several threads, a batch with enough decoder rows runs as
    one search per thread, each part on a one-thread translator of its own, the
    parts at once: the same tokens and scores as the whole batch, in input order.
    How many parts: one per thread or none; each of at least `SPLIT_MIN_ROWS`
    rows, or with `split_batches=True` one sentence; never with `False` (int8:
    `test_int8_graphs_are_smaller_and_translate_no_worse_than_float32`)."""
    import threading

    from keras_transformer_runtime.onnx_decoder import SPLIT_MIN_ROWS

    _, tokenizer, _, out = exported("float32")
    assert SPLIT_MIN_ROWS == 8
    cpu = ["CPUExecutionProvider"]
    two = OnnxTranslator(out, providers=cpu, num_threads=2)
    four = OnnxTranslator(out, providers=cpu, num_threads=4)
    assert [two.decoder.split_parts(n) for n in (1, 8, 15, 16, 40)] == [1, 1, 1, 2, 2]
    assert [two.decoder.split_parts(n, beam_size=4) for n in (1, 2, 3, 4)] == [1, 1, 1, 2]
    assert [four.decoder.split_parts(n) for n in (16, 31, 32, 64)] == [
        1,
        1,
        4,
        4,
    ]  # all threads or none
    forced = OnnxTranslator(out, providers=cpu, num_threads=2, split_batches=True)
    assert [forced.decoder.split_parts(n) for n in (1, 2, 3)] == [1, 2, 2]
    forced_four = OnnxTranslator(out, providers=cpu, num_threads=4, split_batches=True)
    assert [forced_four.decoder.split_parts(n) for n in (3, 4)] == [1, 4]
    whole = OnnxTranslator(out, providers=cpu, num_threads=2, split_batches=False)
    assert whole.decoder.split_parts(64, beam_size=4) == 1
    assert (
        OnnxTranslator(out, providers=cpu, num_threads=1).decoder.split_parts(64, beam_size=4) == 1
    )

    lines = held_out_lines(19, seed=61)
    lines[4] = ""  # an empty source in one part
    sources = source_ids(tokenizer, lines)
    sources[4] = []
    calls = []
    for search, beam in (("greedy_search", 1), ("beam_search", 3)):
        kwargs = {} if beam == 1 else {"beam_size": beam}
        expected_tokens, expected_scores = getattr(whole, search)(sources, **kwargs)
        for translator in (two, forced):
            tokens, scores = getattr(translator, search)(sources, **kwargs)
            assert tokens == expected_tokens, (search, translator.decoder._split)
            np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=1e-5)
        workers = two.decoder._split_workers
        assert len(workers) == 2  # made once, kept
        assert all(w.threads() == 1 and w.split_parts(64, 4) == 1 for w in workers)
        method_name = "greedy" if beam == 1 else "beam"
        for worker in workers:
            options = worker.session("encoder").get_session_options()
            assert options.intra_op_num_threads == 1
            method = getattr(worker, method_name)

            def record(rows, *args, _method=method, _search=search, **kw):
                calls.append((_search, len(rows), threading.current_thread()))
                # Each part is as wide as its own longest source, no wider.
                assert rows.shape[1] == max(1, (rows != PAD_ID).sum(1).max())
                return _method(rows, *args, **kw)

            setattr(worker, method_name, record)
        assert getattr(two, search)(sources, **kwargs)[0] == expected_tokens
    # Each search: two parts, runs of the sentences in order of length, one on another thread.
    _, lengths = source_array(sources, whole.max_length, multiple=1)  # as the search sees them
    expected_rows = sorted(len(run) for run in length_runs(lengths, 2))
    for search in ("greedy_search", "beam_search"):
        parts = [(rows, thread) for name, rows, thread in calls if name == search]
        assert sorted(rows for rows, _ in parts) == expected_rows
        assert {thread is threading.current_thread() for _, thread in parts} == {True, False}

    # The runtime command: `--whole-batches` keeps batches whole, the same lines.
    from keras_transformer_runtime import translate as runtime_command

    made = []

    class Recording(OnnxTranslator):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("split_batches"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(runtime_command, "OnnxTranslator", Recording)
    expected = two.translate(lines, beam_size=3)
    capsys.readouterr()  # what the fixtures printed
    for flags, split in (([], None), (["--whole-batches"], False)):
        monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
        assert runtime_command.main([out, "--cpu", "--threads", "2", "--beam", "3", *flags]) == 0
        assert capsys.readouterr().out.splitlines() == expected
        assert made[-1] is split


def test_parallel_batches_translate_as_one_batch_at_a_time(exported):
    """Several batches searched at once (beam searches each on a translator copy
    with sessions of its own, made once and kept; greedy ones on shared sessions):
    every line gets the translation it gets alone, in input order, through the
    Python API and the command; a count below 1 is refused by name."""
    _, _, translator, out = exported("mixed_bfloat16")
    lines = held_out_lines(90, seed=53)
    one_thread = OnnxTranslator(out, providers=["CPUExecutionProvider"], num_threads=1)
    for beam in (1, 3):
        alone = translator.translate(lines, beam_size=beam, batch_size=8)
        assert (
            one_thread.translate(lines, beam_size=beam, batch_size=8, parallel_batches=3) == alone
        )
    decoder = one_thread.decoder
    copies = decoder.parallel(3, beam_size=3)
    assert copies[0] is decoder and len(copies) == 3 and decoder._copies == copies[1:]
    encoders = {id(d.session("encoder")) for d in copies}
    assert len(encoders) == 3  # no session shared between two beam searches
    assert decoder.parallel(3, beam_size=2) == copies  # kept, not made again
    assert decoder.parallel(3, beam_size=1) == [decoder] * 3
    # With any option set, batches still run at once, each on its own decoder:
    # n-best lists in the beam graphs, a repetition penalty in the step loop.
    for options, method in (
        (SearchOptions(beam_size=3, n_best=2, token_scores=True), "run_beam_graph"),
        (SearchOptions(beam_size=3, n_best=2, repetition_penalty=1.2, token_scores=True), "start"),
    ):
        used = []
        for copy in copies:
            run = getattr(copy, method)
            setattr(
                copy,
                method,
                lambda *a, _run=run, _copy=copy, _used=used: _used.append(_copy) or _run(*a),
            )
        found = one_thread.translate_hypotheses(lines, options, batch_size=8, parallel_batches=3)
        for copy in copies:
            delattr(copy, method)
        assert len({id(d) for d in used}) >= 2, method
        # The same hypotheses as one batch at a time on two threads (whose batches
        # split into parts by length: the scores agree to float32 round-off).
        expected = translator.translate_hypotheses(lines, options, batch_size=8)
        assert [[h["text"] for h in row] for row in found] == [
            [h["text"] for h in row] for row in expected
        ]
        for row, expected_row in zip(found, expected, strict=True):
            for h, e in zip(row, expected_row, strict=True):
                assert h["score"] == pytest.approx(e["score"], abs=1e-5)
                np.testing.assert_allclose(h["token_scores"], e["token_scores"], atol=1e-5)
    with pytest.raises(ValueError, match="parallel_batches must be a positive integer"):
        translator.translate(lines, parallel_batches=0)

    def command(*flags):
        return translate_command(out, lines, *flags)

    done = command("--beam", "2", "--batch-size", "8", "--parallel-batches", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == translator.translate(lines, beam_size=2, batch_size=8)
    refused = command("--parallel-batches", "0")
    assert refused.returncode != 0 and "--parallel-batches must be a positive integer" in (
        refused.stderr
    )


def test_length_penalty_reaches_the_runtime_search_as_in_keras(exported):
    """`--length-penalty` of the runtime command: the beam outputs of Keras at that
    alpha, a large alpha lengthens them, and a negative one is refused by name."""
    model, tokenizer, _, out = exported("float32")
    lines = held_out_lines(40, seed=47)

    def command(*flags):
        return translate_command(out, lines, *flags)

    long_ones = command("--beam", "3", "--length-penalty", "4")
    assert long_ones.returncode == 0, long_ones.stderr
    keras_long = translate_lines(model, tokenizer, lines, beam_size=3, length_penalty=4.0)
    assert long_ones.stdout.splitlines() == keras_long
    keras_short = translate_lines(model, tokenizer, lines, beam_size=3, length_penalty=0.0)
    assert sum(map(len, keras_long)) > sum(map(len, keras_short))
    refused = command("--length-penalty", "-1")
    assert refused.returncode != 0
    assert "--length-penalty must be a non-negative number" in refused.stderr


def test_empty_inputs_and_unseen_characters(exported):
    _, _, translator, _ = exported("mixed_bfloat16")  # SentencePiece with byte fallback
    assert translator.translate([]) == []
    assert translator.translate(["", "   "]) == ["", ""]
    outputs = translator.translate(["ka 漢字 ko 🙂 ñandú", "ka ko"], beam_size=2)
    assert len(outputs) == 2 and all(isinstance(o, str) for o in outputs)
    _, _, words, _ = exported("float32")  # word vocabulary: unknown words become <unk>
    assert len(words.translate(["ka zzzz ko"], beam_size=1)) == 1


def test_bad_runtime_inputs_raise_clear_errors(exported):
    _, _, translator, _ = exported("float32")
    source = np.array([[5, 6, 2]], np.int32)
    with pytest.raises(ValueError, match="integer token ids"):
        translator.decoder.encode(source.astype(np.float32))
    with pytest.raises(ValueError, match="rank 2"):
        translator.decoder.encode(source[0])
    _, mask, cross = translator.decoder.encode(source)
    caches = translator.decoder.empty_self_caches(1)
    with pytest.raises(ValueError, match=r"token_ids must have shape \(batch, 1\)"):
        translator.decoder.decoder_step(np.array([[1, 1]]), mask, cross, caches)
    with pytest.raises(ValueError, match="source_mask must be a bool"):
        translator.decoder.decoder_step(np.array([[1]]), mask.astype(np.int32), cross, caches)
    with pytest.raises(ValueError, match="self_key_0 must be float32"):
        translator.decoder.decoder_step(
            np.array([[1]]), mask, cross, [c.astype(np.float64) for c in caches]
        )
    with pytest.raises(ValueError, match="cross_value_0 must have shape"):
        translator.decoder.decoder_step(
            np.array([[1]]), mask, [cross[0], cross[1][..., :2], *cross[2:]], caches
        )
    with pytest.raises(ValueError, match="Expected 4 self-attention arrays"):
        translator.decoder.decoder_step(np.array([[1]]), mask, cross, caches[:1])
    log_probs, grown = translator.decoder.decoder_step(np.array([[1]]), mask, cross, caches)
    assert log_probs.shape == (1, translator.vocabulary_size) and grown[0].shape[2] == 1
    with pytest.raises(ValueError, match="beam_size must be a positive integer"):
        translator.translate(["ka"], beam_size=0)
    with pytest.raises(TypeError, match="list of strings"):
        translator.translate("ka ko")


def test_over_long_lines_translate_as_in_keras_with_a_warning(exported):
    """Past max_length the graphs compute their positions as Keras does: a long line
    among normal ones is translated like Keras, and the command warns and goes on."""
    model, tokenizer, translator, out = exported("mixed_bfloat16")
    normal = held_out_lines(6, seed=53)
    long_line = " ".join(normal * 10)
    tokens = len(tokenizer.encode(long_line)) + 1  # with EOS
    assert tokens > translator.max_length
    lines = normal[:2] + [long_line] + normal[2:]
    for beam in (1, 3):
        expected = translate_lines(model, tokenizer, lines, beam_size=beam)
        assert translator.translate(lines, beam_size=beam) == expected
    result = translate_command(out, lines, "--beam", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == translator.translate(lines, beam_size=1)
    assert "Traceback" not in result.stderr
    assert (
        f"warning: line 3 has {tokens} tokens, more than the model's "
        f"max_length={translator.max_length}; translated whole" in result.stderr
    )
    assert f"warning: 1 of {len(lines)} lines were longer than" in result.stderr


@pytest.mark.parametrize(
    "damage,match",
    [
        ("missing:decoder_step.onnx", "ONNX graph missing: .*decoder_step.onnx"),
        ("corrupt:encoder.onnx", "Cannot load the ONNX graph .*encoder.onnx"),
        ("missing:weights.bin", "weights.bin missing from .*copy the whole export folder"),
        ("corrupt:weights.bin", "weights.bin has 23 bytes, not the [0-9]+ the export wrote"),
        ("missing:manifest.json", "manifest.json missing"),
        ("corrupt:manifest.json", "manifest.json is not a valid export manifest"),
        ("missing:vocab.txt", "Tokenizer file missing: .*vocab.txt"),
        ("missing:spm.model", "Tokenizer file missing: .*spm.model"),
        ("corrupt:spm.model", "Cannot read the tokenizer .*spm.model: not a SentencePiece model"),
    ],
)
def test_damaged_export_folders_name_the_file(exported, tmp_path, damage, match):
    import shutil

    action, name = damage.split(":")
    copy = tmp_path / "copy"
    kind = "mixed_bfloat16" if name == "spm.model" else "float32"
    shutil.copytree(exported(kind)[3], copy)
    if action == "missing":
        (copy / name).unlink()
    else:
        (copy / name).write_bytes(b"\x00 not what it should be")
    with pytest.raises(ExportFileError, match=match):
        OnnxTranslator(copy)
    result = translate_command(copy, ["ka"])
    assert result.returncode != 0 and "error:" in result.stderr and name in result.stderr
    assert "Traceback" not in result.stderr


def _manifest_folder(tmp_path, **fields):
    """A folder with only a manifest: the format is checked before any graph is read."""
    folder = tmp_path / "export"
    folder.mkdir()
    manifest = {"graphs": {}, "config": {}, "precisions": ["float32"], **fields}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize(
    "version,words",
    [
        (FORMAT_VERSION - 1, f"format_version {FORMAT_VERSION - 1}, older than the format_version {FORMAT_VERSION}"),
        (1, f"format_version 1, older than the format_version {FORMAT_VERSION}"),
        (FORMAT_VERSION + 1, f"format_version {FORMAT_VERSION + 1}, newer than the format_version {FORMAT_VERSION}"),
        (None, f"has no format_version .* reads format_version {FORMAT_VERSION}"),
        ("5", f"format_version '5', not a whole number; .* reads format_version {FORMAT_VERSION}"),
    ],
)  # fmt: skip
def test_exports_of_another_format_version_are_refused_with_how_to_re_export(
    tmp_path, version, words
):
    fields = {} if version is None else {"format_version": version}
    folder = _manifest_folder(tmp_path, **fields)
    with pytest.raises(ExportFileError, match=words) as refused:
        OnnxTranslator(folder, providers=["CPUExecutionProvider"])
    assert "re-export the run with `keras-transformer export" in str(refused.value)
    assert "manifest.json" in str(refused.value)
    result = translate_command(folder, ["ka"])
    assert result.returncode != 0 and "keras-transformer export" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_exporter_writes_the_format_version_the_runtime_reads(tmp_path):
    from keras_transformer.export import onnx as exporter

    assert exporter.FORMAT_VERSION == FORMAT_VERSION
    # A manifest of this version gets past the check, to what it lacks next.
    folder = _manifest_folder(tmp_path, format_version=FORMAT_VERSION)
    with pytest.raises(ExportFileError, match="lists no float32 weights file"):
        OnnxTranslator(folder, providers=["CPUExecutionProvider"])
