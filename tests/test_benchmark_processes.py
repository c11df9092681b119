"""`benchmarks.throughput.processes`: a measurement in a spawned process, and how it can fail."""

import os
import signal

from benchmarks.throughput.processes import run_in_fresh_process


def _pid_and_sum(a, b):
    return os.getpid(), a + b


def _raises(message):
    raise MemoryError(message)


def _killed():
    os.kill(os.getpid(), signal.SIGKILL)


def _exits(status):
    os._exit(status)


def test_the_result_comes_back_from_another_process():
    (pid, total), failure = run_in_fresh_process(_pid_and_sum, 2, 3)
    assert failure is None and total == 5 and pid != os.getpid()


def test_failures_say_why_and_the_caller_goes_on():
    assert run_in_fresh_process(_raises, "too big") == (None, "MemoryError: too big")
    result, failure = run_in_fresh_process(_killed)
    assert result is None and failure.startswith("killed by SIGKILL")
    assert run_in_fresh_process(_exits, 3) == (None, "exit status 3")
