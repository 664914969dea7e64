"""Dynamic batching across requests by a real-token budget, in two stages: a planner thread forms batches, the
model's thread runs them.

A request's tokenized inputs enter a bounded queue as one `Job` (`Batcher.submit`; a full queue raises `QueueFull`
at once, so that the server answers 429 instead of letting clients pile up). The planner takes whole jobs from the
head of the queue until the next would pass ``max_batch_tokens`` real tokens (always at least one), cuts their
inputs, job after job, into batches of at most ``max_batch_tokens`` real tokens (`token_batches`: the encoder is
padding-free, so padded tokens cost nothing and are not counted), and hands them to the model's thread through a
queue of ``prefetch`` batches. It cuts as late as it may: when the model's thread is waiting for a batch, or when
the queued jobs already fill the budget (a full batch cannot grow: it is cut while the current forward runs and
waits ready). A batch cut early with the first job that arrived would leave the jobs arriving after it for a
forward later, so under moderate load every job would wait for two or three forwards of one job each. The
inputs are tokenized before they queue, so a late cut costs the model's thread only the cutting. The model's thread
runs one forward per batch and hands each job its own rows, in its own order, as soon as its last batch has run:
the jobs finish in the order they came, and the first ones do not wait for the forwards of the later ones.
Whatever comes after the rows (normalising, encoding the answer) happens on the request's side, not in the model's
thread.

Before the first batch, the model's thread runs ``warmup`` (the server's warm-up forwards) and then sets `ready`.
Every forward runs in the model's thread, the unbatched ones too (`Batcher.call`): torch's OpenMP runs at full
speed only while one thread keeps workers (`fastbert.common.threads`).

The asyncio side (`Batcher.infer`) waits for its job's result with a timeout; a job whose client gave up before
the planner reached it is skipped."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fastbert.common.text import plural
from fastbert.embedding.batching import real_token_batches
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


@dataclass(eq=False)
class Job:
    """One request's inputs, waiting for their rows. ``future`` belongs to the event loop ``loop``; ``rows`` fills
    as its batches run (``left`` inputs still to run)."""

    inputs: list[Tokens]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None  # when its first forward began
    finished_at: float | None = None  # when its last forward ended
    rows: np.ndarray | None = None
    left: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.inputs)


@dataclass
class Timing:
    """Where one request's time went, in seconds (TEI's x-*-time headers): from its handler's start (``start``,
    perf_counter), tokenizing, queued until its first forward began, and from then until its last forward ended."""

    start: float = field(default_factory=time.perf_counter)
    tokenization: float = 0.0
    queue: float = 0.0
    inference: float = 0.0


@dataclass(eq=False)
class Call:
    """A function to run in the model's thread between batches (an unbatched forward); ``future`` as `Job`'s."""

    function: Callable[..., Any]
    args: tuple
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished_at: float | None = None


@dataclass
class Batch:
    """One forward's inputs: (job, index of the input in the job) per row; ``starts``: the jobs whose first
    input it holds (they count as queued until it runs)."""

    items: list[tuple[Job, int]]
    starts: int = 0

    def inputs(self) -> list[Tokens]:
        return [job.inputs[i] for job, i in self.items]


@dataclass
class BatchRecord:
    """What one forward did, for the metrics: texts, real tokens, padded tokens, seconds."""

    texts: int
    tokens: int
    padded_tokens: int
    seconds: float


class Batcher:
    """The queue, the planner and the model's thread; ``observer`` (optional) hears of each job's wait and each
    forward; ``warmup`` (optional) runs in the model's thread before any job, and `ready` is set after it."""

    def __init__(self, engine: Engine, max_batch_tokens: int, max_queue: int, observer: Observer | None = None,
                 warmup: Callable[[], None] | None = None, prefetch: int = 1):
        if max_batch_tokens < 1 or max_queue < 1 or prefetch < 1:
            raise ValueError("max_batch_tokens, max_queue and prefetch must be >= 1")
        self.engine, self.max_batch_tokens, self.max_queue = engine, max_batch_tokens, max_queue
        self.observer, self.warmup = observer, warmup
        self.pending: deque[Job] = deque()
        self.calls: deque[Call] = deque()  # run in the model's thread ahead of the queued jobs
        self.pending_tokens = 0  # real tokens of the jobs in ``pending``
        self.model_idle = False  # the model's thread waits for a batch and none is queued: the planner cuts one now
        self.planned = 0  # jobs (and calls) the planner took that have not started: still queued for a client
        self.reserved = 0  # places held by requests being tokenized (`reserve`): they count as queued
        self.condition = threading.Condition()
        self.batches: queue.Queue[Batch | Call | None] = queue.Queue(maxsize=prefetch)
        self.accepting = True
        self.stopped = False
        self.ready = threading.Event()
        self.warmup_error: BaseException | None = None
        self.thread = threading.Thread(target=self.work, name="fastbert-model", daemon=True)
        self.planner = threading.Thread(target=self.plan, name="fastbert-planner", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.planner.start()

    def depth(self) -> int:
        """Requests waiting: being tokenized with a place reserved, queued, or cut into a batch that has not
        started."""
        return len(self.pending) + len(self.calls) + self.planned + self.reserved

    def reserve(self) -> None:
        """Hold a place in the queue for a request about to be tokenized (QueueFull, ShuttingDown as `check_room`),
        so that requests waiting for the tokenizer count against ``max_queue`` too: under overload the excess is
        refused at once instead of piling up, unbounded, before the queue. The place is taken by `infer(...,
        reserved=True)` or given back by `release`."""
        with self.condition:
            self.check_room()
            self.reserved += 1

    def release(self) -> None:
        """Give back a place `reserve` held, for a request that will not be submitted (its tokenizing failed, its
        client went away)."""
        with self.condition:
            self.reserved -= 1

    def submit(self, inputs: list[Tokens], loop: asyncio.AbstractEventLoop, reserved: bool = False) -> Job:
        """Queue a job; QueueFull when the queue is full, ShuttingDown after `stop`; ``reserved``: its place was
        held by `reserve` (no check: the place is its own)."""
        job = Job(inputs, loop.create_future(), loop)
        with self.condition:
            if reserved:
                self.reserved -= 1
                if not self.accepting:
                    raise ShuttingDown("the server is shutting down")
            else:
                self.check_room()
            self.pending.append(job)
            self.pending_tokens += job.tokens
            self.condition.notify_all()
        return job

    def check_room(self) -> None:
        """ShuttingDown after `stop`, QueueFull while the queue is full: what `submit` would raise now. The handler
        asks before tokenizing, so that a refusal costs the server (and the client's wait) as little as it can."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        if self.depth() >= self.max_queue:
            raise QueueFull(f"the queue is full ({plural(self.max_queue, 'request')} waiting)")

    async def infer(self, inputs: list[Tokens], timeout: float, reserved: bool = False,
                    timing: Timing | None = None) -> np.ndarray:
        """The rows [len(inputs), D] of ``inputs``, in order, once the model's thread has run them; ``reserved``:
        the caller holds a place from `reserve`, which this job takes; ``timing`` (optional) gets the job's queue
        and inference seconds."""
        job = self.submit(inputs, asyncio.get_running_loop(), reserved)
        try:
            rows = await asyncio.wait_for(job.future, timeout)
        except asyncio.TimeoutError as err:  # wait_for cancelled the future: the planner will skip the job
            raise RequestTimeout(f"no result within the request timeout of {timeout:g} s") from err
        if timing is not None:  # answered with rows: its forwards ran, so both ends are set
            assert job.started_at is not None and job.finished_at is not None
            timing.queue = job.started_at - job.queued_at
            timing.inference = job.finished_at - job.started_at
        return rows

    async def call(self, function: Callable[..., Any], *args: Any, timeout: float, timing: Timing | None = None) -> Any:
        """``function(*args)`` in the model's thread, between two batches (the unbatched token-level endpoints'
        forwards), ahead of the queued jobs (calls count against ``max_queue`` like jobs, so they cannot hold the
        jobs back without bound); QueueFull, ShuttingDown and RequestTimeout as `infer`; ``timing`` as `infer`'s
        (the function's run is its inference)."""
        loop = asyncio.get_running_loop()
        call = Call(function, args, loop.create_future(), loop)
        with self.condition:
            self.check_room()
            self.calls.append(call)
            self.condition.notify_all()
        try:
            result = await asyncio.wait_for(call.future, timeout)
        except asyncio.TimeoutError as err:  # cancelled: the model's thread will skip it
            raise RequestTimeout(f"no result within the request timeout of {timeout:g} s") from err
        if timing is not None:  # answered with a result: the function ran, so both ends are set
            assert call.started_at is not None and call.finished_at is not None
            timing.queue = call.started_at - call.queued_at
            timing.inference = call.finished_at - call.started_at
        return result

    def stop(self, timeout: float | None = None) -> None:
        """Accept no more jobs, let the threads finish the queued ones, and wait for them."""
        with self.condition:
            self.accepting = False
            self.stopped = True
            self.condition.notify_all()
        for thread in (self.planner, self.thread):
            if thread.is_alive():
                thread.join(timeout)

    def take(self) -> list[Job] | Call:
        """The next `Call`, else whole jobs from the head of the queue, up to the token budget (at least one), once
        the model's thread waits for a batch or the queue fills the budget (module docstring); [] once stopped and
        empty."""
        with self.condition:
            while not self.stopped and not self.calls and not (
                    self.pending and (self.model_idle or self.pending_tokens >= self.max_batch_tokens)):
                self.condition.wait()
            if self.calls:
                self.planned += 1
                return self.calls.popleft()
            jobs: list[Job] = []
            total = 0
            while self.pending:
                job = self.pending[0]
                if job.future.cancelled():  # its client timed out or went away
                    self.pending_tokens -= self.pending.popleft().tokens
                    continue
                if jobs and total + job.tokens > self.max_batch_tokens:
                    break
                jobs.append(self.pending.popleft())
                total += job.tokens
            self.pending_tokens -= total
            self.planned += len(jobs)
            if jobs:  # this batch is the idle model's; the next waits for its own reason (with only cancelled
                self.model_idle = False  # jobs dropped, the model still waits: the next job is cut at once)
            return jobs

    def next_batch(self) -> Batch | Call | None:
        """The model's thread: the next batch (None: the planner is done), saying it waits when none is queued."""
        with self.condition:
            self.model_idle = self.batches.empty()
            if self.model_idle:
                self.condition.notify_all()
        batch = self.batches.get()
        with self.condition:  # fed (perhaps by a batch that was on its way when it asked): not waiting any more
            self.model_idle = False
        return batch

    def plan(self) -> None:
        """The planner: jobs into batches, into the model's queue (which holds ``prefetch`` of them)."""
        while True:
            jobs = self.take()
            if isinstance(jobs, Call):
                self.batches.put(jobs)
                continue
            if not jobs:
                if self.stopped and not self.pending:
                    self.batches.put(None)
                    return
                continue
            if self.observer is not None:
                now = time.perf_counter()
                for job in jobs:
                    self.observer.record_wait(now - job.queued_at)
            owners = [(job, i) for job in jobs for i in range(len(job.inputs))]
            for job in jobs:
                job.left = len(job.inputs)
            for batch in token_batches([[len(t) for t in job.inputs] for job in jobs], self.max_batch_tokens):
                items = [owners[i] for i in batch]
                self.batches.put(Batch(items, starts=sum(1 for _, i in items if i == 0)))

    def work(self) -> None:
        """The model's thread: the warm-up, then one forward per batch until the planner says it is done."""
        try:
            if self.warmup is not None:
                self.warmup()
        except Exception as err:  # noqa: BLE001 - kept for /health and the log; the server stays unready
            self.warmup_error = err
            self.accepting = False  # new requests are answered 503; the queued ones below
            traceback.print_exc()
        else:
            self.ready.set()
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            if isinstance(batch, Call):
                with self.condition:
                    self.planned -= 1
                self.run_call(batch)
                continue
            with self.condition:
                self.planned -= batch.starts
            # a job whose client gave up after it was cut (timeout, disconnect) is not run
            batch.items = [(job, i) for job, i in batch.items if not job.future.cancelled()]
            if not batch.items:
                continue
            try:
                if self.warmup_error is not None:
                    raise ShuttingDown(f"the server's warm-up failed ({self.warmup_error!r}); see its log")
                self.run(batch)
            except Exception as err:  # noqa: BLE001 - a failed forward fails its requests, never the worker
                for job in dict.fromkeys(job for job, _ in batch.items):
                    if job.left >= 0:  # not failed already by an earlier batch
                        job.left = -1  # its other batches' rows no longer answer it
                        answer(job, None, err)

    def run_call(self, call: Call) -> None:
        """A `Call`'s function, its result or error to its caller (nothing when the caller gave up)."""
        if call.future.cancelled():
            return
        try:
            if self.warmup_error is not None:
                raise ShuttingDown(f"the server's warm-up failed ({self.warmup_error!r}); see its log")
            call.started_at = time.perf_counter()
            result = call.function(*call.args)
            call.finished_at = time.perf_counter()
        except Exception as err:  # noqa: BLE001 - its request fails, never the model's thread
            answer(call, None, err)
        else:
            answer(call, result, None)

    def run(self, batch: Batch) -> None:
        """One forward; each job whose last input this was gets its rows."""
        inputs = batch.inputs()
        start = time.perf_counter()
        for job, _ in batch.items:
            if job.started_at is None:
                job.started_at = start
        rows = self.engine.run(inputs)
        end = time.perf_counter()
        if self.observer is not None:
            lengths = [len(t) for t in inputs]
            self.observer.record_batch(BatchRecord(len(inputs), sum(lengths), len(inputs) * max(lengths), end - start))
        for (job, index), row in zip(batch.items, rows, strict=True):
            if job.left <= 0:
                continue
            if job.rows is None:
                job.rows = np.empty((len(job.inputs), rows.shape[1]), dtype=rows.dtype)
            job.rows[index] = row
            job.left -= 1
            if job.left == 0:
                job.finished_at = end
                answer(job, job.rows, None)


def token_batches(lengths: Sequence[Sequence[int]], max_batch_tokens: int) -> list[list[int]]:
    """Indices into the jobs' inputs laid end to end (``lengths``: each job's token counts, in queue order), cut in
    that order into batches of at most ``max_batch_tokens`` real tokens: the batches finish the jobs in queue order.
    The rule is `fastbert embed`'s (`fastbert.embedding.batching.real_token_batches`: real tokens, an input longer
    than the budget alone) in arrival order rather than longest first."""
    flat = [size for job in lengths for size in job]
    return real_token_batches(flat, max_batch_tokens, longest_first=False)


def answer(job: Job | Call, result: Any, error: BaseException | None) -> None:
    """From the model's thread: settle the job's (or call's) future in its event loop; nothing when that loop has
    closed (its waiter is gone), so that the model's thread never dies of a client's end."""
    try:
        job.loop.call_soon_threadsafe(settle, job.future, result, error)
    except RuntimeError:  # the loop is closed
        pass


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Resolve a job's (or call's) future in its event loop (unless its waiter gave up already)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
