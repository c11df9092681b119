"""Passes a training process's standard error on, except JAX's fatal dump, which it files.

When process 0 of a data-parallel run (the coordinator) dies, JAX's client
in every other process aborts at once: a fatal log line, a C++ stack dump,
then SIGABRT, with no hook that Python could answer (docs/distributed.md).
`peers.relay_standard_error` therefore routes each other process's standard
error (its file descriptor, which the C++ side writes to) through this
script, a child process of its own. It passes every byte on unchanged until
a fatal line starts; from there it writes the rest to a file, and when the
process has ended it prints one line instead, removes the folders listed
in the cleanup file, and exits (the file itself goes in every case).

Run as a script (`python stderr_relay.py MESSAGE DUMP CLEANUP`), never
imported by the package: it loads the standard library only, so that it
costs a few megabytes beside the training process.
"""

import os
import re
import shutil
import signal
import sys

# absl's FATAL log lines ("F1130 12:00:00.000000 ..."; "F0000 00:00:..." before
# absl is set up) and the C++ runtime's own last words.
FATAL = re.compile(rb"(?m)^(F\d{4} \d\d:\d\d:|\*\*\* Check failure stack trace|terminate called)")
CHUNK = 1 << 16


def write_all(sink: int, data: bytes) -> None:
    """Writes all of `data`; a sink that is gone is given up on, and the source still read."""
    try:
        while data:
            data = data[os.write(sink, data) :]
    except OSError:
        pass


def relay(source: int, sink: int, dump_path: str) -> bytes | None:
    """Copies `source` to `sink` until the first fatal line, the rest to `dump_path`.
    Returns the fatal line (None when none came)."""
    dump = None
    fatal = None
    while True:
        chunk = os.read(source, CHUNK)
        if not chunk:
            break
        if dump is None:
            found = FATAL.search(chunk)
            if found is None:
                write_all(sink, chunk)
                continue
            write_all(sink, chunk[: found.start()])
            chunk = chunk[found.start() :]
            fatal = chunk.split(b"\n", 1)[0]
            dump = open(dump_path, "wb")
        dump.write(chunk)
    if dump is not None:
        dump.close()
    return fatal


def main(argv):
    message, dump_path, cleanup_path = argv
    # Signals are for the training process; this one ends when its standard error closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fatal = relay(0, 1, dump_path)
    folders = []
    if os.path.isfile(cleanup_path):
        with open(cleanup_path, encoding="utf-8") as f:
            folders = f.read().splitlines()
        os.remove(cleanup_path)
    if fatal is None:
        return 0
    reason = re.sub(rb"^F\d{4} [\d:.]+ +\d+ [^\]]*\] ?", b"", fatal).decode("utf-8", "replace")
    reason = reason.strip().split(". ")[0][:200]  # its first sentence; the file has the rest
    line = message.replace("{reason}", reason).replace("{dump}", dump_path)
    for folder in folders:  # first: once the line is out, they are gone
        shutil.rmtree(folder, ignore_errors=True)
    write_all(1, (line + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
