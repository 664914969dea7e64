"""Dynamic batching across requests by a token budget: one worker thread owns the model.

A request's tokenized inputs enter a bounded queue as one `Job` (`Batcher.submit`; a full queue raises `QueueFull`
at once, so that the server answers 429 instead of letting clients pile up). The worker takes whole jobs from the
head of the queue until the next would pass ``max_batch_tokens`` real tokens (always at least one), cuts their
inputs, job after job (each job's longest first), into batches of at most ``max_batch_tokens`` padded tokens
(`fifo_batches`), runs one padding-free forward per batch, and hands each job its own rows in its own order as soon
as its last batch has run: the jobs finish in the order they came, and the first ones do not wait for the forwards
of the later ones. While a batch runs, new requests queue, so the next batch is as full as the load allows without
any waiting on purpose.

The asyncio side (`Batcher.infer`) waits for its job's result with a timeout; a job whose client gave up before
the worker reached it is skipped."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

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
            self.check_room()
            self.pending.append(job)
            self.condition.notify()
        return job

    def check_room(self) -> None:
        """ShuttingDown after `stop`, QueueFull while the queue is full: what `submit` would raise now. The handler
        asks before tokenizing, so that a refusal costs the server (and the client's wait) as little as it can."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        if len(self.pending) >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")

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
                for job, rows in self.run(jobs):
                    job.loop.call_soon_threadsafe(settle, job.future, rows, None)
            except Exception as err:  # noqa: BLE001 - a failed forward fails its requests, never the worker
                for job in jobs:  # those answered already keep their rows: settle skips a done future
                    job.loop.call_soon_threadsafe(settle, job.future, None, err)

    def run(self, jobs: list[Job]) -> Iterator[tuple[Job, np.ndarray]]:
        """Each job with its rows, as soon as the forward of its last input has run (`fifo_batches`)."""
        inputs = [t for job in jobs for t in job.inputs]
        owner = [k for k, job in enumerate(jobs) for _ in job.inputs]
        left = [len(job.inputs) for job in jobs]
        bounds = np.cumsum([0] + left)
        out: np.ndarray | None = None
        for batch in fifo_batches([[len(t) for t in job.inputs] for job in jobs], self.max_batch_tokens):
            start = time.perf_counter()
            rows = self.engine.run([inputs[i] for i in batch])
            if out is None:
                out = np.empty((len(inputs), rows.shape[1]), dtype=rows.dtype)
            out[batch] = rows
            if self.observer is not None:
                lengths = [len(inputs[i]) for i in batch]
                self.observer.record_batch(BatchRecord(len(batch), sum(lengths), len(batch) * max(lengths),
                                          time.perf_counter() - start))
            for i in batch:
                k = owner[i]
                left[k] -= 1
                if left[k] == 0:
                    yield jobs[k], out[bounds[k]:bounds[k + 1]]


def fifo_batches(lengths: Sequence[Sequence[int]], max_batch_tokens: int) -> list[list[int]]:
    """Indices into the jobs' inputs laid end to end (``lengths``: each job's token counts, in queue order), cut
    into batches of at most ``max_batch_tokens`` tokens counted padded (texts x longest text of the batch): job
    after job, each job's longest input first, so that a job's inputs share as few batches as they can and the
    batches finish the jobs in queue order. An input longer than the budget is a batch on its own."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest, start = 0, 0
    for job in lengths:
        for index in sorted(range(start, start + len(job)), key=lambda i: -job[i - start]):
            size = job[index - start]
            if current and (len(current) + 1) * max(longest, size) > max_batch_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(index)
            longest = max(longest, size)
        start += len(job)
    if current:
        batches.append(current)
    return batches


def settle(future: asyncio.Future, rows: np.ndarray | None, error: BaseException | None) -> None:
    """Resolve a job's future in its event loop (unless its waiter gave up already)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(rows)
