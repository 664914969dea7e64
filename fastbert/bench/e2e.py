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
from fastbert.bench.machine import busy_warning, machine_info
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


@dataclass
class _Run:
    """One benchmark run's inputs and its results as they come in: ``results[workload][implementation]`` is a
    figures entry (`_figures`) or a failure (status and reason); ``notes`` says how each implementation ran."""

    settings: BenchSettings
    model_dir: str
    config: FastBertConfig
    workloads: list[Workload]
    names: list[str]
    bar: Any
    results: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)
    ops_seen: dict[str, Counter] = field(default_factory=dict)


def _run_e2e(settings: BenchSettings, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    model_dir, config = resolve_model(settings.model_dir)
    workloads, names = _checked_workloads(settings, config)
    device, dtype = settings.device, settings.dtype
    inputs = [w.inputs(config, device, settings.seed + i) for i, w in enumerate(workloads)]
    bar = tqdm(total=len(names) + len(workloads) * (1 + settings.repeats), desc="fastbert bench",
               disable=not (progress and sys.stderr.isatty()), leave=False, file=sys.stderr)  # no \r in a log
    run = _Run(settings, model_dir, config, workloads, names, bar, results={w.name: {} for w in workloads})
    peak_size = 512 if settings.quick else (8192 if device.type == "cuda" else 2048)
    peaks: list[float] = []
    with bar, tempfile.TemporaryDirectory(prefix="fastbert-bench-") as workdir:
        # fastbert first: a checkpoint it cannot load is the one line printed; then the float32 reference, freed
        # before the peers load, so that it never adds to the peak memory of their models
        runners = _load_runners(run, workdir, [name for name in names if name == "fastbert"])
        references, reference_note = _reference_outputs(model_dir, inputs, device)
        runners.update(_load_runners(run, workdir, [name for name in names if name != "fastbert"]))
        busy = busy_warning(torch.get_num_threads())
        if busy is not None and progress:
            bar.write(busy, file=sys.stderr)
        if settings.peak_flops is None:
            peaks.append(measure_peak_flops(device, dtype, size=peak_size))
        for workload, batch, reference in zip(workloads, inputs, references, strict=True):
            _measure_workload(run, workload, batch, reference, runners)
        runners.clear()
        gc.collect()
    if settings.peak_flops is None:
        peaks.append(measure_peak_flops(device, dtype, size=peak_size))
    peak = _peak_used(settings, peaks, peak_size)
    _add_ratios(run.results, peak["value"])
    return _record(run, peak, reference_note, load_at_start)


def _checked_workloads(settings: BenchSettings, config: FastBertConfig) -> tuple[list[Workload], list[str]]:
    """The workloads and the implementations (fastbert first) to measure; UserError for settings that cannot run."""
    workloads = make_workloads(settings.batches, settings.seqs, settings.varlen, settings.seed)
    if not workloads:
        raise UserError("no workloads: give at least one --batch and one --seq")
    too_long = [s for s in settings.seqs if s > config.token_positions]
    if too_long:
        raise UserError(f"--seq {too_long[0]} exceeds the model's {config.token_positions} positions")
    names = ["fastbert"] + [p for p in dict.fromkeys(settings.peers) if p != "fastbert"]
    unknown = [p for p in names if p not in PEERS + ("fastbert",)]
    if unknown:
        raise UserError(f"unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")
    return workloads, names


def _reference_outputs(model_dir: str, inputs: list[dict], device: torch.device
                       ) -> tuple[list[torch.Tensor | None], str]:
    """transformers eager's float32 hidden states for each input, and what the reference is (None without
    transformers)."""
    references: list[torch.Tensor | None] = [None] * len(inputs)
    try:
        reference = load_hf_model(model_dir, "eager", torch.float32, device)
    except ImportError as err:
        return references, f"none: transformers not installed ({err})"
    except (OSError, RuntimeError, ValueError) as err:  # its own message is a table on stderr, which the load hides
        reason = (str(err).splitlines() or [type(err).__name__])[0][:300]
        raise UserError(f"{model_dir}: transformers cannot load it as the reference: {reason}") from err
    with torch.inference_mode():
        for i, batch in enumerate(inputs):
            references[i] = reference(**batch).last_hidden_state.float()
    return references, "transformers AutoModel (eager attention), float32, same device"


def _load_runners(run: _Run, workdir: str, names: list[str]) -> dict[str, Callable[[dict], torch.Tensor]]:
    """Each of ``names`` that loads, by name; one that does not is marked unavailable on every workload, except
    fastbert on a checkpoint it cannot load (a UserError)."""
    settings = run.settings
    runners: dict[str, Callable[[dict], torch.Tensor]] = {}
    for name in names:
        run.bar.set_postfix_str(f"loading {name}")
        try:
            runners[name], run.notes[name] = build_peer(name, run.model_dir, run.config, settings.dtype,
                                                        settings.device, settings.backend, settings.quick, workdir)
        except Exception as err:  # every failure of a peer is a row in the table, not a crash
            if name == "fastbert" and isinstance(err, ValueError):  # a CheckpointError: nothing left to compare
                raise UserError(str(err)) from err
            reason = str(err) if isinstance(err, PeerUnavailable) else f"{type(err).__name__}: {err}"
            run.notes[name] = []
            for w in run.workloads:
                run.results[w.name][name] = {"status": "unavailable", "reason": reason[:300]}
        run.bar.update(1)
    return runners


def _measure_workload(run: _Run, workload: Workload, batch: dict, reference: torch.Tensor | None,
                      runners: dict[str, Callable[[dict], torch.Tensor]]) -> None:
    """First calls (checked against the reference) and warm-up of every runner, then the timed rounds; the
    workload's results end in the order of ``run.names``."""
    results = run.results[workload.name]
    run.bar.set_postfix_str(f"{workload.name}: first calls and warm-up")
    live, errors = {}, {}
    for name, fn in runners.items():
        failure, errors[name] = _first_calls(fn, batch, reference, run.settings,
                                             run.ops_seen if name == "fastbert" else None)
        if failure:
            results[name] = failure
        else:
            live[name] = fn
    run.bar.update(1)
    times = _timed_rounds(run, workload, batch, live)
    for name in live:
        if name not in results:
            results[name] = _figures(times[name], workload, run.config, errors[name])
    run.results[workload.name] = {name: results[name] for name in run.names}


def _timed_rounds(run: _Run, workload: Workload, batch: dict,
                  live: dict[str, Callable[[dict], torch.Tensor]]) -> dict[str, list[float]]:
    """``repeats`` rounds calling each live implementation once (TIMING_NOTE); a call that fails marks its
    implementation failed on this workload and leaves it out of the later rounds."""
    results, repeats = run.results[workload.name], run.settings.repeats
    times: dict[str, list[float]] = {name: [] for name in live}
    for round_index in range(repeats):
        run.bar.set_postfix_str(f"{workload.name}: round {round_index + 1}/{repeats}")
        order = list(live)
        shift = round_index % max(1, len(order))
        for name in order[shift:] + order[:shift]:  # rotated, so no implementation always runs first
            if name in results:
                continue  # failed in an earlier round
            try:
                times[name].append(_time_once(live[name], batch, run.settings.device))
            except Exception as err:  # noqa: BLE001 - reported per workload
                results[name] = {"status": "failed", "reason": f"{type(err).__name__}: {str(err)[:300]}"}
        run.bar.update(1)
    return times


def _peak_used(settings: BenchSettings, peaks: list[float], peak_size: int) -> dict[str, Any]:
    """The peak FLOP/s the roofline fractions divide by, and where it comes from."""
    if settings.peak_flops is not None:
        return {"value": settings.peak_flops, "source": "given on the command line (--peak-tflops)"}
    # Measured before and after the run, the better one kept: a busy machine lowers either measurement.
    source = (f"measured: best of 5 {peak_size}x{peak_size} matmuls in {dtype_name(settings.dtype)} on this "
              f"device, before ({peaks[0] / 1e12:.3g} TFLOP/s) and after ({peaks[1] / 1e12:.3g}) the "
              "run, the higher kept")
    return {"value": max(peaks), "source": source}


def _add_ratios(results: dict[str, dict[str, dict[str, Any]]], peak: float) -> None:
    """Each measured entry's roofline fraction and fastbert's speed-up over it."""
    for row in results.values():
        ours = row.get("fastbert", {}).get("p50_ms")
        for entry in row.values():
            if entry.get("status") == "ok":
                entry["roofline_fraction"] = entry["tflops"] * 1e12 / peak
                if ours:
                    entry["fastbert_speedup"] = entry["p50_ms"] / ours


def _record(run: _Run, peak: dict[str, Any], reference_note: str, load_at_start: list[float] | None
            ) -> dict[str, Any]:
    """The results dict of the run (schema RESULT_SCHEMA; written out by `fastbert.bench.report.write_results`)."""
    settings, config = run.settings, run.config
    machine = machine_info(settings.device)
    machine["load_average_at_start"] = load_at_start
    return {
        "schema": RESULT_SCHEMA,
        "machine": machine,
        "model": {"path": run.model_dir, "name": model_name(run.model_dir), "family": config.family,
                  "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                  "heads": config.num_attention_heads, "intermediate": config.intermediate_size},
        "settings": {"device": settings.device.type, "dtype": dtype_name(settings.dtype), "batches": settings.batches,
                     "seqs": settings.seqs, "varlen": settings.varlen, "peers": run.names,
                     "repeats": settings.repeats, "warmup": settings.warmup, "quick": settings.quick,
                     "backend": settings.backend, "seed": settings.seed, "timing": TIMING_NOTE,
                     "note": settings.note},
        "peak_flops": peak,
        "flops_formula": "useful FLOPs = sum over sequences of len * L*(8H^2 + 4*H*I + 4*len*H) "
                         "(= L*(24H^2 + 4SH) per token for I = 4H); padding excluded",
        "reference": reference_note,
        "fastbert_backends": backends_used(run.ops_seen),
        "backend_availability": backend_availability(),
        "peer_notes": run.notes,
        "workloads": [{"name": w.name, "batch": w.batch, "seqlen": w.seqlen, "lengths": w.lengths,
                       "varlen": w.varlen, "tokens": w.tokens, "padded_tokens": w.batch * w.seqlen,
                       "flops": batch_flops(config, w.lengths), "results": run.results[w.name]}
                      for w in run.workloads],
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
