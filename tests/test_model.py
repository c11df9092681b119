import os

import keras
import numpy as np
import pytest

from keras_transformer import (
    LabelSmoothedCrossEntropy,
    MaskedAccuracy,
    TransformerConfig,
    build_transformer,
    transformer_optimizer,
    transformer_parts,
)
from tests.helpers import to_numpy

# Model code: also run under KERAS_BACKEND=jax (`make test`).
pytestmark = pytest.mark.jax

RNG = np.random.default_rng(0)


def tiny(**overrides):
    return TransformerConfig.from_preset("tiny", **{"dropout": 0.1, **overrides})


def batch(batch_size=3, source_len=7, target_len=6, vocabulary_size=64):
    source = RNG.integers(4, vocabulary_size, size=(batch_size, source_len)).astype("int32")
    target = RNG.integers(4, vocabulary_size, size=(batch_size, target_len)).astype("int32")
    source[0, 4:] = 0  # mixed lengths
    target[0, 3:] = 0
    return {"source_ids": source, "target_ids": target}


def logits_of(model, inputs):
    return to_numpy(model(inputs, training=False))


@pytest.mark.parametrize(
    "preset,low,high",
    [("paper-base", 63_000_000, 65_500_000), ("paper-big", 210_000_000, 215_000_000)],
)
def test_paper_parameter_counts(preset, low, high):
    # Table 3 of the paper: 65M (base) and 213M (big) with a 37k joint vocabulary.
    model = build_transformer(TransformerConfig.from_preset(preset, vocabulary_size=37000))
    assert low <= model.count_params() <= high


def test_output_shape_and_dtype():
    model = build_transformer(tiny())
    out = model(batch())
    assert tuple(out.shape) == (3, 6, 64)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"


def test_tied_embedding_is_shared():
    tied = build_transformer(tiny())
    untied = build_transformer(tiny(tie_embeddings=False))
    names = [layer.name for layer in tied.layers]
    assert names.count("token_embedding") == 1 and "output_projection" not in names
    extra = 64 * 64 + 64 * 64 + 64  # a second embedding and an output Dense with bias
    assert untied.count_params() - tied.count_params() == extra
    assert transformer_parts(untied).config == tiny(tie_embeddings=False)


@pytest.mark.parametrize("normalize_first", [False, True])
def test_causal_masking_is_leak_free(normalize_first):
    model = build_transformer(tiny(normalize_first=normalize_first))
    inputs = batch()
    inputs["target_ids"][0] = [1, 5, 6, 7, 8, 9]
    base = logits_of(model, inputs)
    for t in range(5):
        changed = {k: v.copy() for k, v in inputs.items()}
        changed["target_ids"][:, t + 1 :] = RNG.integers(4, 64, size=(3, 5 - t))
        out = logits_of(model, changed)
        np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-6)


def test_padding_invariance():
    model = build_transformer(tiny())
    inputs = batch()
    base = logits_of(model, inputs)
    padded = {
        "source_ids": np.pad(inputs["source_ids"], ((0, 0), (0, 5))),
        "target_ids": np.pad(inputs["target_ids"], ((0, 0), (0, 4))),
    }
    out = logits_of(model, padded)
    real = inputs["target_ids"] != 0
    np.testing.assert_allclose(out[:, :6][real], base[real], atol=1e-5)
    # Source padding of sentence 0 (positions 4..6) is invisible too.
    noisy = {k: v.copy() for k, v in inputs.items()}
    shorter = {"source_ids": noisy["source_ids"][:1, :4], "target_ids": noisy["target_ids"][:1]}
    np.testing.assert_allclose(logits_of(model, shorter)[0][real[0]], base[0][real[0]], atol=1e-5)


def test_sequence_longer_than_max_length_is_taken_whole():
    """Past max_length the model computes its positions: the same weights with a
    longer table give the same logits."""
    model = build_transformer(tiny(max_length=8))
    longer = build_transformer(tiny(max_length=64))
    longer.set_weights(model.get_weights())
    rng = np.random.default_rng(3)
    inputs = {
        "source_ids": rng.integers(3, 50, (2, 30)).astype("int32"),
        "target_ids": rng.integers(3, 50, (2, 21)).astype("int32"),
    }
    np.testing.assert_allclose(
        to_numpy(model(inputs)), to_numpy(longer(inputs)), rtol=1e-4, atol=1e-4
    )


