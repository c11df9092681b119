"""Batching across requests for `keras-transformer-serve`: a plain class, no HTTP.

The server's handlers hand `Batcher.submit` the tokenized sentences of one
request with its search settings, and await the ticket it returns. The
batcher gathers the sentences of every waiting request into batches and
runs each batch on a worker thread (`run_batch`), where ONNX Runtime
releases the GIL. Its rules, and why:

- One queue per search settings (`key`): a batch is one search, so requests
  of different settings never share one.
- A batch holds at most `max_batch_sentences` sentences and, padded to its
  longest source, at most `max_batch_tokens` source tokens: the token
  budget keeps a batch of long sentences from taking the memory and time of
  many short ones.
- A batch is sent, once a worker is free, when its queue holds a full
  batch; or when no sentence has arrived for `quiet_ms`; or `max_wait_ms`
  after the wait began: when the oldest waiting sentence arrived, or when
  the worker came free if that was later. Concurrent requests arrive in
  bursts (the clients of a batch, answered together, send again
  together): the quiet gap ends a burst, so a batch gathers the whole
  burst without waiting longer than it lasts. Sentences left over from a full batch wait for the burst
  that batch's answers bring back, rather than leave at once as a small
  batch that the burst then waits behind. `max_wait_ms` bounds the
  latency a steady trickle of requests could add.
- The wait for a batch to fill is for clients that were just answered and
  may send again: each answered request counts one, each arrival takes off
  the latest; one not back within `max_wait_ms` of its answer is not
  counted. Once none is outstanding (every client of the last batches is
  back, or nobody was answered), the batch leaves at once: a lone client
  does not wait for the quiet gap, and a burst that is complete leaves
  without it.
- A batch takes one sentence from each waiting request in turn (round
  robin, requests in arrival order) until it is full. With k requests
  waiting, each gets at least `max_batch_sentences // k` places in a batch,
  so one request of 10,000 lines never starves the others: a request that
  arrives behind it waits for one batch, not for its 10,000 lines. A
  request's own sentences are taken shortest first, so that its later
  batches hold sentences of like length.
- With several workers free, the waiting sentences are shared out evenly
  among them (up to a full batch each) rather than sent as one batch: on a
  CPU, each worker searches on its own cores, so two half batches at once
  finish sooner than one whole batch on half the cores.
- The queue is bounded (`max_queue_sentences`): a request that does not fit
  raises `QueueFull` (the server answers 503 with Retry-After) rather than
  holding unbounded memory.
- `cancel` (a request timed out, or its client left) removes the sentences
  of a request that no batch has taken yet; those already in a batch finish
  and their results are dropped.

Every method runs on the event loop's thread; only `run_batch` runs on the
worker threads. Needs the standard library only.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """The batching rule's settings (see the module docstring).

    Attributes:
        max_batch_sentences: sentences in one batch at most.
        max_batch_tokens: a batch's sentences times its longest source
            (the padded source tokens) at most; a single sentence longer
            than this still runs, alone.
        max_wait_ms: how long the oldest waiting sentence waits at most for
            a batch to fill while a worker is free.
        quiet_ms: a batch that is not full is sent once no sentence has
            arrived for this long (at most `max_wait_ms`).
        max_queue_sentences: sentences waiting (not yet in a batch) at most.
    """

    max_batch_sentences: int = 32
    max_batch_tokens: int = 4096
    max_wait_ms: float = 25.0
    quiet_ms: float = 2.0
    max_queue_sentences: int = 20000

    def __post_init__(self):
        for name in ("max_batch_sentences", "max_batch_tokens", "max_queue_sentences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer. Received: {name}={value!r}")
        for name in ("max_wait_ms", "quiet_ms"):
            value = getattr(self, name)
            if not value >= 0 or math.isinf(value):
                raise ValueError(
                    f"{name} must be a non-negative number. Received: {name}={value!r}"
                )


class QueueFull(Exception):
    """The queue has no room for a request's sentences; `retry_after` is in whole seconds."""

    def __init__(self, message, retry_after=1):
        super().__init__(message)
        self.retry_after = retry_after


class Ticket:
    """One request's sentences in the batcher; `await ticket.future` gives its results in order."""

    def __init__(self, key, lengths, payloads, future):
        self.key = key
        self.lengths = lengths
        self.payloads = payloads
        self.results = [None] * len(payloads)
        self.left = len(payloads)  # results still to come
        # Unbatched sentences, shortest first (a stable sort keeps input order among equals).
        self.pending = collections.deque(sorted(range(len(payloads)), key=lengths.__getitem__))
        self.future = future
        self.arrived = time.monotonic()
        self.cancelled = False


