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


def test_ideal_server_reads_the_runs_forwards(serve_bench):
    """Forward cost from the closed loops' /metrics deltas; overhead = one client's p50 beyond its mean forward;
    the idle p99 is the workload's p99 request through that cost; the half-load p99 is above it."""
    workload = serve_bench.Workload(pool=["x"] * 4, tokens=np.array([10, 20, 30, 40]),
                                    requests=[[0], [1, 2], [3], [0, 1, 2, 3]])
    closed = [{"p50_s": 0.012, "forwards": {"count": 100, "seconds": 1.0, "tokens": 5000}},
              {"p50_s": 0.2, "forwards": {"count": 10, "seconds": 0.5, "tokens": 4000}},
              {"p50_s": 0.2, "forwards": None}]
    ideal = serve_bench.ideal_server({"closed_loop": closed, "peak_texts_per_s": 2000.0}, workload, 4096,
                                     seconds=50.0)
    assert ideal["forward_cost_points"] == [[0.0, 0.0], [50.0, 0.01], [400.0, 0.05]]
    assert ideal["overhead_s"] == pytest.approx(0.002)
    p99_tokens = np.percentile([10, 50, 40, 100], 99)  # the requests' tokens
    assert ideal["idle_p99_s"] == pytest.approx(0.002 + 0.01 + (p99_tokens - 50) / 350 * 0.04)
    assert ideal["p99_at_0.5_s"] > ideal["idle_p99_s"] and ideal["p99_at_0.8_over_idle"] > 1
