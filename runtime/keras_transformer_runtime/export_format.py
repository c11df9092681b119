"""The ONNX export folder's format: its manifest, its version, and the checks that read it.

`keras-transformer export` writes the folder and the runtime reads it; both
import this module, so the version one writes is the version the other reads.
Needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import os

MANIFEST = "manifest.json"
# The export format this runtime reads: `keras-transformer export` writes it
# into the manifest as `format_version`, and an export of any other version is
# refused. 5: the encoder, the decoder step with its `top_k` selection and
# cross keys and values once per sentence, the four search graphs, and one
# weights file per precision; 6: `model.onnx` also returns the alignment
# layer's cross-attention; 7: the beam search graphs also return the best
# hypothesis's token scores; 8: the teacher-forced graphs `forced_scores`,
# `alignment` and `teacher_forced` over the encoder's outputs replace `model.onnx`,
# and the beam search graphs return each sentence's `n_best` best hypotheses.
FORMAT_VERSION = 8
# The beam search graphs' input that picks the length penalty's form, and its
# values (exports of format 8 written before it lack it: the runtime then
# searches the average form in its loop).
LENGTH_PENALTY_FORM_INPUT = "length_penalty_form"
LENGTH_PENALTY_FORM_IDS = {"gnmt": 0, "average": 1}
# The alignment layer's cross-attention, heads averaged: the decoder step's
# output of it, one row per input row; the search graphs' input that asks for
# it (a bool scalar) and their output of it, the rows of each output token's
# step. Exports of format 8 written before them lack them: the runtime then
# aligns with a teacher-forced pass over the outputs.
ALIGNMENT_WEIGHTS = "alignment_weights"
ALIGNMENT_INPUT = "alignment"
ALIGNMENTS_OUTPUT = "alignments"


class ExportFileError(RuntimeError):
    """A file of an ONNX export folder is missing, unreadable or of another format version.

    The message names the file and says what to do.
    """


def check_format_version(manifest, path):
    """Refuses a manifest of a format version other than `FORMAT_VERSION`, saying to re-export."""
    version = manifest.get("format_version")
    redo = "re-export the run with `keras-transformer export RUN_DIR --out OUT_DIR`"
    if version is None:
        raise ExportFileError(
            f"{path} has no format_version (an export older than format versions); this "
            f"runtime reads format_version {FORMAT_VERSION}: {redo}."
        )
    if isinstance(version, bool) or not isinstance(version, int):
        raise ExportFileError(
            f"{path} has format_version {version!r}, not a whole number; this runtime reads "
            f"format_version {FORMAT_VERSION}: {redo}."
        )
    if version < FORMAT_VERSION:
        raise ExportFileError(
            f"{path} is an export of format_version {version}, older than the "
            f"format_version {FORMAT_VERSION} this runtime reads: {redo}."
        )
    if version > FORMAT_VERSION:
        raise ExportFileError(
            f"{path} is an export of format_version {version}, newer than the "
            f"format_version {FORMAT_VERSION} this runtime reads: install the "
            f"keras-transformer-runtime of the exporter that wrote it, or {redo} "
            "using this runtime's version of keras-transformer."
        )


def read_manifest(onnx_dir):
    """The checked manifest of the export folder `onnx_dir`.

    Raises `ExportFileError` naming the folder or file for a missing folder or
    manifest, one that is not JSON or lacks `graphs`, `config` or
    `precisions`, and one of another format version.
    """
    if not os.path.isdir(onnx_dir):
        raise ExportFileError(f"ONNX export folder not found: {onnx_dir}")
    path = os.path.join(onnx_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        check_format_version(manifest, path)
        for key in ("graphs", "config", "precisions"):
            manifest[key]  # noqa: B018 (a missing key is refused below)
    except FileNotFoundError as error:
        raise ExportFileError(f"{MANIFEST} missing: {path}") from error
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ExportFileError(f"{path} is not a valid export manifest: {error}") from error
    return manifest


def check_weights(manifest, onnx_dir, precision):
    """The shared weights file of `precision` is listed, there and whole (`weights.bin`...)."""
    try:
        weights = manifest["weights"][precision]
    except (KeyError, TypeError) as error:
        raise ExportFileError(
            f"{MANIFEST} in {onnx_dir} lists no {precision} weights file: "
            "the export is incomplete; export the run again."
        ) from error
    path = os.path.join(onnx_dir, weights)
    if not os.path.isfile(path):
        raise ExportFileError(
            f"{weights} missing from {onnx_dir}: it holds the {precision} weights "
            "of every graph that translates; copy the whole export folder."
        )
    expected = manifest.get("weight_bytes", {}).get(precision)
    if expected is not None and os.path.getsize(path) != expected:
        raise ExportFileError(
            f"{path} has {os.path.getsize(path)} bytes, not the {expected} the export "
            "wrote: it is truncated or from another export; copy it again."
        )
