"""The batcher on its own, with an engine whose row i is a function of input i's ids: each job gets its own rows in
its own order, forwards respect the token budget, a full queue refuses at once, a timed-out job is skipped, stop
finishes the queue."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from fastbert.serving.batcher import Batcher, QueueFull, RequestTimeout, ShuttingDown, Timing, token_batches
from fastbert.serving.engines import Tokens


class SumEngine:
    """Row = (first id, length, sum of ids); records the padded tokens of each forward; ``gate`` holds it."""

    def __init__(self):
        self.padded: list[int] = []
        self.real: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def run(self, batch):
        self.gate.wait(10)
        self.padded.append(len(batch) * max(len(t) for t in batch))
        self.real.append(sum(len(t) for t in batch))
        return np.array([[t.ids[0], len(t), sum(t.ids)] for t in batch], dtype=np.float64)


def tokens(seed: int, count: int) -> list[Tokens]:
    rng = np.random.default_rng(seed)
    return [Tokens(list(rng.integers(1, 1000, size=int(rng.integers(1, 60))))) for _ in range(count)]


def expected(items: list[Tokens]) -> np.ndarray:
    return np.array([[t.ids[0], len(t), sum(t.ids)] for t in items], dtype=np.float64)


def test_each_job_gets_its_own_rows_within_the_budget():
    engine = SumEngine()
    engine.gate.clear()  # the worker holds its first forward until every job is queued
    batcher = Batcher(engine, max_batch_tokens=1024, max_queue=100)
    batcher.start()
    jobs = [tokens(seed, 1 + seed % 7) for seed in range(60)]

    async def all_jobs():
        waiting = asyncio.gather(*(batcher.infer(job, timeout=30) for job in jobs))
        await asyncio.sleep(0.2)
        engine.gate.set()
        return await waiting

    try:
        results = asyncio.run(all_jobs())
    finally:
        batcher.stop()
    for job, rows in zip(jobs, results, strict=True):
        np.testing.assert_array_equal(rows, expected(job))
    assert max(engine.real) <= 1024 and len(engine.real) < 30  # several jobs share forwards


def test_full_queue_refuses_at_once_and_stop_drains():
    engine = SumEngine()
    engine.gate.clear()  # the worker blocks in its first forward
    batcher = Batcher(engine, max_batch_tokens=64, max_queue=2)
    batcher.start()

    async def scenario():
        first = asyncio.ensure_future(batcher.infer(tokens(0, 1), timeout=30))
        await asyncio.sleep(0.2)  # the worker took it and waits at the gate
        queued = [asyncio.ensure_future(batcher.infer(tokens(s, 1), timeout=30)) for s in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            batcher.submit(tokens(3, 1), asyncio.get_running_loop())
        with pytest.raises(QueueFull):
            batcher.check_room()  # what the handler asks before it tokenizes
        engine.gate.set()
        return await asyncio.gather(first, *queued)

    results = asyncio.run(scenario())
    assert [r.shape for r in results] == [(1, 3)] * 3
    batcher.check_room()  # the queue drained: room again
    batcher.stop()
    with pytest.raises(ShuttingDown):
        batcher.submit(tokens(4, 1), asyncio.new_event_loop())
    with pytest.raises(ShuttingDown):
        batcher.check_room()


def test_requests_being_tokenized_hold_places_in_the_queue():
    """A place reserved before tokenizing counts against max_queue (under overload the excess is refused at once,
    not piled up before the queue); the job takes its own place without a second check; a released place is free
    again; after stop a reserved job is refused and its place given back."""
    engine = SumEngine()
    engine.gate.clear()  # the worker blocks in its first forward
    batcher = Batcher(engine, max_batch_tokens=64, max_queue=2)
    batcher.start()

    async def scenario():
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(batcher.infer(tokens(0, 1), timeout=30))
        await asyncio.sleep(0.2)  # the worker took it and waits at the gate
        batcher.reserve()
        batcher.reserve()
        assert batcher.depth() == 2
        with pytest.raises(QueueFull):
            batcher.reserve()
        with pytest.raises(QueueFull):
            batcher.submit(tokens(1, 1), loop)
        batcher.release()
        assert batcher.depth() == 1
        batcher.reserve()
        second = asyncio.ensure_future(batcher.infer(tokens(2, 1), timeout=30, reserved=True))
        await asyncio.sleep(0)
        assert batcher.depth() == 2 and batcher.reserved == 1 and len(batcher.pending) == 1
        third = asyncio.ensure_future(batcher.infer(tokens(3, 1), timeout=30, reserved=True))
        await asyncio.sleep(0)
        assert batcher.reserved == 0 and batcher.depth() == 2
        engine.gate.set()
        return await asyncio.gather(first, second, third)

    results = asyncio.run(scenario())
    assert [r.shape for r in results] == [(1, 3)] * 3
    batcher.reserve()
    batcher.stop()
    with pytest.raises(ShuttingDown):
        batcher.submit(tokens(4, 1), asyncio.new_event_loop(), reserved=True)
    assert batcher.reserved == 0


def test_a_timed_out_job_is_skipped():
    engine = SumEngine()
    engine.gate.clear()
    batcher = Batcher(engine, max_batch_tokens=64, max_queue=4)
    batcher.start()

    async def scenario():
        blocker = asyncio.ensure_future(batcher.infer(tokens(0, 1), timeout=30))
        await asyncio.sleep(0.2)
        with pytest.raises(RequestTimeout):
            await batcher.infer(tokens(1, 1), timeout=0.05)
        engine.gate.set()
        first = await blocker
        await asyncio.sleep(0.2)  # the planner dropped the abandoned job; the model waits for a batch
        # the next job is cut at once although the queue held only a cancelled one when the model asked
        return first, await batcher.infer(tokens(2, 1), timeout=5)

    _, later = asyncio.run(scenario())
    batcher.stop(timeout=10)
    np.testing.assert_array_equal(later, expected(tokens(2, 1)))
    assert len(engine.padded) == 2  # the abandoned job never ran


@pytest.mark.parametrize("sizes", [[1], [7, 1, 130], [130] * 3 + [1] * 7, [768]])
def test_token_batches_keep_queue_order_and_the_real_token_budget(sizes):
    rng = np.random.default_rng(len(sizes))
    lengths = [list(rng.integers(1, 200, size=n)) for n in sizes]
    budget = 512
    batches = token_batches(lengths, budget)
    flat = [length for job in lengths for length in job]
    order = [i for batch in batches for i in batch]
    assert order == list(range(len(flat)))  # every input once, job after job: jobs finish in queue order
    for k, batch in enumerate(batches):
        assert sum(flat[i] for i in batch) <= budget or len(batch) == 1
        if k + 1 < len(batches):  # full: the next input would not have fitted
            assert sum(flat[i] for i in batch) + flat[batches[k + 1][0]] > budget


def test_token_batches_count_real_tokens_not_padded_ones():
    # padded, [100, 5, 5, 5] would cost 400 tokens > 200; real, 115
    assert token_batches([[100, 5], [5, 5]], 200) == [[0, 1, 2, 3]]


def test_token_batches_cut_a_text_over_the_budget_alone():
    assert token_batches([[3, 900, 5], [2]], 64) == [[0], [1], [2, 3]]


def test_the_server_cuts_by_the_rule_fastbert_embed_uses(monkeypatch):
    """One batcher: the server's cut is `real_token_batches` (in arrival order), not a copy of its logic."""
    from fastbert.embedding import batching
    from fastbert.serving import batcher as serving_batcher

    calls = []

    def spy(lengths, max_batch_tokens, max_batch_size=None, longest_first=True):
        calls.append((list(lengths), max_batch_tokens, max_batch_size, longest_first))
        return batching.real_token_batches(lengths, max_batch_tokens, max_batch_size, longest_first)

    monkeypatch.setattr(serving_batcher, "real_token_batches", spy, raising=False)
    assert token_batches([[3, 900, 5], [2]], 64) == [[0], [1], [2, 3]]
    assert calls == [([3, 900, 5, 2], 64, None, False)]