class Batcher:
    """Gathers the sentences of concurrent requests into batches run on worker threads.

    Args:
        run_batch: `run_batch(worker, key, payloads) -> results`, one result per
            payload in order; called on a worker thread with the worker's
            index (0 to `workers - 1`), so that each worker may hold a
            translator of its own.
        workers: batches run at once, each on its own thread.
        limits: `BatchLimits`.
        observe_batch: optional `observe_batch(sentences, padded_tokens,
            seconds, queue_wait_seconds)`, called on the event loop after
            each batch (the server's metrics).
    """

    def __init__(self, run_batch, workers=1, limits=None, observe_batch=None):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer. Received: workers={workers!r}")
        self.limits = limits or BatchLimits()
        self._run_batch = run_batch
        self._observe_batch = observe_batch
        self._queues = {}  # key -> OrderedDict(id(ticket) -> ticket) with unbatched sentences
        self._queued = 0  # unbatched sentences
        self._last_arrival = {}  # key -> when its latest request arrived
        self._free_since = 0.0  # when a worker last came free
        # When the requests were answered whose clients may still send again
        # (oldest first; see _schedule).
        self._returning = collections.deque()
        self._free = list(range(workers - 1, -1, -1))  # free worker indices (a stack)
        self.workers = workers
        self._running = 0
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="batch")
        self._wake = None
        self._task = None
        self._closed = False

    # ------------------------------------------------------------------ state

    @property
    def queued_sentences(self):
        """Sentences waiting for a batch."""
        return self._queued

    @property
    def running_batches(self):
        """Batches being searched now."""
        return self._running

    def is_full(self):
        """Whether the queue is full (a new sentence would be refused)."""
        return self._queued >= self.limits.max_queue_sentences

    # ------------------------------------------------------------------ life

    async def start(self):
        """Starts the scheduling task on the running event loop."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._schedule())

    async def close(self):
        """Stops scheduling; fails what still waits; waits for running batches to end."""
        self._closed = True
        for queue in self._queues.values():
            for ticket in list(queue.values()):
                self._fail(ticket, RuntimeError("the server is shutting down"))
        self._queues.clear()
        self._queued = 0
        if self._task is not None:
            self._wake.set()
            await self._task
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)

    # ------------------------------------------------------------------ requests

    def submit(self, key, lengths, payloads):
        """Queues one request's sentences (`lengths[i]` tokens, `payloads[i]` for `run_batch`).

        Returns a `Ticket`; `await ticket.future` gives the list of results
        in input order. Raises `QueueFull` when the sentences do not fit.
        """
        if self._closed:
            raise QueueFull("the server is shutting down", retry_after=1)
        if len(lengths) != len(payloads):
            raise ValueError("lengths and payloads must have the same length.")
        future = asyncio.get_running_loop().create_future()
        ticket = Ticket(key, list(lengths), list(payloads), future)
        if not payloads:
            future.set_result([])
            return ticket
        room = self.limits.max_queue_sentences - self._queued
        if len(payloads) > room:
            raise QueueFull(
                f"the queue is full: {self._queued} sentences wait and this request has "
                f"{len(payloads)}, over the limit of {self.limits.max_queue_sentences} "
                "(--max-queue-sentences); retry later",
                retry_after=self._retry_after(),
            )
        self._queues.setdefault(key, collections.OrderedDict())[id(ticket)] = ticket
        self._last_arrival[key] = ticket.arrived
        if self._returning:
            # One answered client is back: taken as the latest answered, so that the
            # older answers, of clients that did not come back, expire.
            self._returning.pop()
        self._queued += len(payloads)
        self._wake.set()
        return ticket

    def cancel(self, ticket):
        """Drops the unbatched sentences of `ticket` (a timeout or a client gone)."""
        ticket.cancelled = True
        self._dequeue(ticket)
        if not ticket.future.done():
            ticket.future.cancel()

    def _retry_after(self):
        # A rough wait: one second per full round of batches queued, at least 1.
        per_round = self.limits.max_batch_sentences * self.workers
        return max(1, math.ceil(self._queued / per_round / 4))

    def _dequeue(self, ticket):
        queue = self._queues.get(ticket.key)
        if queue is not None and queue.pop(id(ticket), None) is not None:
            self._queued -= len(ticket.pending)
            ticket.pending.clear()
            if not queue:
                del self._queues[ticket.key]

    def _fail(self, ticket, error):
        if not ticket.future.done():
            ticket.future.set_exception(error)

    # ------------------------------------------------------------------ scheduling

    def _oldest_queue(self):
        """The key whose first waiting request arrived first (settings served in arrival order)."""
        return min(self._queues, key=lambda k: next(iter(self._queues[k].values())).arrived)

    async def _schedule(self):
        limits = self.limits
        while not self._closed:
            if not self._free or not self._queued:
                await self._wake.wait()
                self._wake.clear()
                continue
            key = self._oldest_queue()
            queue = self._queues[key]
            waiting = sum(len(t.pending) for t in queue.values())
            oldest = next(iter(queue.values())).arrived
            # The wait for a batch to fill starts when its oldest sentence arrived,
            # or when a worker last came free if later: the requests a batch
            # just answered are about to come back, and the sentences left over
            # from the batch before should not leave without them.
            start = max(oldest, self._free_since)
            deadline = start + limits.max_wait_ms / 1000
            last = self._last_arrival[key]
            if last >= start:
                deadline = min(deadline, last + limits.quiet_ms / 1000)
            wait = deadline - time.monotonic()
            self._forget_returning()

            if waiting < limits.max_batch_sentences and wait > 0 and self._returning:
                # Not a full batch yet, and clients just answered may send again: wait
                # for more, until arrivals pause or the oldest has waited enough. With
                # every answered client back (or none answered), nobody is expected:
                # the batch leaves at once, so a lone client never waits for the gap.
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except asyncio.TimeoutError:
                    pass
                continue
            # Share the waiting sentences among the free workers, a full batch each at most.
            while self._free and key in self._queues:
                share = math.ceil(waiting / len(self._free))
                taken = self._take(key, min(share, limits.max_batch_sentences))
                waiting -= len(taken)
                self._launch(key, taken)

    def _forget_returning(self):
        """Drops the answered clients that have not sent again within `max_wait_ms`."""
        oldest = time.monotonic() - self.limits.max_wait_ms / 1000
        while self._returning and self._returning[0] < oldest:
            self._returning.popleft()

    def _take(self, key, size):
        """Up to `size` sentences of queue `key`, one per request in turn, within the token budget."""
        queue = self._queues[key]
        taken = []  # (ticket, index)
        longest = 0
        budget = self.limits.max_batch_tokens
        while len(taken) < size and queue:
            progressed = False
            for ticket in list(queue.values()):
                if len(taken) == size:
                    break
                index = ticket.pending[0]
                length = max(longest, ticket.lengths[index], 1)
                if taken and length * (len(taken) + 1) > budget:
                    continue  # may fit a shorter sentence of another request
                ticket.pending.popleft()
                taken.append((ticket, index))
                longest = length
                progressed = True
                if not ticket.pending:
                    del queue[id(ticket)]
            if not progressed:
                break
        if not queue:
            del self._queues[key]
        self._queued -= len(taken)
        return taken

    def _launch(self, key, taken):
        worker = self._free.pop()
        self._running += 1
        payloads = [ticket.payloads[index] for ticket, index in taken]
        longest = max(ticket.lengths[index] for ticket, index in taken)
        started = time.monotonic()
        queue_wait = started - min(ticket.arrived for ticket, _ in taken)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._run_batch, worker, key, payloads)

        def done(future):
            self._free.append(worker)
            self._free_since = time.monotonic()
            self._running -= 1
            self._wake.set()
            error = future.exception()
            results = None if error is not None else future.result()
            if error is None and len(results) != len(taken):
                error = RuntimeError(
                    f"run_batch returned {len(results)} results for {len(taken)} sentences"
                )
            for i, (ticket, index) in enumerate(taken):
                if ticket.future.done():
                    continue  # cancelled, timed out, or failed by an earlier batch
                if error is not None:
                    self.cancel_with_error(ticket, error)
                    continue
                ticket.results[index] = results[i]
                ticket.left -= 1
                if ticket.left == 0:
                    ticket.future.set_result(ticket.results)
                    self._returning.append(time.monotonic())
            self._forget_returning()
            if self._observe_batch is not None:
                self._observe_batch(
                    len(taken), longest * len(taken), time.monotonic() - started, queue_wait
                )

        future.add_done_callback(done)

    def cancel_with_error(self, ticket, error):
        """Fails `ticket` with `error` and drops its unbatched sentences."""
        self._dequeue(ticket)
        self._fail(ticket, error)
