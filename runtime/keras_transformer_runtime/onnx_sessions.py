"""ONNX Runtime sessions for an export's graphs: providers, threads, spinning, and the tokenizer.

Needs onnxruntime (imported when a session is made), numpy and sentencepiece.
"""

from __future__ import annotations

import os

from keras_transformer_runtime import tokenizers
from keras_transformer_runtime.export_format import ExportFileError

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# The graphs whose idle worker threads spin between parallel sections: the
# many small products of a decoder step then do not each wait for a thread
# to wake (docs/performance.md, "Runtime choices"). The encoder sleeps: its
# spinning on while a search runs leaves more busy threads than cores.
SPINNING_GRAPHS = (
    "decoder_step",
    "greedy_search",
    "greedy_batch_search",
    "beam_search",
    "beam_batch_search",
)
# Of those, the one that sleeps in float32: faster sleeping at 2 threads and
# batch 32 on both CPUs measured (docs/performance.md, "Runtime choices").
SLEEPING_FLOAT32_GRAPHS = ("greedy_batch_search",)


def available_cores():
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _nvidia_driver_present():
    """Whether an NVIDIA driver library loads here (without it CUDA cannot run)."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def default_providers():
    """CUDA (then CPU) when this ONNX Runtime has CUDA and a driver is present, otherwise CPU.

    Checking for the driver first keeps a GPU build of ONNX Runtime on a
    machine without a GPU from logging CUDA load errors before it falls back.
    """
    import onnxruntime as ort

    if CUDA in ort.get_available_providers() and _nvidia_driver_present():
        return [CUDA, CPU]
    return [CPU]


def spins(name, precision):
    """Whether graph `name`'s idle threads spin (`SPINNING_GRAPHS`)."""
    return name in SPINNING_GRAPHS and not (
        precision == "float32" and name in SLEEPING_FLOAT32_GRAPHS
    )


def make_session(path, providers, num_threads, spinning=False):
    """An ONNX Runtime session of the graph at `path`; `ExportFileError` names a bad file."""
    import onnxruntime as ort

    if not os.path.isfile(path):
        raise ExportFileError(f"ONNX graph missing: {path}")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if num_threads is not None:
        options.intra_op_num_threads = int(num_threads)
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    try:
        return ort.InferenceSession(path, sess_options=options, providers=providers)
    except Exception as error:  # onnxruntime raises its own exception types
        raise ExportFileError(f"Cannot load the ONNX graph {path}: {error}") from error


def load_tokenizer(path):
    """The export's tokenizer; a missing or unreadable file raises `ExportFileError` naming it."""
    if not os.path.isfile(path):
        raise ExportFileError(f"Tokenizer file missing: {path}")
    try:
        return tokenizers.load_tokenizer(path)
    except (OSError, ValueError) as error:
        raise ExportFileError(f"Cannot read the tokenizer {path}: {error}") from error
