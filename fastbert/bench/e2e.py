"""The end-to-end benchmark: fastbert against HF eager, HF SDPA, torch.compile and ONNX Runtime on fixed-shape and
variable-length batches (`BenchSettings` says what, `run_e2e` measures). Every output is checked against
transformers in float32 first; a peer that cannot run is reported with its reason instead of stopping the run. The
results dict is written out by `fastbert.bench.report`.

tqdm is imported when a run starts, so importing this module stays cheap."""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastbert.bench.costs import batch_flops
from fastbert.bench.machine import machine_info
from fastbert.bench.peers import PEERS, PeerUnavailable, build_peer, load_hf_model
from fastbert.bench.recording import backend_availability, backends_used, record_backends
from fastbert.bench.timing import measure_peak_flops, percentile, synchronize, time_ms
from fastbert.bench.workloads import Workload, make_workloads
from fastbert.common.resolve import UserError, dtype_name, model_name, resolve_model
from fastbert.config import FastBertConfig

RESULT_SCHEMA = "fastbert-e2e/1"
TIMING_NOTE = ("interleaved: after each implementation's warm-up, every timed round calls each implementation once "
               "(order rotated per round), so a load change on the machine hits all of them alike")


@dataclass
class BenchSettings:
    """What `run_e2e` measures. ``peak_flops`` None: measured with one large matmul on the device."""

    model_dir: str
    device: torch.device
    dtype: torch.dtype
    batches: list[int]
    seqs: list[int]
    varlen: bool
    peers: list[str]
    repeats: int
    warmup: int = 2
    quick: bool = False
    backend: str = "auto"
    peak_flops: float | None = None
    threads: int | None = None
    note: str | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def quick_settings(model_dir: str, device: torch.device | str = "cpu", peers: Sequence[str] = ("hf-eager",),
                   **overrides: Any) -> BenchSettings:
    """Tiny shapes and few repeats: for tests and smoke runs (the numbers mean nothing)."""
    values = dict(model_dir=model_dir, device=torch.device(device), dtype=torch.float32, batches=[2], seqs=[16],
                  varlen=True, peers=list(peers), repeats=2, warmup=1, quick=True)
    values.update(overrides)
    return BenchSettings(**values)


def run_e2e(settings: BenchSettings, progress: bool = True) -> dict[str, Any]:
    """Benchmark fastbert and the peers on every workload; returns the results dict (see `write_results`).
    ``settings.threads`` sets torch's (and ONNX Runtime's) intra-op threads for the run.

    Every implementation is loaded once. Per workload: one call of each is checked against transformers eager in
    float32 at real positions, then warm-up calls (torch.compile compiles here, untimed), then ``repeats``
    interleaved rounds (TIMING_NOTE). Latency is wall-clock per batch; tokens/s counts real tokens only; the
    roofline fraction is useful FLOPs (padding excluded, `batch_flops`) per second over the peak FLOP/s.
    """
    threads_before = torch.get_num_threads()
    if settings.threads is not None:
        if settings.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(settings.threads)
    try:
        return _run_e2e(settings, progress)
    finally:
        torch.set_num_threads(threads_before)


