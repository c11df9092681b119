"""`import marian` and `export --format marian-hf` without PyTorch: checkpoints
written with numpy and safetensors (tests/pretrained/marian_dirs.py), the
tokenizer in Python and in tf.data, the ONNX export of an imported model,
the round trip, and the refusals. The comparisons against transformers
itself are in test_marian_transformers.py (the `pretrained` tier)."""

import json
import os

import keras
import numpy as np
import pytest

from keras_transformer import cli
from keras_transformer.pretrained.marian import MarianImportError, from_marian, import_marian
from tests.pretrained.marian_dirs import SOURCE_EXTRA, TARGET_EXTRA, VARIANTS, numpy_checkpoint

TEXTS = SOURCE_EXTRA + ["ka ko ☃ mina", "ko tel", "eine Straße ✈ über"]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def marian_dir(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    numpy_checkpoint(folder, request.param)
    return folder


def test_the_tokenizer_gives_marians_ids_in_our_numbering(marian_dir):
    import sentencepiece as spm

    _, tokenizer = from_marian(marian_dir)
    with open(os.path.join(marian_dir, "vocab.json")) as f:
        vocabulary = json.load(f)
    source = spm.SentencePieceProcessor(model_file=os.path.join(marian_dir, "source.spm"))
    for text in TEXTS:
        # Marian's ids: the source model's pieces looked up in vocab.json, <unk> if absent.
        expected = [
            vocabulary.get(p, vocabulary["<unk>"]) for p in source.encode(text, out_type=str)
        ]
        ids = tokenizer.encode(text)
        assert tokenizer.to_marian(ids, "source") == expected
        assert 0 not in ids and 1 not in ids  # our padding and BOS never come from text
    assert 3 in tokenizer.encode("ka ☃")  # an unseen character is <unk>
    # Our BOS is Marian's decoder start, <pad>; EOS </s>; UNK <unk>.
    assert tokenizer.to_marian([1, 2, 3]) == [
        tokenizer.target.vocabulary[p] for p in ("<pad>", "</s>", "<unk>")
    ]
    target = tokenizer.encode_target(TARGET_EXTRA[0])
    assert tokenizer.decode(target + [2, 7]) == TARGET_EXTRA[0]


def test_attention_plots_name_source_ids_by_the_source_vocabulary(tmp_path):
    """Separate vocabularies number source and target pieces apart: a plot's columns
    are the source model's pieces (<unk> where vocab.json lacks one)."""
    import sentencepiece as spm

    from keras_transformer.plotting import attention_figure_data

    marian_dir = str(tmp_path)
    numpy_checkpoint(marian_dir, "gelu-separate-bias")
    model, tokenizer = from_marian(marian_dir)
    with open(os.path.join(marian_dir, "vocab.json")) as f:
        vocabulary = json.load(f)
    source = spm.SentencePieceProcessor(model_file=os.path.join(marian_dir, "source.spm"))
    text = TEXTS[-1]
    _, columns, _, _ = attention_figure_data(model, tokenizer, text, beam_size=1)
    pieces = source.encode(text, out_type=str)
    assert columns == [p if p in vocabulary else "<unk>" for p in pieces] + ["</s>"]


def test_the_tf_data_tokenizer_gives_the_python_ids(marian_dir):
    import tensorflow as tf

    if keras.backend.backend() != "tensorflow":
        pytest.skip("tf.data tokenization")
    _, tokenizer = from_marian(marian_dir)
    for side, encode in (("source", tokenizer.encode), ("target", tokenizer.encode_target)):
        ragged = tokenizer.tf_tokenizer(side=side).tokenize(tf.constant(TEXTS[:-1]))
        assert ragged.to_list() == [encode(t) for t in TEXTS[:-1]]


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="ONNX export")
def test_an_imported_model_exports_and_onnx_runtime_matches_keras(tmp_path):
    """One variant with most options (separate vocabularies, GELU, an output bias):
    the graphs of each option alone are tests/export/test_onnx.py's MODEL_SHAPES."""
    from keras_transformer_runtime import OnnxTranslator
    from keras_transformer_runtime.options import SearchOptions

    from keras_transformer.decoding import translator

    marian_dir = str(tmp_path / "marian")
    numpy_checkpoint(marian_dir, "gelu-separate-bias")
    run = str(tmp_path / "run")
    import_marian(marian_dir, run)
    out = str(tmp_path / "onnx")
    assert cli.main(["export", run, "--out", out, "--precision", "int8"]) == 0
    assert {"source.spm", "target.spm", "vocab.json"} <= set(os.listdir(out))
    model, tokenizer = from_marian(marian_dir)
    keras_side = translator(model, tokenizer)
    onnx_side = OnnxTranslator(out)
    for beam in (1, 3):
        expected = keras_side.translate(TEXTS, beam_size=beam, max_length=12)
        assert onnx_side.translate(TEXTS, beam_size=beam, max_length=12) == expected
    # transformers' length penalty (the step loop: the beam graphs have GNMT's).
    average = SearchOptions(beam_size=3, length_penalty=1.0, length_penalty_form="average")
    expected = keras_side.translate_hypotheses(TEXTS, average)
    found = onnx_side.translate_hypotheses(TEXTS, average)
    assert [h[0]["text"] for h in found] == [h[0]["text"] for h in expected]
    # Forced scores of the same pairs agree within float32 noise.
    targets = TARGET_EXTRA + ["A", "B C", "D"]
    ours = [s["log_prob"] for s in onnx_side.score(TEXTS, targets)]
    theirs = [s["log_prob"] for s in keras_side.score(TEXTS, targets)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-3)
    int8 = OnnxTranslator(out, precision="int8").translate(TEXTS, beam_size=1, max_length=12)
    assert len(int8) == len(TEXTS)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="saving a run")
