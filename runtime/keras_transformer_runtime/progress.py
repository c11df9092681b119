"""A one-line progress bar on stderr (no dependencies)."""

from __future__ import annotations

import sys


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total, enabled):
        self.total, self.done, self.enabled = total, 0, enabled and total > 0

    def update(self, count):
        self.done += count
        if self.enabled:
            width = 30
            filled = int(width * self.done / self.total)
            sys.stderr.write(
                f"\rtranslating [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
            )
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