def _compile(model, config):
    model.compile(
        optimizer=transformer_optimizer(config.hidden_dim, warmup_steps=10),
        loss=LabelSmoothedCrossEntropy(0.1),
        metrics=[MaskedAccuracy()],
    )
    # As `train` does: the slots built now, or TensorFlow traces the first step twice.
    model.optimizer.build(model.trainable_variables)


def test_save_and_load_gives_identical_logits(tmp_path):
    config = tiny()
    model = build_transformer(config)
    _compile(model, config)
    inputs = batch()
    model.fit(inputs, inputs["target_ids"], epochs=1, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)  # default safe_mode, no custom_objects
    np.testing.assert_array_equal(logits_of(loaded, inputs), logits_of(model, inputs))
    assert transformer_parts(loaded).config == config
    # The compiled state survives: training can continue on the loaded model.
    loaded.fit(inputs, inputs["target_ids"], epochs=1, verbose=0)


@pytest.mark.parametrize(
    "policy",
    [
        # Under JAX the tier checks mixed precision with bfloat16, the policy of
        # the accelerators JAX runs on here; float16 loss scaling is checked
        # under TensorFlow.
        pytest.param(
            "mixed_float16",
            marks=pytest.mark.skipif(
                keras.backend.backend() == "jax", reason="mixed_float16 is checked under TensorFlow"
            ),
        ),
        "mixed_bfloat16",
    ],
)
def test_mixed_precision_train_save_load(tmp_path, policy):
    keras.mixed_precision.set_global_policy(policy)
    config = tiny()
    model = build_transformer(config)
    _compile(model, config)
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    inputs = batch()
    history = model.fit(inputs, inputs["target_ids"], epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in model.weights)
    out = model(inputs)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(logits_of(loaded, inputs), logits_of(model, inputs))


def test_float16_fully_padded_source_is_finite():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = build_transformer(tiny())
    inputs = batch()
    inputs["source_ids"][1] = 0  # nothing to attend to in the encoder
    out = logits_of(model, inputs)
    assert np.isfinite(out).all()


def test_parts_reproduce_the_model():
    model = build_transformer(tiny(normalize_first=True))
    inputs = batch()
    parts = transformer_parts(model)
    encoded, mask = parts.encode(inputs["source_ids"])
    logits = parts.decode(inputs["target_ids"], encoded, mask)
    np.testing.assert_allclose(to_numpy(logits), logits_of(model, inputs), rtol=1e-5, atol=1e-5)


def test_rejects_non_config():
    with pytest.raises(TypeError, match="TransformerConfig"):
        build_transformer({"hidden_dim": 8})


def test_the_onnx_export_of_either_backend_matches_its_keras_model(tmp_path):
    """The export builds its graphs from the weights alone: a model of the JAX
    backend exports as one of TensorFlow does, and ONNX Runtime's teacher-forced
    pass and greedy search give the Keras model's log-probabilities and tokens."""
    from keras_transformer_runtime import OnnxTranslator

    from keras_transformer import decoding
    from keras_transformer.export.onnx import export_onnx

    keras.utils.set_random_seed(11)
    model = build_transformer(tiny(vocabulary_size=64))
    out = tmp_path / "onnx"
    manifest = export_onnx(model, out, precision="int8")
    assert manifest["precisions"] == ["float32", "int8"]
    inputs = batch()
    source, target = inputs["source_ids"], inputs["target_ids"]
    translator = OnnxTranslator(out)
    log_probs = to_numpy(keras.ops.log_softmax(model(inputs, training=False), axis=-1))
    real = target != 0
    forced = translator.decoder.log_probs(source, target)
    np.testing.assert_allclose(forced[real], log_probs[real], atol=1e-4)
    tokens, _ = translator.greedy_search(source, max_length=8)
    assert tokens == decoding.greedy_search(model, source, max_length=8)[0]