def test_import_then_export_gives_back_the_same_checkpoint(marian_dir, tmp_path):
    from safetensors.numpy import load_file

    run, back = str(tmp_path / "run"), str(tmp_path / "back")
    assert cli.main(["import", "marian", marian_dir, "--out", run]) == 0
    assert {"model.keras", "vocab.json", "source.spm", "target.spm"} <= set(os.listdir(run))
    assert cli.main(["export", run, "--format", "marian-hf", "--out", back]) == 0
    original = load_file(os.path.join(marian_dir, "model.safetensors"))
    written = load_file(os.path.join(back, "model.safetensors"))
    assert set(written) == set(original)
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    with open(os.path.join(marian_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(back, "config.json")) as f:
        written_config = json.load(f)
    for key in (
        "d_model",
        "activation_function",
        "scale_embedding",
        "vocab_size",
        "decoder_vocab_size",
        "share_encoder_decoder_embeddings",
        "pad_token_id",
    ):
        assert written_config[key] == config[key], key
    for name in ("source.spm", "target.spm", "vocab.json"):
        with (
            open(os.path.join(marian_dir, name), "rb") as a,
            open(os.path.join(back, name), "rb") as b,
        ):
            if name.endswith(".spm"):
                assert a.read() == b.read()
            else:
                assert json.load(a) == json.load(b)


def _broken(tmp_path, edit):
    folder = str(tmp_path / "marian")
    numpy_checkpoint(folder, "relu-shared-bias")
    edit(folder)
    return folder


def _edit_config(**changes):
    def edit(folder):
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        config.update(changes)
        with open(path, "w") as f:
            json.dump(config, f)

    return edit


def _truncate(folder):
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda f: os.remove(os.path.join(f, "vocab.json")), "vocab.json"),
        (lambda f: os.remove(os.path.join(f, "model.safetensors")), "no weights"),
        (lambda f: os.remove(os.path.join(f, "config.json")), "no config.json"),
        (_edit_config(model_type="bart"), "model_type='bart'"),
        (_edit_config(activation_function="gelu_new"), "activation_function='gelu_new'"),
        (_edit_config(vocab_size=12), "vocab_size=12"),
        (_edit_config(normalize_before=True), "normalize_before=True"),
        (_edit_config(decoder_ffn_dim=96), "decoder_ffn_dim=96"),
        (_edit_config(d_model=32), "the model its config.json describes needs"),
        (_truncate, "not a whole safetensors file"),
    ],
)
def test_bad_checkpoints_are_refused_by_name_and_leave_nothing(edit, message, tmp_path, capsys):
    folder = _broken(tmp_path, edit)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as raised:
        cli.main(["import", "marian", folder, "--out", str(out)])
    assert message in str(raised.value)
    assert str(raised.value).startswith("error: ")
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".run")] == []


