"""Running one measurement in a fresh process (multiprocessing, spawn start method).

A fresh process starts with no framework loaded and no memory freed by an
earlier peer, and one that runs out of memory is killed alone, so the run
goes on with the next measurement.
"""

from __future__ import annotations

import multiprocessing
import traceback


def _child(target, arguments, connection):
    try:
        result = target(*arguments)
    except BaseException as error:
        traceback.print_exc()
        connection.send(("error", f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    connection.send(("ok", result))


def run_in_fresh_process(target, *arguments):
    """Calls `target(*arguments)` in a spawned process and returns `(result, failure)`.

    `target` must be a module-level function and its arguments and result
    picklable. `failure` is None on success, otherwise a line saying why:
    the child's exception, or how it died (SIGKILL is most often the kernel's
    out-of-memory killer). The child prints to this process's terminal.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(target, arguments, sender))
    process.start()
    sender.close()  # the child holds the only sending end: a dead child ends the wait
    try:
        status, value = receiver.recv()
    except EOFError:
        status, value = None, None
    process.join()
    if status == "ok":
        return value, None
    if status == "error":
        return None, value
    if process.exitcode == -9:
        return None, "killed by SIGKILL (out of memory: see dmesg)"
    return None, f"exit status {process.exitcode}"
