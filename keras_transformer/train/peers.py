"""Noticing a dead process of a data-parallel run, and ending the others with one clear line.

JAX's own watch (a heartbeat timeout in its coordination service) ends every
process with a fatal log and a C++ stack dump, and only after 100 s by
default. `PeerWatch` runs beside it, in a thread of every process: each
process writes a heartbeat (a counter) into the coordination service's
key-value store every `interval` seconds and reads the others'. A process
whose counter has not moved for `missed` intervals, or a coordinator that no
longer answers, is dead: the watch prints one line that names it and says how
to resume, removes this process's temporary folder, and exits with status 1.
JAX's own timeout is set longer (`jax_heartbeat_timeout`), so this one speaks
first.

A collective that fails because its peer is gone (gloo: "Connection closed by
peer") raises in the training loop; `lost_peer` then asks the watch which
process it was and ends the same way.

The coordinator's death is the one case the watch cannot answer: JAX's client
aborts at once, with a fatal log line and a C++ stack dump.
`relay_standard_error` puts a small child process (`stderr_relay.py`) on
the standard error of each process, which passes everything on until such a
dump starts, files the dump, and prints one line in its place.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# How often each process writes its heartbeat, and how many it may miss.
DEFAULT_INTERVAL = 5.0
DEFAULT_MISSED = 6  # a dead process is noticed within 30 s
ENV_INTERVAL = "KERAS_DISTRIBUTION_HEARTBEAT_INTERVAL"
ENV_MISSED = "KERAS_DISTRIBUTION_MISSED_HEARTBEATS"
KEY = "keras-transformer/heartbeat/{}"
EXIT_STATUS = 1


def jax_heartbeat_timeout(interval: float, missed: int) -> int:
    """JAX's own heartbeat timeout: long enough that `PeerWatch` notices first."""
    return int(interval * missed) + 30


class PeerWatch:
    """The heartbeats of one process of a run of `count` (see the module).

    Args:
        client: JAX's distributed runtime client (`jax._src.distributed.global_state.client`).
        index, count: this process and the run's processes.
        interval, missed: seconds between heartbeats, and how many missed mean dead.

    `cleanup` lists the folders to remove before exiting (`open_run` adds this
    process's temporary run folder).
    """

    def __init__(self, client, index, count, interval=DEFAULT_INTERVAL, missed=DEFAULT_MISSED):
        self.client = client
        self.index, self.count = index, count
        self.interval, self.missed = float(interval), int(missed)
        self.cleanup: list[str] = []
        self.cleanup_file: str | None = None  # where `relay_standard_error`'s child reads them
        self.relay: subprocess.Popen | None = None  # that child, kept while this process runs
        self.dead: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)

    def add_cleanup(self, folder: str) -> None:
        """Removes `folder` too when this process ends because a peer died."""
        self.cleanup.append(folder)
        if self.cleanup_file:
            with open(self.cleanup_file, "w", encoding="utf-8") as f:
                f.write("".join(item + "\n" for item in self.cleanup))

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching (before the processes leave the group, each in its own time)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)

    def _run(self):
        beat = 0
        seen = {}  # process -> (its last counter, when it changed, by this clock)
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                self.client.key_value_set(KEY.format(self.index), str(beat), allow_overwrite=True)
                for other in range(self.count):
                    if other == self.index:
                        continue
                    try:
                        value = self.client.key_value_try_get(KEY.format(other))
                    except Exception:  # not written yet: counts from the start
                        value = None
                    if other not in seen or seen[other][0] != value:
                        seen[other] = (value, now)
                    elif now - seen[other][1] > self.interval * self.missed:
                        self._fail(other, f"no heartbeat for {now - seen[other][1]:.0f} s")
                        return
            except Exception as error:  # the coordinator (process 0) no longer answers
                if self._stop.is_set():
                    return
                self._fail(0, f"the coordinator does not answer ({_first_line(error)})")
                return
            beat += 1
            self._stop.wait(self.interval)

    def _fail(self, process: int, why: str):
        self.dead = process
        self.exit(f"process {process} of the run stopped ({why})")

    def wait_for_dead(self) -> int | None:
        """The dead process, once the watch knows it (at most `missed` intervals), else None."""
        deadline = time.monotonic() + self.interval * (self.missed + 1)
        while self.dead is None and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.dead

    def exit(self, what: str):
        """Prints one line, removes this process's temporary folders, and ends the process
        at once: JAX's shutdown would wait on the dead process and then dump its stack."""
        print(
            f"error: {what}. Every process of the run stops; start the same commands again "
            "on every process to resume from process 0's last backup.",
            file=sys.stderr,
            flush=True,
        )
        for folder in self.cleanup:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(EXIT_STATUS)


def relay_standard_error(watch: PeerWatch, coordinator: str) -> subprocess.Popen | None:
    """Routes this process's standard error through `stderr_relay.py` (see the module),
    which names the dump's file in its line; None under `--verbose`, which keeps the dump."""
    if "--verbose" in sys.argv:
        return None
    stamp = os.path.join(
        tempfile.gettempdir(), f"keras-transformer-process{watch.index}-{os.getpid()}"
    )
    watch.cleanup_file = stamp + "-cleanup"
    cause = (
        f", as it does every other process when process 0 (the coordinator, {coordinator}) dies"
        if watch.index
        else ""
    )
    message = (
        f"error: JAX's distributed runtime ended process {watch.index} of the run "
        f"({{reason}}){cause}. Every process of the run stops; start the same commands again "
        "on every process to resume from process 0's last backup. JAX's report: {dump}"
    )
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stderr_relay.py")
    sys.stderr.flush()
    relay = subprocess.Popen(
        [sys.executable, script, message, stamp + "-fatal.log", watch.cleanup_file],
        stdin=subprocess.PIPE,
        stdout=sys.__stderr__.fileno(),
    )
    os.dup2(relay.stdin.fileno(), 2)  # C++ and Python alike write to descriptor 2
    relay.stdin.close()  # descriptor 2 holds the pipe now; at exit the relay sees its end
    watch.relay = relay
    return relay


def lost_peer(watch: PeerWatch, error: BaseException) -> None:
    """Ends this process with one line when `error`, raised by a collective, means a peer
    died; returns (to re-raise it) when it does not."""
    text = str(error)
    if not any(mark in text for mark in ("Gloo", "Connection closed", "UNAVAILABLE", "heartbeat")):
        return
    if "--verbose" in sys.argv:  # `keras-transformer --verbose train ...` keeps the details
        traceback.print_exception(error)
    dead = watch.wait_for_dead()  # exits from the watch's thread when it finds the process
    named = f"process {dead}" if dead is not None else "another process"
    watch.exit(f"{named} of the run is gone: {_first_line(error)}")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:200]
