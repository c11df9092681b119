"""The Marian import against transformers itself: logits, tokenizer ids, greedy
and beam search, the marian-hf export loaded back, and CTranslate2's converter
on the same directory. Needs torch and transformers (`make pretrained`)."""

import os

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.pretrained
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from keras_transformer import cli  # noqa: E402
from keras_transformer.pretrained.marian import from_marian  # noqa: E402
from tests.pretrained.marian_dirs import (  # noqa: E402
    SOURCE_EXTRA,
    TARGET_EXTRA,
    VARIANTS,
    transformers_checkpoint,
)

TEXTS = SOURCE_EXTRA + ["ka ko ☃ mina tel", "ko", "eine Straße ✈ über den Park"]
TARGETS = TARGET_EXTRA + ["KO ✈ TEL", "A", "The park"]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_dir(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    transformers_checkpoint(folder, request.param)
    return folder


def _marian_tokenizer(folder):
    return transformers.MarianTokenizer.from_pretrained(folder)


def _ours(ids, tokenizer, side):
    """Marian ids -> ours (inverse of `to_marian`)."""
    table = (tokenizer.source if side == "source" else tokenizer.target).to_marian
    inverse = {m: i for i, m in enumerate(table) if i}
    return [inverse[m] for m in ids]


def _logits_both(folder, model, tokenizer, sources, targets, log_probs=False):
    hf = transformers.MarianMTModel.from_pretrained(folder).eval()
    hf_tokenizer = _marian_tokenizer(folder)
    batch = hf_tokenizer(sources, text_target=targets, padding=True, return_tensors="pt")
    labels = batch["labels"]
    start = torch.full((len(targets), 1), hf.config.decoder_start_token_id)
    decoder_inputs = torch.cat([start, labels[:, :-1]], dim=1)
    with torch.no_grad():
        reference = hf(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=decoder_inputs,
        ).logits.numpy()
    pad = hf.config.pad_token_id
    source_ids = np.zeros(batch["input_ids"].shape, np.int32)
    target_ids = np.zeros(decoder_inputs.shape, np.int32)
    for i, row in enumerate(batch["input_ids"].tolist()):
        real = [m for m in row if m != pad]
        source_ids[i, : len(real)] = _ours(real, tokenizer, "source")
    for i, row in enumerate(decoder_inputs.tolist()):
        real = [row[0]] + [m for m in row[1:] if m != pad]
        target_ids[i, : len(real)] = _ours(real, tokenizer, "target")
    logits = keras.ops.convert_to_numpy(model({"source_ids": source_ids, "target_ids": target_ids}))
    if log_probs:  # over all our columns, our padding's included
        logits = keras.ops.convert_to_numpy(keras.ops.log_softmax(logits, axis=-1))
        reference = keras.ops.convert_to_numpy(keras.ops.log_softmax(reference, axis=-1))
    # Our columns in Marian's order (our padding column dropped).
    ours = np.zeros_like(reference)
    ours[..., tokenizer.target.to_marian[1:]] = logits[..., 1:]
    return ours, reference, target_ids != 0


def test_logits_equal_transformers(hf_dir):
    model, tokenizer = from_marian(hf_dir)
    ours, reference, real = _logits_both(hf_dir, model, tokenizer, TEXTS, TARGETS)
    np.testing.assert_allclose(ours[real], reference[real], atol=1e-4)
    # The log-probabilities too: our padding row takes no probability.
    ours, reference, real = _logits_both(hf_dir, model, tokenizer, TEXTS, TARGETS, log_probs=True)
    np.testing.assert_allclose(ours[real], reference[real], atol=1e-4)


def test_tokenizer_ids_equal_marian_tokenizers(hf_dir):
    _, tokenizer = from_marian(hf_dir)
    hf_tokenizer = _marian_tokenizer(hf_dir)
    for text in TEXTS + [">>deu<< ein Hund", "   ", "☃☃"]:
        expected = hf_tokenizer(text).input_ids  # EOS last
        assert tokenizer.to_marian(tokenizer.encode(text) + [2], "source") == expected, text
    for text in TARGETS:
        expected = hf_tokenizer(text_target=text).input_ids
        assert tokenizer.to_marian(tokenizer.encode_target(text) + [2]) == expected, text
        assert tokenizer.decode(tokenizer.encode_target(text)) == hf_tokenizer.decode(
            expected, skip_special_tokens=True
        )


def _generate(folder, texts, num_beams, max_new_tokens, length_penalty=1.0, early_stopping=True):
    hf = transformers.MarianMTModel.from_pretrained(folder).eval()
    hf_tokenizer = _marian_tokenizer(folder)
    outputs = []
    for text in texts:  # one at a time: no padding question
        batch = hf_tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(
                **batch,
                num_beams=num_beams,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                bad_words_ids=[[hf.config.pad_token_id]],
                forced_eos_token_id=None,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
            )
        outputs.append(out[0].tolist()[1:])  # without the decoder start
    return outputs


def _until_eos(ids):
    return ids[: ids.index(0) + 1] if 0 in ids else ids


def test_greedy_output_equals_generate(hf_dir):
    from keras_transformer.decoding import translator

    model, tokenizer = from_marian(hf_dir)
    expected = _generate(hf_dir, TEXTS, 1, 10)
    search = translator(model, tokenizer)
    sources = [tokenizer.encode(t) + [2] for t in TEXTS]
    from keras_transformer_runtime.options import SearchOptions

    found = search.search(sources, SearchOptions(beam_size=1, max_length=10))
    for hypotheses, reference in zip(found, expected, strict=True):
        ours = tokenizer.to_marian(hypotheses[0].tokens)
        assert _until_eos(ours) == _until_eos(reference)[: len(ours)]


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_output_equals_generate_under_the_same_length_penalty(hf_dir, alpha, tmp_path):
    """transformers divides by length ** alpha: our `length_penalty_form="average"`.
    Its canonical stopping rule (`early_stopping="never"`) is the bound ours keeps."""
    import shutil

    from keras_transformer_runtime.options import SearchOptions
    from safetensors.numpy import load_file, save_file

    from keras_transformer.decoding import translator

    # EOS made likelier, so that searches end before the limit and the rule shows.
    folder = str(tmp_path / "eos")
    shutil.copytree(hf_dir, folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["final_logits_bias"][0, 0] += 6.0
    save_file(tensors, path, metadata={"format": "pt"})
    hf_dir = folder
    model, tokenizer = from_marian(hf_dir)
    texts = TEXTS + TARGETS  # more sentences, some of which end early
    expected = _generate(hf_dir, texts, 4, 12, length_penalty=alpha, early_stopping="never")
    options = SearchOptions(
        beam_size=4, max_length=12, length_penalty=alpha, length_penalty_form="average"
    )
    sources = [tokenizer.encode(t) + [2] for t in texts]
    found = translator(model, tokenizer).search(sources, options)
    ended = 0
    for hypotheses, reference in zip(found, expected, strict=True):
        ours = tokenizer.to_marian(hypotheses[0].tokens)
        assert ours == [i for i in reference if i not in (0, tokenizer.target.to_marian[1])]
        ended += 0 in reference
    assert ended  # the stopping rule was exercised, not only the length limit


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="saving a run")
def test_marian_hf_export_loads_in_transformers_with_the_same_logits(hf_dir, tmp_path):
    run, back = str(tmp_path / "run"), str(tmp_path / "back")
    assert cli.main(["import", "marian", hf_dir, "--out", run]) == 0
    assert cli.main(["export", run, "--format", "marian-hf", "--out", back]) == 0
    model, tokenizer = from_marian(hf_dir)
    ours, reference, real = _logits_both(back, model, tokenizer, TEXTS, TARGETS)
    np.testing.assert_allclose(ours[real], reference[real], atol=1e-4)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="ONNX export")
