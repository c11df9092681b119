"""Atomic file writes: a crash never leaves a half-written file behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ""):
    """Yields a temporary path beside `path`; renames it onto `path` on success.

    On an exception the temporary file is removed and `path` is untouched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=directory, prefix=f".{os.path.basename(path)}.", suffix=suffix or ".tmp"
    )
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def atomic_write_json(path: str, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def atomic_save_model(model, path: str) -> None:
    """`model.save(path)` through a temporary `.keras` file and a rename.

    Keras builds a `.keras` archive's weights in memory (an HDF5 file in a
    `BytesIO`: a second copy of every weight at once); the model is saved
    unzipped instead, its weights written straight to disk, and the files
    stored into the archive from there, as Keras stores them (uncompressed).
    """
    import zipfile

    with atomic_path(path, suffix=".keras") as tmp:
        unzipped = tempfile.mkdtemp(dir=os.path.dirname(tmp), prefix=".unzipped-")
        try:
            model.save(unzipped, zipped=False)
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as archive:
                for folder, _, files in sorted(os.walk(unzipped)):
                    for name in sorted(files):
                        full = os.path.join(folder, name)
                        archive.write(full, os.path.relpath(full, unzipped))
        finally:
            shutil.rmtree(unzipped, ignore_errors=True)


def load_keras_archive(path: str, **kwargs):
    """`keras.saving.load_model(path, **kwargs)` for a `.keras` archive, read from disk.

    Keras reads an archive's whole weights file into memory before it loads
    a single weight (a second copy of every weight, and briefly a third);
    the archive is unpacked into a temporary folder instead, which Keras
    loads weight by weight from disk.
    """
    import keras

    with unpacked_keras_archive(path) as unpacked:
        return keras.saving.load_model(unpacked, **kwargs)


@contextlib.contextmanager
def unpacked_keras_archive(path: str):
    """Yields a temporary folder holding the files of the `.keras` archive `path`
    (`config.json`, `model.weights.h5`, ...); removed on leaving."""
    import zipfile

    unpacked = tempfile.mkdtemp(prefix="keras-model-")
    try:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(unpacked)
        yield unpacked
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(out_dir: str, label: str = "staging"):
    """Yields a new folder beside `out_dir`; on success it becomes `out_dir`.

    An earlier `out_dir` is renamed aside first and removed only once the new
    one is in place; on an exception the staging folder is removed and
    `out_dir` is as it was.
    """
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.{label}-")
    try:
        yield staging
        if os.path.isdir(out_dir):
            old = staging + ".old"
            os.rename(out_dir, old)
            os.rename(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, out_dir)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
