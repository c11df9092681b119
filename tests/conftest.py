import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("KERAS_BACKEND") == "jax":
    # The tests' models are tiny: XLA compiling each operation called eagerly, and
    # each fit and predict, is most of their time. These flags lighten LLVM's part
    # of a compile (code generation), which costs more here than the faster code
    # gains; XLA's graph passes, which choose the fusions, run as before. A user's
    # XLA_FLAGS are kept.
    os.environ.setdefault(
        "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )

# keras_transformer first: it sets TensorFlow up (oneDNN) as its users get it.
import keras_transformer  # noqa: E402, F401, I001
import keras  # noqa: E402
import pytest  # noqa: E402

# The fixtures that train a model; a test that uses one belongs to the integration tier.
TRAINED_FIXTURES = ("toy_run", "trained_run", "float16_run")

if keras.backend.backend() == "tensorflow" and not os.environ.get("KT_ONE_CPU"):
    import tensorflow as tf

    # Two logical CPU devices for the MirroredStrategy tests (tests/test_distribute.py);
    # this must happen before TensorFlow's runtime starts, so here, before any test
    # runs. KT_ONE_CPU=1 keeps the one physical device, to run other tests as a
    # user's process would see TensorFlow (the MirroredStrategy tests then fail).
    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )


if keras.backend.backend() == "jax":
    import atexit
    import shutil
    import tempfile

    import jax

    # Many tests compile the same program: the same tiny model trained or called on
    # the same shapes, by a new Keras function each time (a loaded copy, a second
    # model). JAX's compilation cache, keyed by the program itself, compiles each
    # once per run. A fresh folder per run: nothing is reused from an earlier one.
    _cache = tempfile.mkdtemp(prefix="kt-jax-cache-")
    atexit.register(shutil.rmtree, _cache, True)
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Marks the tests that need a trained model `integration`, before `-m` selects."""
    for item in items:
        if any(name in item.fixturenames for name in TRAINED_FIXTURES):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _float32_policy_and_seed():
    """Every test starts in float32 with a fixed seed, whatever the one before it did."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(1234)
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory):
    """The tiny preset trained briefly on the toy corpus, through the demo's own entry point.

    Returns `(model, corpus, vocabulary, metrics)`; shared by the tests that
    need a trained model.
    """
    from keras_transformer.data.toy import WordVocabulary, generate_toy_corpus
    from keras_transformer.demo import run_demo

    keras.mixed_precision.set_global_policy("float32")
    out = str(tmp_path_factory.mktemp("toy_run"))
    kwargs = dict(epochs=3, num_train=3000, num_test=50, warmup_steps=100, seed=0)
    jit = keras.backend.backend() == "jax"  # eager JAX training would be slow
    metrics = run_demo(out_dir=out, verbose=0, jit_compile=jit, **kwargs)
    metrics["run_dir"] = out
    model = keras.saving.load_model(f"{out}/model.keras")
    corpus = generate_toy_corpus(num_train=3000, num_valid=50, num_test=50, max_words=8, seed=0)
    return model, corpus, WordVocabulary.from_corpus(corpus), metrics


def train_args(paths, out, *extra):
    """`keras-transformer train` arguments for the tiny preset on the generated corpus files.

    Epochs are ranked by validation loss, which costs no decoding; a test of
    BLEU ranking (the default) passes `--select-by bleu` in `extra`.
    """
    return [
        "train",
        "--src-train", paths["train.src"], "--tgt-train", paths["train.tgt"],
        "--src-valid", paths["valid.src"], "--tgt-valid", paths["valid.tgt"],
        "--out", str(out), "--preset", "tiny", "--vocab-size", "400",
        "--tokens-per-batch", "1024", "--warmup-steps", "100", "--learning-rate-scale", "1",
        "--select-by", "loss",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="session")
def corpus_files(tmp_path_factory):
    """A generated corpus (seed 5) written as train/valid/test .src/.tgt files."""
    from keras_transformer.data.toy import generate_toy_corpus

    corpus = generate_toy_corpus(num_train=1000, num_valid=40, num_test=40, max_words=6, seed=5)
    return corpus, corpus.write(str(tmp_path_factory.mktemp("toy_text")))


@pytest.fixture(scope="session")
def trained_run(corpus_files, tmp_path_factory):
    """`keras-transformer train` (SentencePiece, mixed_bfloat16, 3 epochs, last 2 averaged)."""
    from keras_transformer import cli

    _, paths = corpus_files
    out = tmp_path_factory.mktemp("runs") / "toy"
    args = train_args(paths, out, "--epochs", "3", "--average-last", "2")
    assert cli.main([*args, "--precision", "mixed_bfloat16"]) == 0
    return out


@pytest.fixture(scope="session")
def float16_run(corpus_files, tmp_path_factory):
    """`keras-transformer train` for one epoch under mixed_float16 (SentencePiece)."""
    from keras_transformer import cli
    from keras_transformer.precision import visible_gpus

    if keras.backend.backend() == "jax" and not visible_gpus():
        pytest.skip("mixed_float16 under JAX needs a GPU (XLA on a CPU has no float16 product)")

    _, paths = corpus_files
    out = tmp_path_factory.mktemp("runs") / "float16"
    assert cli.main([*train_args(paths, out, "--epochs", "1"), "--precision", "mixed_float16"]) == 0
    return out


@pytest.fixture(scope="session")
def exported(toy_run, trained_run, float16_run, tmp_path_factory):
    """kind -> (float32 Keras model, tokenizer, OnnxTranslator, export dir).

    Three exports of trained models: the demo's float32 toy model (word
    vocabulary, through the CLI with the float16 graphs too), and
    SentencePiece runs trained under mixed_bfloat16 and mixed_float16,
    exported from their float32 rebuild. Each is made on first use.
    """
    from keras_transformer_runtime import OnnxTranslator

    from keras_transformer import cli
    from keras_transformer.export.onnx import export_onnx, float32_copy
    from keras_transformer.translation import load_run

    cache = {}

    def get(kind):
        if kind not in cache:
            run_dir = {
                "float32": toy_run[3]["run_dir"],
                "mixed_bfloat16": str(trained_run),
                "mixed_float16": str(float16_run),
            }[kind]
            out = str(tmp_path_factory.mktemp("onnx") / kind)
            if kind == "float32":
                assert cli.main(["export", run_dir, "--out", out, "--precision", "float16"]) == 0
            else:
                export_onnx(run_dir, out)
            model, tokenizer = load_run(run_dir)
            cache[kind] = (float32_copy(model), tokenizer, OnnxTranslator(out), out)
        return cache[kind]

    return get