def test_ctranslate2_converted_from_the_same_directory_finds_the_same_greedy_output(
    hf_dir, tmp_path
):
    ctranslate2 = pytest.importorskip("ctranslate2")
    if os.path.isfile(os.path.join(hf_dir, "target_vocab.json")):
        # CTranslate2 4.8.5's converter counts the tokenizer's added tokens into
        # the source vocabulary of separate-vocabulary models and refuses them.
        pytest.skip("CTranslate2's TransformersConverter refuses separate Marian vocabularies")
    from keras_transformer_runtime import OnnxTranslator

    run, out = str(tmp_path / "run"), str(tmp_path / "onnx")
    assert cli.main(["import", "marian", hf_dir, "--out", run]) == 0
    assert cli.main(["export", run, "--out", out]) == 0
    converted = str(tmp_path / "ct2")
    ctranslate2.converters.TransformersConverter(hf_dir).convert(converted)
    translator = ctranslate2.Translator(converted, device="cpu")
    ours = OnnxTranslator(out)
    tokenizer = ours.tokenizer
    for text in TEXTS:
        # This converter keeps the tokenizer's EOS as a source piece (OpusMTConverter adds it).
        pieces = [tokenizer.source.pieces[i] for i in tokenizer.encode(text)] + ["</s>"]
        result = translator.translate_batch(
            [[_marian_piece(tokenizer, p) for p in pieces]], beam_size=1, max_decoding_length=10
        )[0].hypotheses[0]
        found = ours.search([tokenizer.encode(text) + [2]], _greedy(10))[0][0].tokens
        ids = [tokenizer.target.ours.get(p, 3) for p in result]
        assert [i for i in found if i != 2][: len(ids)] == ids


def _marian_piece(tokenizer, piece):
    return {"<s>": "<pad>"}.get(piece, piece)


def _greedy(max_length):
    from keras_transformer_runtime.options import SearchOptions

    return SearchOptions(beam_size=1, max_length=max_length)


@pytest.mark.slow
def test_a_model_of_opus_mt_size_imports_with_equal_logits(tmp_path):
    """d512, 6+6 layers, a vocabulary of 58,101 pieces as opus-mt-de-en's."""
    folder = str(tmp_path / "big")
    transformers_checkpoint(
        folder,
        "swish-shared-nobias",
        vocabulary_size=58101,
        d=512,
        layers=(6, 6),
        ffn=2048,
        heads=8,
    )
    model, tokenizer = from_marian(folder)
    assert len(tokenizer) == 58102  # Marian's pieces and our padding row
    ours, reference, real = _logits_both(folder, model, tokenizer, TEXTS, TARGETS)
    np.testing.assert_allclose(ours[real], reference[real], atol=1e-4)