def test_an_existing_run_is_not_overwritten_without_asking(tmp_path):
    folder = str(tmp_path / "marian")
    numpy_checkpoint(folder, "swish-shared-nobias")
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(MarianImportError, match="not empty"):
        import_marian(folder, str(out))
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="saving a run")
def test_a_run_of_our_own_is_refused_by_marian_hf_export(tmp_path):
    from keras_transformer.config import TransformerConfig
    from keras_transformer.model import build_transformer

    run = tmp_path / "run"
    run.mkdir()
    build_transformer(TransformerConfig.from_preset("tiny")).save(str(run / "model.keras"))
    (run / "vocab.txt").write_text("\n".join(["<pad>", "<s>", "</s>", "<unk>", "a"]) + "\n")
    with pytest.raises(SystemExit, match="no Marian tokenizer"):
        cli.main(["export", str(run), "--format", "marian-hf", "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()


@pytest.mark.integration
@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="training and export")
def test_fine_tuning_an_imported_model_changes_weights_keeps_the_tokenizer_and_deploys(tmp_path):
    from keras_transformer.data.toy import generate_toy_corpus
    from keras_transformer.model import transformer_parts
    from keras_transformer.pretrained.marian_weights import marian_state
    from keras_transformer.translation import load_run
    from tests.onnx_helpers import translate_command

    folder = str(tmp_path / "marian")
    numpy_checkpoint(folder, "swish-shared-nobias")
    files = generate_toy_corpus(num_train=120, num_valid=10, num_test=5, seed=2).write(
        str(tmp_path / "corpus")
    )
    imported, tuned = str(tmp_path / "imported"), str(tmp_path / "tuned")
    assert cli.main(["import", "marian", folder, "--out", imported]) == 0
    args = ["train", "--init-from", imported, "--out", tuned, "--max-steps", "3"]
    args += ["--learning-rate", "1e-3", "--warmup-steps", "1", "--precision", "float32"]
    args += ["--src-train", files["train.src"], "--tgt-train", files["train.tgt"]]
    args += ["--src-valid", files["valid.src"], "--tgt-valid", files["valid.tgt"]]
    assert cli.main(args) == 0
    for name in ("source.spm", "target.spm", "vocab.json"):
        with (
            open(os.path.join(folder, name), "rb") as a,
            open(os.path.join(tuned, name), "rb") as b,
        ):
            assert a.read() == b.read(), name
    assert not os.path.exists(os.path.join(tuned, "spm.model"))  # no tokenizer trained
    before, after = load_run(imported)[0], load_run(tuned)[0]
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(before.get_weights(), after.get_weights(), strict=True)
    ]
    assert sum(changed) > len(changed) // 2
    back, onnx_dir = str(tmp_path / "back"), str(tmp_path / "onnx")
    assert cli.main(["export", tuned, "--format", "marian-hf", "--out", back]) == 0
    assert cli.main(["import", "marian", back, "--out", str(tmp_path / "again")]) == 0
    # Everything Marian has survives the way back (our padding row is ours alone).
    again, tokenizer = load_run(str(tmp_path / "again"))
    tuned_state = marian_state(transformer_parts(after), tokenizer)
    for name, value in marian_state(transformer_parts(again), tokenizer).items():
        np.testing.assert_array_equal(value, tuned_state[name], err_msg=name)
    assert cli.main(["export", tuned, "--out", onnx_dir]) == 0
    result = translate_command(onnx_dir, ["ka ko mina", "tel"])
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    # Served: the server's answers are the translator's.
    from keras_transformer_runtime import OnnxTranslator

    from tests.runtime.test_serve import Server, post

    expected = OnnxTranslator(onnx_dir).translate(["ka ko mina", "tel"], beam_size=2)
    server = Server(onnx_dir, log_dir=str(tmp_path))
    try:
        status, answer, _ = post(server.port, {"texts": ["ka ko mina", "tel"], "beam_size": 2})
    finally:
        server.stop()
    assert status == 200, answer
    assert answer["translations"] == expected


