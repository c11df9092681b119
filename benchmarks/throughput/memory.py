"""Resident memory of this process: its current size, and its peak over a block of code."""

from __future__ import annotations

import gc
import os
import threading


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_memory():
    """Collects garbage and hands freed heap memory back to the OS (glibc).

    Without it, memory one peer freed stays in the process and another peer
    reuses it, so RSS would not tell the peers' needs apart.
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak RSS above the RSS at entry, sampled in a thread every `interval` s."""

    def __init__(self, interval=0.01):
        self.interval = interval
        self._stop = threading.Event()

    def __enter__(self):
        release_free_memory()
        self.start_rss = self.peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def increase(self):
        return self.peak - self.start_rss
