"""Quiet start-up for the `keras-transformer` command."""

from __future__ import annotations

import contextlib
import logging
import os
import sys


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