def test_a_native_marian_release_imports_and_translates_as_ctranslate2_does(tmp_path):
    """Marian's own format (model.npz, decoder.yml, vocab.yml), against CTranslate2's
    OpusMTConverter on the same folder (numpy alone: no Marian, no PyTorch)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from keras_transformer.decoding import translator
    from tests.pretrained.marian_dirs import native_release

    folder = str(tmp_path / "release")
    native_release(folder, "swish")  # OPUS-MT's activation
    model, tokenizer = from_marian(folder)
    converted = str(tmp_path / "ct2")
    ctranslate2.converters.OpusMTConverter(folder).convert(converted)
    reference = ctranslate2.Translator(converted, device="cpu", intra_threads=1)
    ours = translator(model, tokenizer)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        pieces = [tokenizer.source.pieces[i] for i in ids]  # CTranslate2 adds EOS
        for beam in (1, 4):
            found = reference.translate_batch(
                [pieces], beam_size=beam, max_decoding_length=10, length_penalty=0
            )[0].hypotheses[0]
            expected = [tokenizer.piece_to_id(p) for p in found]
            hypothesis = ours.search([ids + [2]], _options(beam, 10))[0][0].tokens
            assert [i for i in hypothesis if i != 2] == expected, (text, beam)


def _options(beam, max_length):
    from keras_transformer_runtime.options import SearchOptions

    return SearchOptions(beam_size=beam, max_length=max_length, length_penalty=0.0)


def test_a_native_release_with_options_this_project_does_not_build_is_refused(tmp_path):
    import yaml

    from tests.pretrained.marian_dirs import native_release

    folder = str(tmp_path / "release")
    native_release(folder)
    path = os.path.join(folder, "opus.model1.npz")
    tensors = dict(np.load(path))
    options = yaml.safe_load(tensors["special:model.yml"][:-1].tobytes())
    options["transformer-preprocess"] = "n"
    tensors["special:model.yml"] = np.frombuffer(yaml.safe_dump(options).encode() + b"\0", np.int8)
    np.savez(path, **tensors)
    with pytest.raises(SystemExit, match="transformer-preprocess='n' is not supported"):
        cli.main(["import", "marian", folder, "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


@pytest.mark.integration  # three child processes, each loading TensorFlow
@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="saving a run")
def test_the_marian_shape_benchmark_builds_a_directory_that_imports_and_measures_its_cost(
    tmp_path,
):
    from benchmarks.marian_shape import main
    from tests.pretrained.marian_dirs import SOURCE_EXTRA, TARGET_EXTRA

    sources, targets = tmp_path / "src.txt", tmp_path / "tgt.txt"
    sources.write_text("\n".join(SOURCE_EXTRA * 20) + "\n")
    targets.write_text("\n".join(TARGET_EXTRA * 20) + "\n")
    folder = str(tmp_path / "hf")
    args = ["build", folder, "--src-train", str(sources), "--tgt-train", str(targets)]
    args += ["--vocab-size", "40", "--hidden-dim", "32", "--layers", "2", "1"]
    main(args + ["--intermediate-dim", "64", "--heads", "4", "--total-vocabulary", "300"])
    model, tokenizer = from_marian(folder)
    assert len(tokenizer) == 301  # 300 of Marian's pieces and our padding row
    assert transformer_parts_config(model).num_decoder_layers == 1
    out = str(tmp_path / "cost.json")
    main(["cost", folder, "--out", out])
    with open(out) as f:
        report = json.load(f)
    assert set(report["steps"]) == {"baseline", "import", "export_marian_hf"}
    assert all(step["peak_rss_mib"] > 0 for step in report["steps"].values())


def transformer_parts_config(model):
    from keras_transformer.model import transformer_parts

    return transformer_parts(model).config


@pytest.mark.integration
@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="training")
def test_fine_tuning_on_prepared_data_encoded_with_the_imported_tokenizer(tmp_path):
    from keras_transformer.data.shards import PreparedData
    from keras_transformer.data.toy import generate_toy_corpus

    folder = str(tmp_path / "marian")
    numpy_checkpoint(folder, "relu-shared-bias")
    files = generate_toy_corpus(num_train=150, num_valid=10, num_test=5, seed=3).write(
        str(tmp_path / "corpus")
    )
    imported, data = str(tmp_path / "imported"), str(tmp_path / "data")
    assert cli.main(["import", "marian", folder, "--out", imported]) == 0
    args = ["prepare", "--src-train", files["train.src"], "--tgt-train", files["train.tgt"]]
    args += ["--src-valid", files["valid.src"], "--tgt-valid", files["valid.tgt"]]
    assert cli.main([*args, "--out", data, "--tokenizer-from", imported, "--workers", "1"]) == 0
    prepared = PreparedData(data)
    _, tokenizer = from_marian(folder)
    shard = np.load(os.path.join(data, prepared.manifest["shards"][0]["name"], "source.npy"))
    first = tokenizer.encode(open(files["train.src"], encoding="utf-8").readline().rstrip("\n"))
    assert shard[: len(first)].tolist() == first  # Marian's source ids, renumbered as ours
    tuned = str(tmp_path / "tuned")
    args = ["train", "--init-from", imported, "--data", data, "--out", tuned, "--max-steps", "2"]
    assert cli.main([*args, "--learning-rate", "1e-4", "--precision", "float32"]) == 0
    assert os.path.isfile(os.path.join(tuned, "vocab.json"))
    # Data prepared with another tokenizer is refused before anything is written.
    other = str(tmp_path / "other")
    args = ["prepare", "--src-train", files["train.src"], "--tgt-train", files["train.tgt"]]
    assert cli.main([*args, "--out", other, "--vocab-size", "400", "--workers", "1"]) == 0
    with pytest.raises(SystemExit, match="was not encoded with the tokenizer of"):
        cli.main(["train", "--init-from", imported, "--data", other, "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_a_hub_name_is_read_from_the_hub_cache_when_offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE and the cache are honoured (no network here: a cache laid out
    as huggingface_hub lays it out)."""
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    snapshot = cache / "models--Helsinki-NLP--opus-mt-xx-yy" / "snapshots" / ("0" * 40)
    numpy_checkpoint(str(snapshot), "swish-shared-nobias")
    (cache / "models--Helsinki-NLP--opus-mt-xx-yy" / "refs").mkdir()
    (cache / "models--Helsinki-NLP--opus-mt-xx-yy" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = from_marian("Helsinki-NLP/opus-mt-xx-yy")
    assert tokenizer.encode("ka ko") and model.count_params() > 0
    with pytest.raises(FileNotFoundError, match="Cannot download Helsinki-NLP/opus-mt-none"):
        from_marian("Helsinki-NLP/opus-mt-none")


def test_a_zero_start_row_stays_zero_through_training_and_imports_say_so(tmp_path):
    from keras_transformer.config import TransformerConfig
    from keras_transformer.model import build_transformer, transformer_parts
    from tests.pretrained.marian_dirs import native_release

    config = TransformerConfig.from_preset("tiny", zero_start_embedding=True)
    model = build_transformer(config)
    embedding = transformer_parts(model).target_embedding.embeddings
    embedding.assign(keras.ops.where(np.arange(64)[:, None] == 1, 0.0, embedding))
    before = keras.ops.convert_to_numpy(embedding).copy()
    # An optimizer step as model.fit takes it: the update, then the constraint.
    optimizer = keras.optimizers.Adam(1e-2)
    for _ in range(2):
        optimizer.apply([np.ones((64, config.hidden_dim), "float32")], [embedding])
    after = keras.ops.convert_to_numpy(embedding)
    assert not after[1].any()  # the start row: zero still
    assert not np.allclose(after[8], before[8])  # the others learn
    # Marian's own release starts from a zero vector: the import keeps it so.
    folder = str(tmp_path / "release")
    native_release(folder)
    assert transformer_parts(from_marian(folder)[0]).config.zero_start_embedding