def _run_e2e(settings: BenchSettings, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    model_dir, config = resolve_model(settings.model_dir)
    device, dtype = settings.device, settings.dtype
    workloads = make_workloads(settings.batches, settings.seqs, settings.varlen, settings.seed)
    if not workloads:
        raise UserError("no workloads: give at least one --batch and one --seq")
    too_long = [s for s in settings.seqs if s > config.max_position_embeddings - (config.position_offset or 0)]
    if too_long:
        raise UserError(f"--seq {too_long[0]} exceeds the model's {config.max_position_embeddings} positions")
    names = ["fastbert"] + [p for p in dict.fromkeys(settings.peers) if p != "fastbert"]
    unknown = [p for p in names if p not in PEERS + ("fastbert",)]
    if unknown:
        raise UserError(f"unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")

    peak_size = 512 if settings.quick else (8192 if device.type == "cuda" else 2048)
    peaks = [measure_peak_flops(device, dtype, size=peak_size)] if settings.peak_flops is None else []

    inputs = [w.inputs(config, device, settings.seed + i) for i, w in enumerate(workloads)]
    references: list[torch.Tensor | None] = [None] * len(workloads)
    reference_note = "transformers AutoModel (eager attention), float32, same device"
    try:
        reference = load_hf_model(model_dir, "eager", torch.float32, device)
        with torch.inference_mode():
            for i, batch in enumerate(inputs):
                references[i] = reference(**batch).last_hidden_state.float()
        del reference
    except ImportError as err:
        reference_note = f"none: transformers not installed ({err})"

    results: dict[str, dict[str, dict[str, Any]]] = {w.name: {} for w in workloads}
    notes: dict[str, list[str]] = {}
    ops_seen: dict[str, Counter] = {}
    bar = tqdm(total=len(names) + len(workloads) * (1 + settings.repeats), desc="fastbert bench",
               disable=not progress, leave=False, file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="fastbert-bench-") as workdir:
        runners: dict[str, Callable[[dict], torch.Tensor]] = {}
        for name in names:
            bar.set_postfix_str(f"loading {name}")
            try:
                runners[name], notes[name] = build_peer(name, model_dir, config, dtype, device, settings.backend,
                                                        settings.quick, workdir)
            except Exception as err:  # noqa: BLE001 - every failure of a peer is a row in the table, not a crash
                reason = str(err) if isinstance(err, PeerUnavailable) else f"{type(err).__name__}: {err}"
                notes[name] = []
                for w in workloads:
                    results[w.name][name] = {"status": "unavailable", "reason": reason[:300]}
            bar.update(1)
        for index, (workload, batch) in enumerate(zip(workloads, inputs, strict=True)):
            bar.set_postfix_str(f"{workload.name}: first calls and warm-up")
            live, errors = {}, {}
            for name, fn in runners.items():
                failure, errors[name] = _first_calls(fn, batch, references[index], settings,
                                                     ops_seen if name == "fastbert" else None)
                if failure:
                    results[workload.name][name] = failure
                else:
                    live[name] = fn
            bar.update(1)
            times: dict[str, list[float]] = {name: [] for name in live}
            for round_index in range(settings.repeats):
                bar.set_postfix_str(f"{workload.name}: round {round_index + 1}/{settings.repeats}")
                order = list(live)
                shift = round_index % max(1, len(order))
                for name in order[shift:] + order[:shift]:  # rotated, so no implementation always runs first
                    if name in results[workload.name]:
                        continue  # failed in an earlier round
                    try:
                        times[name].append(_time_once(live[name], batch, device))
                    except Exception as err:  # noqa: BLE001 - reported per workload
                        results[workload.name][name] = {"status": "failed",
                                                        "reason": f"{type(err).__name__}: {str(err)[:300]}"}
                bar.update(1)
            for name in live:
                if name not in results[workload.name]:
                    results[workload.name][name] = _figures(times[name], workload, config, errors[name])
            results[workload.name] = {name: results[workload.name][name] for name in names}
        runners.clear()
        gc.collect()
    bar.close()

    if settings.peak_flops is None:
        # Measured before and after the run, the better one kept: a busy machine lowers either measurement.
        peaks.append(measure_peak_flops(device, dtype, size=peak_size))
        peak = max(peaks)
        peak_source = (f"measured: best of 5 {peak_size}x{peak_size} matmuls in {dtype_name(dtype)} on this "
                       f"device, before ({peaks[0] / 1e12:.3g} TFLOP/s) and after ({peaks[1] / 1e12:.3g}) the "
                       "run, the higher kept")
    else:
        peak, peak_source = settings.peak_flops, "given on the command line (--peak-tflops)"
    for workload in workloads:
        row = results[workload.name]
        ours = row.get("fastbert", {}).get("p50_ms")
        for entry in row.values():
            if entry.get("status") == "ok":
                entry["roofline_fraction"] = entry["tflops"] * 1e12 / peak
                if ours:
                    entry["fastbert_speedup"] = entry["p50_ms"] / ours

    machine = machine_info(device)
    machine["load_average_at_start"] = load_at_start
    return {
        "schema": RESULT_SCHEMA,
        "machine": machine,
        "model": {"path": model_dir, "name": model_name(model_dir), "family": config.family,
                  "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                  "heads": config.num_attention_heads, "intermediate": config.intermediate_size},
        "settings": {"device": device.type, "dtype": dtype_name(dtype), "batches": settings.batches,
                     "seqs": settings.seqs, "varlen": settings.varlen, "peers": names, "repeats": settings.repeats,
                     "warmup": settings.warmup, "quick": settings.quick, "backend": settings.backend,
                     "seed": settings.seed, "timing": TIMING_NOTE, "note": settings.note},
        "peak_flops": {"value": peak, "source": peak_source},
        "flops_formula": "useful FLOPs = sum over sequences of len * L*(8H^2 + 4*H*I + 4*len*H) "
                         "(= L*(24H^2 + 4SH) per token for I = 4H); padding excluded",
        "reference": reference_note,
        "fastbert_backends": backends_used(ops_seen),
        "backend_availability": backend_availability(),
        "peer_notes": notes,
        "workloads": [{"name": w.name, "batch": w.batch, "seqlen": w.seqlen, "lengths": w.lengths,
                       "varlen": w.varlen, "tokens": w.tokens, "padded_tokens": w.batch * w.seqlen,
                       "flops": batch_flops(config, w.lengths), "results": results[w.name]} for w in workloads],
    }


def _first_calls(fn, batch, reference, settings, ops_seen) -> tuple[dict | None, float | None]:
    """One call checked against the reference (recording fastbert's backends), then the warm-up calls (where
    torch.compile compiles). Returns (failure entry or None, max abs error at real positions or None)."""
    try:
        with torch.inference_mode():
            if ops_seen is not None:
                with record_backends() as seen:
                    out = fn(batch)
                for op, counts in seen.items():
                    ops_seen.setdefault(op, Counter()).update(counts)
            else:
                out = fn(batch)
            error = None
            if reference is not None:
                real = batch["attention_mask"].bool()
                error = float((out.float() - reference)[real].abs().max())
            for _ in range(settings.warmup):
                fn(batch)
            synchronize(settings.device)
    except Exception as err:  # noqa: BLE001 - reported per workload
        return {"status": "failed", "reason": f"{type(err).__name__}: {str(err)[:300]}"}, None
    return None, error


def _time_once(fn, batch, device) -> float:
    with torch.inference_mode():
        return time_ms(lambda: fn(batch), repeats=1, warmup=0, device=device)[0]


def _figures(times: list[float], workload: Workload, config: FastBertConfig, error: float | None) -> dict[str, Any]:
    p50, p90 = percentile(times, 50), percentile(times, 90)
    flops = batch_flops(config, workload.lengths)
    return {
        "status": "ok",
        "p50_ms": p50,
        "p90_ms": p90,
        "mean_ms": statistics.fmean(times),
        "min_ms": min(times),
        "times_ms": times,
        "sequences_per_s": workload.batch / (p50 / 1e3),
        "tokens_per_s": workload.tokens / (p50 / 1e3),
        "tflops": flops / (p50 / 1e3) / 1e12,
        "max_abs_err_vs_reference": error,
    }
