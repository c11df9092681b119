"""Start-up settings: TensorFlow's oneDNN kernels, and a quiet `keras-transformer` command."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

ONEDNN_VARIABLE = "TF_ENABLE_ONEDNN_OPTS"


def prefer_onednn() -> None:
    """Asks TensorFlow for its oneDNN CPU kernels unless `TF_ENABLE_ONEDNN_OPTS` is set.

    TensorFlow's x86 Linux wheels turn oneDNN on by themselves only on CPUs
    with AVX512_VNNI, AVX512_BF16 or AMX. On the others (AVX2-only CPUs such
    as AMD Zen 3, AVX-512 without VNNI) matrix products run on Eigen, which
    is slower for the products of `small` and larger models, in training
    and in batched Keras decoding; the `tiny` preset's small products are
    slower on oneDNN (`benchmarks/README.md`, "oneDNN on an AVX2 CPU").
    TensorFlow reads the variable once, when it loads, so this acts only
    when `keras_transformer` is imported before TensorFlow; a value the user
    set, `0` included, is kept. Results differ from Eigen's by float32
    round-off.
    """
    os.environ.setdefault(ONEDNN_VARIABLE, "1")


def onednn_enabled() -> bool | None:
    """Whether Keras runs on a TensorFlow that uses its oneDNN CPU kernels.

    None under another backend, or where TensorFlow's own check (its build,
    the variable and the CPU; a private function) is missing.
    """
    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return None
    check = getattr(_pywrap_util_port, "IsMklEnabled", None)
    return None if check is None else bool(check())


def is_quiet_command() -> bool:
    """Whether this process is the `keras-transformer` command, run without `--verbose`."""
    return os.path.basename(sys.argv[0]) == "keras-transformer" and "--verbose" not in sys.argv


@contextlib.contextmanager
def quiet_tensorflow_start():
    """Hides TensorFlow's C++ start-up lines while the command imports it.

    TensorFlow prints INFO lines and, on a machine without a GPU, a CUDA
    probe's error line when it loads, some of them before its log level is
    read. None says anything a user must act on, so the command silences
    standard error (the file descriptor, which the C++ side writes to) for
    the import, and sets TF_CPP_MIN_LOG_LEVEL=3 for what comes after unless
    the user set it. Python exceptions still reach the terminal: the
    descriptor is restored before they propagate. `keras-transformer
    --verbose ...` keeps everything.
    """
    if not is_quiet_command():
        yield
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with quiet_native_stderr():
        yield
        # Under another backend Keras does not load TensorFlow, but the command's data
        # pipeline does, later and on every process of a run: load it here, silenced.
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            pass


@contextlib.contextmanager
def quiet_native_stderr():
    """Silences standard error's file descriptor for the command (not `--verbose`).

    For native code that logs at INFO level on its own, such as the
    SentencePiece library inside tensorflow-text, which reports the identity
    normalization of our tokenizer models each time one is loaded.
    """
    if not is_quiet_command():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class DropMessages(logging.Filter):
    """A logging filter that drops the records whose message contains every one of `texts`."""

    def __init__(self, *texts):
        super().__init__()
        self.texts = texts

    def filter(self, record):
        message = record.getMessage()
        return not all(text in message for text in self.texts)
