import pytest


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """An ONNX export of an untrained one-layer model with the toy word vocabulary.

    Returns `(export_dir, endless)`: `endless` is a sentence whose greedy
    output never produces EOS, so that it runs to any `max_length` (a
    search that takes a while, for the server's queue and timeout tests).
    Exported in seconds with no training; its translations are nonsense, but
    every engine of the same export must give the same nonsense.
    """
    import keras
    from keras_transformer_runtime import OnnxTranslator

    from keras_transformer.config import TransformerConfig
    from keras_transformer.data.toy import WordVocabulary, generate_toy_corpus
    from keras_transformer.export.onnx import export_onnx
    from keras_transformer.model import build_transformer

    if keras.backend.backend() != "tensorflow":
        pytest.skip(
            "the ONNX tests run once, in the TensorFlow tier (the export itself takes either backend: tests/test_model.py)"
        )
    root = tmp_path_factory.mktemp("tiny_export")
    corpus = generate_toy_corpus(num_train=200, num_valid=1, num_test=1, max_words=8, seed=0)
    vocabulary = WordVocabulary.from_corpus(corpus)
    vocabulary.save(str(root / "vocab.txt"))
    keras.utils.set_random_seed(3)
    config = TransformerConfig(
        vocabulary_size=len(vocabulary.tokens),
        num_layers=1,
        hidden_dim=32,
        intermediate_dim=48,
        num_heads=4,
        max_length=32,
    )
    out = root / "onnx"
    export_onnx(build_transformer(config), out, tokenizer_path=str(root / "vocab.txt"))
    translator = OnnxTranslator(out, num_threads=1)
    words = vocabulary.tokens[4:]
    candidates = [" ".join(words[i : i + 3]) for i in range(0, len(words) - 3, 3)]
    tokens, _ = translator.greedy_search(
        [translator.tokenizer.encode(c) + [2] for c in candidates], max_length=64
    )
    endless = next(c for c, t in zip(candidates, tokens, strict=True) if len(t) == 64)
    return str(out), endless
