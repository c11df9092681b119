"""The batching rule of `keras-transformer-serve` (`serve_batching.Batcher`), with a
recording search function in place of the model: what goes into which batch.

The HTTP server on a real export is tested in tests/runtime/test_serve.py."""

import asyncio
import threading
import time

import pytest
from keras_transformer_runtime.serve_batching import Batcher, BatchLimits, QueueFull

GREEDY = (1, None, None)
BEAM = (4, 0.6, None)


class Recorder:
    """A `run_batch` that records its batches and answers each payload with ("t" + payload)."""

    def __init__(self, gate=None):
        self.batches = []  # (worker, key, payloads)
        self.lock = threading.Lock()
        self.gate = gate  # a threading.Event each batch waits for

    def __call__(self, worker, key, payloads):
        with self.lock:
            self.batches.append((worker, key, list(payloads)))
        if self.gate is not None:
            assert self.gate.wait(10)
        return ["t" + str(p) for p in payloads]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


async def started(recorder, workers=1, **limits):
    batcher = Batcher(recorder, workers, BatchLimits(**limits))
    await batcher.start()
    return batcher


def submit(batcher, key, payloads, lengths=None):
    return batcher.submit(key, lengths or [3] * len(payloads), payloads)


def test_concurrent_requests_share_a_batch_and_get_their_own_results_in_order():
    async def main():
        recorder = Recorder()
        batcher = await started(recorder, max_wait_ms=200)
        tickets = [submit(batcher, GREEDY, [f"{r}.{i}" for i in range(3)]) for r in range(4)]
        results = await asyncio.gather(*(t.future for t in tickets))
        await batcher.close()
        return recorder, results

    recorder, results = run(main())
    assert len(recorder.batches) == 1 and len(recorder.batches[0][2]) == 12
    assert results == [[f"t{r}.{i}" for i in range(3)] for r in range(4)]


def test_a_full_batch_leaves_without_waiting_and_settings_never_mix():
    async def main():
        recorder = Recorder()
        # A wait far longer than the test: only a full batch can leave.
        batcher = await started(recorder, max_batch_sentences=4, max_wait_ms=60_000)
        greedy = submit(batcher, GREEDY, list("abcd"))
        beam = submit(batcher, BEAM, list("wxyz"))
        await asyncio.gather(greedy.future, beam.future)
        await batcher.close()
        return recorder

    batches = run(main()).batches
    assert sorted((key, payloads) for _, key, payloads in batches) == [
        (GREEDY, list("abcd")),
        (BEAM, list("wxyz")),
    ]


def test_a_long_request_does_not_starve_later_ones():
    async def main():
        gate = threading.Event()
        recorder = Recorder(gate)
        batcher = await started(recorder, max_batch_sentences=8, max_wait_ms=0)
        long = submit(batcher, GREEDY, [f"L{i}" for i in range(100)])
        await asyncio.sleep(0.05)  # the first batch (8 of the long request) is running
        short = [submit(batcher, GREEDY, [f"S{r}"]) for r in range(3)]
        gate.set()
        await asyncio.gather(long.future, *(t.future for t in short))
        await batcher.close()
        return recorder

    batches = [payloads for _, _, payloads in run(main()).batches]
    assert batches[0] == [f"L{i}" for i in range(8)]
    # Round robin: the next batch takes each waiting request in turn.
    assert sorted(p for p in batches[1] if p.startswith("S")) == ["S0", "S1", "S2"]
    assert len(batches[1]) == 8
    assert sum(len(b) for b in batches) == 103


def test_a_request_is_taken_shortest_first_within_the_token_budget():
    async def main():
        recorder = Recorder()
        batcher = await started(recorder, max_batch_sentences=32, max_batch_tokens=20)
        lengths = [9, 2, 5, 2, 9, 1]
        ticket = submit(batcher, GREEDY, list(range(6)), lengths)
        results = await ticket.future
        await batcher.close()
        return recorder, results, lengths

    recorder, results, lengths = run(main())
    assert results == [f"t{i}" for i in range(6)]  # back in input order
    batches = [payloads for _, _, payloads in recorder.batches]
    assert [p for b in batches for p in b] == [5, 1, 3, 2, 0, 4]  # shortest first, stable
    for batch in batches:  # padded tokens within the budget
        assert len(batch) * max(lengths[p] for p in batch) <= 20
    assert batches[0] == [5, 1, 3, 2]  # 4 x 5 = 20 tokens; a fifth of 9 would be 45


def test_sentences_left_over_wait_for_the_burst_their_batch_brings_back():
    async def main():
        gate = threading.Event()
        recorder = Recorder(gate)
        batcher = await started(recorder, max_batch_sentences=4, max_wait_ms=2000)
        first = [submit(batcher, GREEDY, [p]) for p in "abcdef"]  # a full batch and 2 over
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(*(t.future for t in first[:4]))
        # The clients answered send again: the 2 left over leave with them.
        again = [submit(batcher, GREEDY, [p]) for p in "gh"]
        await asyncio.gather(*(t.future for t in first[4:] + again))
        await batcher.close()
        return recorder

    batches = [payloads for _, _, payloads in run(main()).batches]
    assert batches == [list("abcd"), list("efgh")]


