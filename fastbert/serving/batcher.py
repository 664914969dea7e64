"""Dynamic batching across requests by a token budget: one worker thread owns the model.

A request's tokenized inputs enter a bounded queue as one `Job` (`Batcher.submit`; a full queue raises `QueueFull`
at once, so that the server answers 429 instead of letting clients pile up). The worker takes whole jobs from the
head of the queue until the next would pass ``max_batch_tokens`` real tokens (always at least one), sorts all their
inputs by length and cuts them into padded batches of at most ``max_batch_tokens`` (the cut `fastbert embed` uses),
runs one padding-free forward per batch, and hands each job its own rows in its own order. While a batch runs, new
requests queue, so the next batch is as full as the load allows without any waiting on purpose.

The asyncio side (`Batcher.infer`) waits for its job's result with a timeout; a job whose client gave up before
the worker reached it is skipped."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fastbert.embedding import token_budget_batches
from fastbert.serving.engines import Tokens


class Engine(Protocol):
    def run(self, batch: Sequence[Tokens]) -> np.ndarray: ...


class Observer(Protocol):
    """What watches the worker (the metrics): each job's wait in the queue, each forward."""

    def record_wait(self, seconds: float) -> None: ...

    def record_batch(self, record: BatchRecord) -> None: ...


class QueueFull(Exception):
    """The queue holds ``max_queue`` jobs already: answer 429 and let the client retry."""


class ShuttingDown(Exception):
    """The server stopped accepting work (SIGTERM)."""


class RequestTimeout(Exception):
    """A job waited longer than the request timeout."""


@dataclass
class Job:
    """One request's inputs, waiting for their rows. ``future`` belongs to the event loop ``loop``."""

    inputs: list[Tokens]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float = field(default_factory=time.perf_counter)

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.inputs)


@dataclass
class BatchRecord:
    """What one forward did, for the metrics: texts, real tokens, padded tokens, seconds."""

    texts: int
    tokens: int
    padded_tokens: int
    seconds: float


class Batcher:
    """The queue and its worker; ``observer`` (optional) hears of each job's wait and each forward, in the
    worker."""

    def __init__(self, engine: Engine, max_batch_tokens: int, max_queue: int, observer: Observer | None = None):
        if max_batch_tokens < 1 or max_queue < 1:
            raise ValueError("max_batch_tokens and max_queue must be >= 1")
        self.engine, self.max_batch_tokens, self.max_queue = engine, max_batch_tokens, max_queue
        self.observer = observer
        self.pending: deque[Job] = deque()
        self.condition = threading.Condition()
        self.accepting = True
        self.stopped = False
        self.thread = threading.Thread(target=self.work, name="fastbert-batcher", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def depth(self) -> int:
        """Jobs waiting (not counting the batch that runs)."""
        return len(self.pending)

    def submit(self, inputs: list[Tokens], loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a job; QueueFull when the queue is full, ShuttingDown after `stop`."""
        job = Job(inputs, loop.create_future(), loop)
        with self.condition:
            if not self.accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self.pending) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self.pending.append(job)
            self.condition.notify()
        return job

    async def infer(self, inputs: list[Tokens], timeout: float) -> np.ndarray:
        """The rows [len(inputs), D] of ``inputs``, in order, once the worker has run them."""
        job = self.submit(inputs, asyncio.get_running_loop())
        try:
            return await asyncio.wait_for(job.future, timeout)
        except asyncio.TimeoutError as err:  # wait_for cancelled the future: the worker will skip the job
            raise RequestTimeout(f"no result within the request timeout of {timeout:g} s") from err

    def stop(self, timeout: float | None = None) -> None:
        """Accept no more jobs, let the worker finish the queued ones, and wait for it."""
        with self.condition:
            self.accepting = False
            self.stopped = True
            self.condition.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def take(self) -> list[Job]:
        """Whole jobs from the head of the queue, up to the token budget (at least one); [] once stopped and
        empty."""
        with self.condition:
            while not self.pending and not self.stopped:
                self.condition.wait()
            jobs: list[Job] = []
            total = 0
            while self.pending:
                job = self.pending[0]
                if job.future.cancelled():  # its client timed out or went away
                    self.pending.popleft()
                    continue
                if jobs and total + job.tokens > self.max_batch_tokens:
                    break
                jobs.append(self.pending.popleft())
                total += job.tokens
            return jobs

    def work(self) -> None:
        while True:
            jobs = self.take()
            if not jobs:
                if self.stopped and not self.pending:
                    return
                continue
            if self.observer is not None:
                now = time.perf_counter()
                for job in jobs:
                    self.observer.record_wait(now - job.queued_at)
            try:
                results = self.run(jobs)
            except Exception as err:  # noqa: BLE001 - a failed forward fails its requests, never the worker
                for job in jobs:
                    job.loop.call_soon_threadsafe(settle, job.future, None, err)
                continue
            for job, rows in zip(jobs, results, strict=True):
                job.loop.call_soon_threadsafe(settle, job.future, rows, None)

    def run(self, jobs: list[Job]) -> list[np.ndarray]:
        """Each job's rows: all inputs sorted by length and cut by the token budget, one forward per batch."""
        inputs = [t for job in jobs for t in job.inputs]
        out: np.ndarray | None = None
        for batch in token_budget_batches([len(t) for t in inputs], self.max_batch_tokens):
            start = time.perf_counter()
            rows = self.engine.run([inputs[i] for i in batch])
            if out is None:
                out = np.empty((len(inputs), rows.shape[1]), dtype=rows.dtype)
            out[batch] = rows
            if self.observer is not None:
                lengths = [len(inputs[i]) for i in batch]
                self.observer.record_batch(BatchRecord(len(batch), sum(lengths), len(batch) * max(lengths),
                                          time.perf_counter() - start))
        bounds = np.cumsum([0] + [len(job.inputs) for job in jobs])
        assert out is not None, "a job holds at least one input"
        return [out[bounds[k]:bounds[k + 1]] for k in range(len(jobs))]


def settle(future: asyncio.Future, rows: np.ndarray | None, error: BaseException | None) -> None:
    """Resolve a job's future in its event loop (unless its waiter gave up already)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(rows)
