"""Timing: wall-clock milliseconds of repeated calls (synchronised on CUDA, or CUDA events), percentiles, and a
measured peak FLOP/s (one large matmul) for the roofline."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that a clock read after it counts that work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1, device: torch.device | str = "cpu",
            cuda_events: bool = False) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls: wall-clock, CUDA synchronised
    after each call. With ``cuda_events`` on a CUDA device, the time between CUDA events recorded before and after
    each call instead, which leaves out the host's synchronisation latency (it matters for sub-millisecond calls)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    events = cuda_events and torch.device(device).type == "cuda"
    times = []
    for _ in range(repeats):
        if events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            continue
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def measure_peak_flops(device: torch.device | str, dtype: torch.dtype, size: int | None = None,
                       repeats: int = 5) -> float:
    """FLOP/s of one square matmul on the device (the best of ``repeats``): a practical peak for the roofline."""
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = min(time_ms(lambda: torch.mm(a, b), repeats=repeats, warmup=1, device=device))
    return 2.0 * size ** 3 / (best / 1e3)
