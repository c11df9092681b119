"""Start-up settings: TensorFlow's oneDNN kernels, glibc's huge pages for XLA's CPU buffers,
and a quiet `keras-transformer` command."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import platform
import sys

ONEDNN_VARIABLE = "TF_ENABLE_ONEDNN_OPTS"
# Set to "system" to leave glibc's allocator as it is (`relaunch_with_huge_pages`).
MALLOC_VARIABLE = "KERAS_TRANSFORMER_MALLOC"
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
# JAX's plugins for accelerators: with one installed, JAX may not compute on the CPU.
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "libtpu")


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


def configured_backend(environ=os.environ) -> str:
    """Keras's backend as Keras will choose it, read without importing Keras."""
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"]
    home = environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json"), encoding="utf-8") as f:
            return str(json.load(f).get("backend", "tensorflow"))
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def huge_pages_environment(environ, backend, thp_mode) -> dict | None:
    """The environment to start the `keras-transformer` command again in, or None to go on.

    See `relaunch_with_huge_pages`: only under JAX, where the kernel gives
    huge pages on request (`thp_mode`, the text of `THP_MODE_FILE`, has
    `[madvise]` selected), JAX has no accelerator plugin to prefer (or
    `JAX_PLATFORMS=cpu`), and neither `GLIBC_TUNABLES` nor
    `KERAS_TRANSFORMER_MALLOC=system` is set.
    """
    if backend != "jax":
        return None
    if "GLIBC_TUNABLES" in environ or environ.get(MALLOC_VARIABLE) == "system":
        return None
    if "[madvise]" not in (thp_mode or ""):
        return None
    cpu_only = environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    if not cpu_only and any(importlib.util.find_spec(p) for p in _ACCELERATOR_PLUGINS):
        return None
    return {**environ, "GLIBC_TUNABLES": HUGE_PAGES_TUNABLE}


def relaunch_with_huge_pages() -> None:
    """Starts the `keras-transformer` command again with glibc's malloc on huge pages, under JAX.

    XLA's CPU runtime allocates each run of a compiled program its buffers
    with `posix_memalign` from the thread that runs it. glibc serves a request
    over 64 MiB in such a thread's arena with a fresh `mmap` and returns it
    with `munmap`, so each of its 4 KiB pages faults in again at every run:
    119,000 faults (454 MiB) in each training step of the `small` preset at
    1,536 tokens, about a third of the step (docs/performance.md, "JAX on a
    CPU"). With glibc's `glibc.malloc.hugetlb=1` such memory is asked for in
    2 MiB transparent huge pages: about 600 faults a step. TensorFlow keeps
    its own buffers and does not need it.

    glibc reads the setting only when a process starts, so the command
    starts itself again, before anything heavy is imported, with
    `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (see `huge_pages_environment`
    for when). A program of one's own that trains under JAX on a CPU gets
    the same by setting that variable before Python starts.
    """
    if not is_command() or platform.libc_ver()[0] != "glibc":
        return
    try:
        with open(THP_MODE_FILE, encoding="ascii") as f:
            thp_mode = f.read()
    except OSError:
        return
    environ = huge_pages_environment(os.environ, configured_backend(), thp_mode)
    if environ is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    except OSError:  # the interpreter cannot be started again: go on as it is
        return


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


def is_command(argv=None) -> bool:
    """Whether this process (or `argv`) is the `keras-transformer` command, or the
    same run as `python -m keras_transformer.cli` (`argv[0]` is "-m" while the
    package is imported, cli.py's path after)."""
    if argv is None:
        if sys.orig_argv[1:3] == ["-m", "keras_transformer.cli"]:
            return True
        argv = sys.argv
    if not argv:
        return False
    folder, name = os.path.split(os.path.normpath(argv[0]))
    return name == "keras-transformer" or (
        name == "cli.py" and os.path.basename(folder) == "keras_transformer"
    )


def is_quiet_command() -> bool:
    """Whether this process is the `keras-transformer` command, run without `--verbose`."""
    return is_command() and "--verbose" not in sys.argv


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
