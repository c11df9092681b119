"""The Prometheus metrics of `keras-transformer-serve` (`GET /metrics`), on a registry of their own.

Names start with `kt_serve_`. Latencies are in seconds, batch sizes in
sentences; the queue depth is read when the metrics are scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServeMetrics"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    """Counters, gauges and histograms of one server.

    Args:
        queued: a function giving the sentences waiting for a batch now.
        running: a function giving the batches being searched now.
    """

    def __init__(self, queued, running):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kt_serve_requests",
            "Translation requests answered, by HTTP status.",
            ["status"],
            registry=r,
        )
        self.sentences = Counter(
            "kt_serve_sentences", "Sentences translated (empty ones included).", registry=r
        )
        self.request_seconds = Histogram(
            "kt_serve_request_seconds",
            "Time from a translation request's body read to its answer, by HTTP status.",
            ["status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_sentences = Histogram(
            "kt_serve_batch_sentences",
            "Sentences in each batch searched.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "kt_serve_batch_padded_tokens",
            "Source tokens of each batch, padded to its longest sentence.",
            buckets=(16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384),
            registry=r,
        )
        self.batch_seconds = Histogram(
            "kt_serve_batch_seconds",
            "Search time of each batch (tokenized sentences in, text out).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "kt_serve_queue_wait_seconds",
            "How long the oldest sentence of each batch waited for it.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        Gauge(
            "kt_serve_queue_sentences", "Sentences waiting for a batch.", registry=r
        ).set_function(queued)
        Gauge("kt_serve_running_batches", "Batches being searched.", registry=r).set_function(
            running
        )

    def observe_batch(self, sentences, padded_tokens, seconds, queue_wait):
        """Records one batch (the batcher's `observe_batch`)."""
        self.batch_sentences.observe(sentences)
        self.batch_tokens.observe(padded_tokens)
        self.batch_seconds.observe(seconds)
        self.queue_wait_seconds.observe(queue_wait)

    def observe_request(self, status, seconds, sentences=0):
        """Records one answered translation request."""
        label = str(status)
        self.requests.labels(label).inc()
        self.request_seconds.labels(label).observe(seconds)
        if sentences:
            self.sentences.inc(sentences)

    def render(self):
        """The Prometheus text exposition of every metric (bytes)."""
        return generate_latest(self.registry)