class SteppedEngine(SumEngine):
    """SumEngine that holds each forward until the test releases it, and says when one is waiting."""

    def __init__(self):
        super().__init__()
        self.step = threading.Semaphore(0)
        self.waiting = threading.Event()

    def run(self, batch):
        self.waiting.set()
        assert self.step.acquire(timeout=10), "the test never released this forward"
        self.waiting.clear()
        return super().run(batch)


def test_a_job_is_answered_once_its_own_forward_has_run():
    """Three queued jobs (70, 10 and 10 real tokens) that the budget of 75 puts in two forwards: the first job is
    answered while the second forward is still held, the other two after it."""
    engine = SteppedEngine()
    batcher = Batcher(engine, max_batch_tokens=75, max_queue=10)
    jobs = [[Tokens(list(range(1, 71)))], [Tokens(list(range(2, 12)))], [Tokens(list(range(3, 13)))]]

    async def scenario():
        loop = asyncio.get_running_loop()
        futures = [asyncio.ensure_future(batcher.infer(job, timeout=30)) for job in jobs]
        await asyncio.sleep(0)  # all three queued before the worker starts, so that it takes them as one window
        batcher.start()
        for done_after in ([True, False, False], [True, True, True]):
            assert await loop.run_in_executor(None, engine.waiting.wait, 10)
            assert not any(f.done() for f in futures[1:])
            engine.step.release()
            await asyncio.wait(futures, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait([f for f, done in zip(futures, done_after, strict=True) if done], timeout=10)
            assert [f.done() for f in futures] == done_after
        return [f.result() for f in futures]

    try:
        results = asyncio.run(scenario())
    finally:
        for _ in range(2):
            engine.step.release()
        batcher.stop(timeout=10)
    for job, rows in zip(jobs, results, strict=True):
        np.testing.assert_array_equal(rows, expected(job))
    assert engine.real == [70, 20]


async def wait_until(condition, seconds: float = 2.0) -> bool:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


def test_jobs_arriving_during_a_forward_join_one_batch_cut_when_the_model_is_free():
    """B and C arrive one after the other while A's forward runs: neither is cut early into a batch of its own
    (which would make C wait for B's forward), both run in the next forward; they count as queued until it starts
    (a full queue refuses)."""
    engine = SteppedEngine()
    batcher = Batcher(engine, max_batch_tokens=1000, max_queue=2)
    batcher.start()

    async def scenario():
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(batcher.infer(tokens(1, 3), timeout=30))
        assert await loop.run_in_executor(None, engine.waiting.wait, 10)  # A's forward holds
        second = asyncio.ensure_future(batcher.infer(tokens(2, 2), timeout=30))
        assert await wait_until(lambda: len(batcher.pending) == 1)
        await asyncio.sleep(0.1)  # time the planner would have had to cut B alone
        assert batcher.batches.qsize() == 0 and len(batcher.pending) == 1  # B waits for the model to be free
        third = asyncio.ensure_future(batcher.infer(tokens(3, 1), timeout=30))
        assert await wait_until(lambda: batcher.depth() == 2)
        with pytest.raises(QueueFull):
            batcher.check_room()
        for _ in range(2):
            engine.step.release()
        return await asyncio.gather(first, second, third)

    try:
        a, b, c = asyncio.run(scenario())
    finally:
        batcher.stop(timeout=10)
    np.testing.assert_array_equal(a, expected(tokens(1, 3)))
    np.testing.assert_array_equal(b, expected(tokens(2, 2)))
    np.testing.assert_array_equal(c, expected(tokens(3, 1)))
    sizes = [sum(len(t) for t in tokens(seed, count)) for seed, count in ((1, 3), (2, 2), (3, 1))]
    assert engine.real == [sizes[0], sizes[1] + sizes[2]]  # two forwards: B and C together


def test_a_full_batch_is_cut_while_the_current_forward_runs():
    """Jobs that fill the budget while a forward runs are cut into the next batch at once, so that it waits ready
    (the pipelining that keeps a loaded server busy); B still counts as queued until its forward starts."""
    engine = SteppedEngine()
    batcher = Batcher(engine, max_batch_tokens=20, max_queue=3)
    batcher.start()
    full = [Tokens(list(range(1, 21)))]

    async def scenario():
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(batcher.infer(tokens(1, 1), timeout=30))
        assert await loop.run_in_executor(None, engine.waiting.wait, 10)  # A's forward holds
        second = asyncio.ensure_future(batcher.infer(full, timeout=30))
        assert await wait_until(lambda: batcher.batches.qsize() == 1)
        assert not batcher.pending and batcher.depth() == 1  # B is cut, ready for the model, and still queued
        for _ in range(2):
            engine.step.release()
        return await asyncio.gather(first, second)

    try:
        a, b = asyncio.run(scenario())
    finally:
        batcher.stop(timeout=10)
    np.testing.assert_array_equal(a, expected(tokens(1, 1)))
    np.testing.assert_array_equal(b, expected(full))


def test_ready_only_after_the_warm_up_and_jobs_wait_for_it():
    engine = SumEngine()
    release = threading.Event()
    warmed = []
    batcher = Batcher(engine, max_batch_tokens=256, max_queue=4,
                      warmup=lambda: (release.wait(10), warmed.append(engine.run([Tokens([5, 6])]))))
    batcher.start()

    async def scenario():
        job = asyncio.ensure_future(batcher.infer(tokens(9, 2), timeout=30))
        await asyncio.sleep(0.2)
        assert not batcher.ready.is_set() and not job.done()  # queued, not run, while the warm-up goes on
        release.set()
        return await job

    try:
        rows = asyncio.run(scenario())
    finally:
        batcher.stop(timeout=10)
    assert batcher.ready.is_set() and len(warmed) == 1 and engine.real[0] == 2  # the warm-up's forward came first
    np.testing.assert_array_equal(rows, expected(tokens(9, 2)))


def test_a_failed_warm_up_leaves_the_batcher_unready():
    def broken():
        raise RuntimeError("no memory")

    engine = SumEngine()
    engine.gate.clear()
    batcher = Batcher(engine, max_batch_tokens=64, max_queue=4, warmup=broken)

    async def scenario():
        queued = asyncio.ensure_future(batcher.infer(tokens(1, 2), timeout=30))  # before the warm-up fails
        await asyncio.sleep(0)
        batcher.start()
        with pytest.raises(ShuttingDown):
            await queued
        with pytest.raises(ShuttingDown):
            batcher.check_room()

    asyncio.run(scenario())
    batcher.stop(timeout=10)
    assert not batcher.ready.is_set() and isinstance(batcher.warmup_error, RuntimeError)
    assert not batcher.thread.is_alive() and not engine.real  # stopped cleanly, nothing run


def test_a_call_runs_in_the_model_thread_ahead_of_the_queued_jobs():
    """`Batcher.call` (the token-level endpoints' forwards) runs in the model's thread, the only one whose torch
    work keeps OpenMP workers (fastbert.common.threads), before the jobs queued while a forward ran; its errors
    reach its caller; after stop it is refused."""
    engine = SumEngine()
    order: list[str] = []
    started = threading.Event()
    engine_run = engine.run

    def run(batch):
        order.append("batch")
        started.set()
        return engine_run(batch)

    engine.run = run
    batcher = Batcher(engine, max_batch_tokens=4096, max_queue=100)
    batcher.start()

    def in_model_thread(value):
        order.append("call")
        assert threading.current_thread() is batcher.thread
        return value * 2

    def failing():
        raise ValueError("bad input")

    async def scenario():
        await batcher.infer(tokens(0, 1), timeout=10)  # the model's thread is up
        order.clear()
        engine.gate.clear()  # a forward in progress: the next job and the call wait behind it
        started.clear()
        first = asyncio.ensure_future(batcher.infer(tokens(1, 1), timeout=10))
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        queued = asyncio.ensure_future(batcher.infer(tokens(2, 1), timeout=10))
        await asyncio.sleep(0.05)
        call = asyncio.ensure_future(batcher.call(in_model_thread, 21, timeout=10))
        gone = asyncio.ensure_future(batcher.call(in_model_thread, 0, timeout=0.05))  # its caller gives up
        await asyncio.sleep(0.1)
        assert batcher.depth() == 3  # the queued job and the two calls
        with pytest.raises(RequestTimeout):
            await gone
        engine.gate.set()
        await asyncio.gather(first, queued)
        result = await call
        with pytest.raises(ValueError, match="bad input"):
            await batcher.call(failing, timeout=10)
        return result

    try:
        assert asyncio.run(scenario()) == 42
        assert order == ["batch", "call", "batch"]  # the cancelled call never ran
        assert batcher.depth() == 0
    finally:
        batcher.stop()
    with pytest.raises(ShuttingDown):
        asyncio.run(batcher.call(in_model_thread, 1, timeout=1))


class SleepEngine(SumEngine):
    """SumEngine whose every forward takes ``seconds``."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def run(self, batch):
        import time

        time.sleep(self.seconds)
        return super().run(batch)


def test_timing_splits_a_jobs_wait_from_its_forwards():
    """A job queued behind a running forward waits about that forward (queue) and then its own (inference); a job
    cut into two forwards (past the token budget) counts both as inference; the first job did not queue."""
    forward = 0.2
    engine = SleepEngine(forward)
    batcher = Batcher(engine, max_batch_tokens=60, max_queue=10)
    batcher.start()
    first, second, split = Timing(), Timing(), Timing()
    long_job = [Tokens(list(range(1, 41))), Tokens(list(range(1, 41)))]  # 80 tokens: two forwards of 40

    async def scenario():
        a = asyncio.ensure_future(batcher.infer(tokens(1, 1), timeout=30, timing=first))
        await asyncio.sleep(forward / 4)  # the first forward runs
        b = asyncio.ensure_future(batcher.infer(tokens(2, 1), timeout=30, timing=second))
        await asyncio.gather(a, b)
        await batcher.infer(long_job, timeout=30, timing=split)

    try:
        asyncio.run(scenario())
    finally:
        batcher.stop(timeout=10)
    assert first.queue < forward / 4 and forward <= first.inference < 2 * forward
    assert forward / 2 < second.queue < forward and forward <= second.inference < 2 * forward
    assert split.queue < forward / 4 and 2 * forward <= split.inference < 3 * forward
    assert engine.real[-2:] == [40, 40]


def test_a_calls_timing_is_its_wait_and_its_run():
    """A call that arrives during a forward waits for it (queue), then its function's run is its inference."""
    import time

    forward = 0.2
    batcher = Batcher(SleepEngine(forward), max_batch_tokens=60, max_queue=10)
    batcher.start()
    timing = Timing()

    async def scenario():
        job = asyncio.ensure_future(batcher.infer(tokens(1, 1), timeout=30))
        await asyncio.sleep(forward / 4)
        result = await batcher.call(lambda: time.sleep(forward) or "done", timeout=30, timing=timing)
        await job
        return result

    try:
        assert asyncio.run(scenario()) == "done"
    finally:
        batcher.stop(timeout=10)
    assert forward / 2 < timing.queue < forward and forward <= timing.inference < 2 * forward
