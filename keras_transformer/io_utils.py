"""Atomic file writes: a crash never leaves a half-written file behind."""

from __future__ import annotations

import contextlib
import json
import os
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