def test_a_lone_client_and_a_complete_burst_do_not_wait_for_the_quiet_gap():
    async def main():
        recorder = Recorder()
        batcher = await started(recorder, max_batch_sentences=32, quiet_ms=2000, max_wait_ms=4000)
        # One client, request after request: nobody else is expected, each leaves at once.
        start = time.monotonic()
        for payload in "abc":
            await submit(batcher, GREEDY, [payload]).future
        lone = time.monotonic() - start
        # Three clients answered together; two send again: their batch waits for the third.
        await asyncio.gather(*(submit(batcher, GREEDY, [p]).future for p in "def"))
        start = time.monotonic()
        back = [submit(batcher, GREEDY, [p]) for p in "gh"]
        await asyncio.sleep(0.2)
        waited = not any(t.future.done() for t in back)
        back.append(submit(batcher, GREEDY, ["i"]))  # the burst is complete: it leaves
        await asyncio.gather(*(t.future for t in back))
        burst = time.monotonic() - start
        await batcher.close()
        return recorder, lone, waited, burst

    recorder, lone, waited, burst = run(main())
    assert lone < 1.0  # not three quiet gaps of 2 s
    assert waited and burst < 1.5  # not the 2 s gap after the third arrival
    batches = [payloads for _, _, payloads in recorder.batches]
    assert batches == [["a"], ["b"], ["c"], list("def"), list("ghi")]


def test_clients_that_did_not_come_back_are_not_waited_for():
    async def main():
        batcher = await started(Recorder(), quiet_ms=2000, max_wait_ms=300)
        # Three clients answered together, and none sends again within max_wait_ms.
        await asyncio.gather(*(submit(batcher, GREEDY, [p]).future for p in "abc"))
        await asyncio.sleep(0.4)
        start = time.monotonic()
        await submit(batcher, GREEDY, ["d"]).future
        alone = time.monotonic() - start
        # Again, but a lone client starts at once and keeps sending: only its first
        # request can wait for the three (at most max_wait_ms), not every one.
        await asyncio.gather(*(submit(batcher, GREEDY, [p]).future for p in "efg"))
        start = time.monotonic()
        for payload in "hijkl":
            await submit(batcher, GREEDY, [payload]).future
        steady = time.monotonic() - start
        await batcher.close()
        return alone, steady

    alone, steady = run(main())
    assert alone < 0.15  # not the 300 ms max_wait_ms
    assert steady < 0.6  # one wait of 300 ms at most, not five


def test_after_a_crowd_a_lone_client_is_not_held_by_its_absent_clients():
    """128 clients for three requests each, then one client alone: once the crowd's
    answers are older than max_wait_ms, the lone client's requests leave at once."""

    async def main():
        batcher = await started(Recorder(), quiet_ms=200, max_wait_ms=400)

        async def client(requests):
            for _ in range(requests):
                await submit(batcher, GREEDY, ["x"]).future

        await asyncio.gather(*(client(3) for _ in range(128)))
        start = time.monotonic()
        await client(20)
        alone = time.monotonic() - start
        await batcher.close()
        return alone

    assert run(main()) < 1.2  # the crowd's 400 ms at most, not 20 quiet gaps of 200 ms


def test_free_workers_share_the_waiting_sentences():
    async def main():
        recorder = Recorder()
        batcher = await started(recorder, workers=2, max_batch_sentences=32, max_wait_ms=100)
        tickets = [submit(batcher, GREEDY, [i]) for i in range(16)]
        await asyncio.gather(*(t.future for t in tickets))
        await batcher.close()
        return recorder

    batches = run(main()).batches
    assert sorted(len(payloads) for _, _, payloads in batches) == [8, 8]
    assert sorted(worker for worker, _, _ in batches) == [0, 1]


def test_a_full_queue_refuses_then_takes_requests_again():
    async def main():
        gate = threading.Event()
        recorder = Recorder(gate)
        batcher = await started(
            recorder, max_batch_sentences=2, max_wait_ms=0, max_queue_sentences=4
        )
        first = submit(batcher, GREEDY, ["a", "b"])
        await asyncio.sleep(0.05)  # running: the queue is empty again
        waiting = submit(batcher, GREEDY, ["c", "d", "e", "f"])
        assert batcher.is_full()
        with pytest.raises(QueueFull, match="queue is full") as refused:
            submit(batcher, GREEDY, ["g"])
        assert refused.value.retry_after >= 1
        gate.set()
        await asyncio.gather(first.future, waiting.future)
        assert not batcher.is_full()
        again = await submit(batcher, GREEDY, ["h"]).future
        await batcher.close()
        return again

    assert run(main()) == ["th"]


def test_a_cancelled_request_leaves_the_queue_unsearched():
    async def main():
        gate = threading.Event()
        recorder = Recorder(gate)
        batcher = await started(recorder, max_batch_sentences=2, max_wait_ms=0)
        running = submit(batcher, GREEDY, ["a", "b"])
        await asyncio.sleep(0.05)
        gone = submit(batcher, GREEDY, ["x", "y", "z"])
        assert batcher.queued_sentences == 3
        batcher.cancel(gone)
        assert batcher.queued_sentences == 0 and gone.future.cancelled()
        gate.set()
        await running.future
        await batcher.close()
        return recorder

    searched = [p for _, _, payloads in run(main()).batches for p in payloads]
    assert searched == ["a", "b"]


def test_a_failing_search_fails_its_requests_and_the_batcher_goes_on():
    calls = []

    def flaky(worker, key, payloads):
        calls.append(list(payloads))
        if "bad" in payloads:
            raise RuntimeError("no such graph")
        return payloads

    async def main():
        batcher = Batcher(flaky, 1, BatchLimits(max_batch_sentences=1, max_wait_ms=0))
        await batcher.start()
        with pytest.raises(RuntimeError, match="no such graph"):
            await submit(batcher, GREEDY, ["bad"]).future
        good = await submit(batcher, GREEDY, ["good"]).future
        await batcher.close()
        return good

    assert run(main()) == ["good"]


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_batch_sentences must be a positive integer"):
        BatchLimits(max_batch_sentences=0)
    with pytest.raises(ValueError, match="max_wait_ms must be a non-negative number"):
        BatchLimits(max_wait_ms=-1)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        Batcher(Recorder(), 0)
