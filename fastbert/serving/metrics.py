"""The server's Prometheus metrics, in a registry of its own (several servers in one process, as in the tests, do
not share counters): requests by endpoint and status, request latency, queue depth and wait, batch sizes in texts
and tokens, forward time, tokens embedded and the tokens per second of the last forward."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from fastbert.serving.batcher import BatchRecord

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
TEXT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The metrics of one server; ``queue_depth`` is read at scrape time."""

    def __init__(self, queue_depth: Callable[[], int]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("fastbert_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("fastbert_request_seconds", "time from request to response, by endpoint",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("fastbert_queue_seconds", "time a request waited for its batch",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.depth = Gauge("fastbert_queue_depth", "requests waiting in the queue", registry=r)
        self.depth.set_function(queue_depth)
        self.batch_tokens = Histogram("fastbert_batch_tokens", "real (unpadded) tokens per forward",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.batch_texts = Histogram("fastbert_batch_texts", "texts per forward", buckets=TEXT_BUCKETS, registry=r)
        self.forward_seconds = Histogram("fastbert_forward_seconds", "time of one forward (tokens to rows)",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("fastbert_tokens", "tokens run through the model", registry=r)
        self.texts = Counter("fastbert_texts", "texts (or pairs) run through the model", registry=r)
        self.tokens_per_second = Gauge("fastbert_tokens_per_second", "real tokens per second of the last forward",
                                       registry=r)

    def record_batch(self, record: BatchRecord) -> None:
        """Called by the batcher's worker after each forward."""
        self.batch_tokens.observe(record.tokens)
        self.batch_texts.observe(record.texts)
        self.forward_seconds.observe(record.seconds)
        self.tokens.inc(record.tokens)
        self.texts.inc(record.texts)
        if record.seconds > 0:
            self.tokens_per_second.set(record.tokens / record.seconds)

    def record_wait(self, seconds: float) -> None:
        self.queue_seconds.observe(seconds)

    def record_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)
