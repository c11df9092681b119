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
    """`model.save(path)` through a temporary `.keras` file and a rename."""
    with atomic_path(path, suffix=".keras") as tmp:
        model.save(tmp)


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
