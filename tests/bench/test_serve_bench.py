"""benchmarks/serve_bench.py's queue model (the ideal late-cut server against which the half-load p99 is read):
its queue dynamics against M/D/1's closed form and the batching bound, and the summary of a run's figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "benchmarks" / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_one_request_per_forward_is_md1(serve_bench):
    """A budget of one request's tokens, every forward s: M/D/1, whose mean time in the system at load rho is
    s + rho s / (2 (1 - rho)) (Pollaczek-Khinchine)."""
    service, rho = 0.01, 0.5
    per_request = np.full(100, 50.0)
    latency = serve_bench.late_cut_latencies(per_request, rho / service, 2000.0, 50, np.array([0.0, 50.0]),
                                             np.array([0.0, service]))
    expected = service + rho * service / (2 * (1 - rho))
    assert latency.mean() == pytest.approx(expected, rel=0.03)


def test_late_cut_batches_never_wait_more_than_one_forward(serve_bench):
    """Forwards of a fixed time whatever their size, an unbounded budget: a request waits at most the forward in
    progress, then runs in the next, so no latency passes two forwards, even far past one forward's rate."""
    service = 0.01
    latency = serve_bench.late_cut_latencies(np.arange(1.0, 9.0), 10 / service, 100.0, 10**9,
                                             np.array([0.0, 1.0, 10**9]), np.array([service] * 3))
    assert latency.max() <= 2 * service + 1e-12 and latency.min() >= service - 1e-12


def test_a_request_past_the_budget_pays_its_forwards(serve_bench):
    """The batcher cuts a request past the budget into forwards of the budget: 3000 tokens at a budget of 1000 cost
    three 1000-token forwards; past the last measured point the cost follows the last segment."""
    tokens, cost = np.array([0.0, 100.0, 500.0]), np.array([0.0, 0.01, 0.03])
    assert serve_bench.forwards_time(3000, 1000, tokens, cost) == pytest.approx(3 * 0.055)
    assert serve_bench.forwards_time(1200, 1000, tokens, cost) == pytest.approx(0.055 + 0.015)
    latency = serve_bench.late_cut_latencies(np.array([3000.0]), 0.1, 1000.0, 1000, tokens, cost)
    assert latency.min() == pytest.approx(3 * 0.055)


def closed(concurrency: int, p50_beyond_ms: float | None, forwards: dict | None) -> dict:
    side = None if p50_beyond_ms is None else {"beyond_inference": {"p50_ms": p50_beyond_ms, "p99_ms": 0.0}}
    return {"concurrency": concurrency, "server_side": side, "forwards": forwards}


def test_ideal_server_reads_the_runs_forwards(serve_bench):
    """Forward cost from the closed loops' /metrics deltas; overhead = one client's median time beyond its forwards
    (the server's headers); the idle p99 is the workload's p99 request through that cost; the half-load p99 is above
    it. Without a one-client loop there is no estimate."""
    workload = serve_bench.Workload(pool=["x"] * 4, tokens=np.array([10, 20, 30, 40]),
                                    requests=[[0], [1, 2], [3], [0, 1, 2, 3]])
    loops = [closed(1, 2.0, {"count": 100, "seconds": 1.0, "tokens": 5000}),
             closed(16, 50.0, {"count": 10, "seconds": 0.5, "tokens": 4000}), closed(64, None, None)]
    ideal = serve_bench.ideal_server({"closed_loop": loops, "peak_texts_per_s": 2000.0}, workload, 4096,
                                     seconds=50.0)
    assert ideal["forward_cost_points"] == [[0.0, 0.0], [50.0, 0.01], [400.0, 0.05]]
    assert ideal["overhead_s"] == pytest.approx(0.002)
    p99_tokens = np.percentile([10, 50, 40, 100], 99)  # the requests' tokens
    assert ideal["idle_p99_s"] == pytest.approx(0.002 + 0.01 + (p99_tokens - 50) / 350 * 0.04)
    assert ideal["p99_at_0.5_s"] > ideal["idle_p99_s"] and ideal["p99_at_0.8_over_idle"] > 1
    assert serve_bench.ideal_server({"closed_loop": loops[1:], "peak_texts_per_s": 2000.0}, workload, 4096) is None


def test_forward_totals_read_fastberts_own_metrics(serve_bench):
    """Parsed from what the server's Metrics expose: two forwards' count, seconds and real tokens."""
    from fastbert.serving.batcher import BatchRecord
    from fastbert.serving.metrics import Metrics

    metrics = Metrics(lambda: 0)
    metrics.record_batch(BatchRecord(texts=3, tokens=120, padded_tokens=150, seconds=0.25))
    metrics.record_batch(BatchRecord(texts=1, tokens=7, padded_tokens=7, seconds=0.5))
    assert serve_bench.parse_forward_totals(metrics.exposition().decode()) == {"count": 2.0, "seconds": 0.75,
                                                                              "tokens": 127.0}


def test_server_side_splits_each_answer_by_its_headers(serve_bench):
    """Parts from the headers; after = total - the three parts; outside = the client's wait beyond the total."""
    samples = [serve_bench.Sample([0], 0.0, latency / 1000, 200, b"",
                                  {"total": total, "tokenization": 1, "queue": queue, "inference": 10})
               for latency, total, queue in ((20.0, 15, 2), (40.0, 30, 15))]
    side = serve_bench.server_side(samples + [serve_bench.Sample([0], 0.0, 0.5, 200, b"", None)])
    assert side["after"]["p50_ms"] == pytest.approx(3.0) and side["outside"]["p99_ms"] == pytest.approx(9.95)
    assert side["beyond_inference"]["p50_ms"] == pytest.approx(20.0)
    assert serve_bench.server_side([serve_bench.Sample([0], 0.0, 0.5, 200, b"", None)]) is None
