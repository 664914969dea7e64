"""How long a fresh process with an empty tuning cache takes to reach its steady speed on CPU (issue 41): the first
forwards of a shape class pay `auto`'s measuring (each op's candidates, then the whole-model decision); the docs
(docs/backends.md) bound that at about a quarter of a second per op class plus, per model class, three extra
forwards and at most `FIRST_USE_BUDGET_S` of timing.

Each case runs in its own fresh process (a new, empty ``FASTBERT_CACHE_DIR``): all-MiniLM-L6-v2 from
``fastbert.from_pretrained`` (backend ``auto``), ``--calls`` forwards of the case's batch back to back, each timed.
Steady = the median of the last ``--steady`` calls; the first-use cost = the sum over all calls of (call - steady);
calls to steady = the first call after which every call is within 10 % of steady. The bound it is compared with:
``op classes x 0.25 s + 3 x steady + FIRST_USE_BUDGET_S`` (the op classes this run measured, from the cache file).

    .venv/bin/python benchmarks/first_use_cpu.py --threads 2 --out benchmarks/results/cpu-2core-whole-model

Writes first-use.json and first-use.md into --out. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {"1x128": [128], "8x128": [128] * 8, "varlen32": None}  # None: 32 lengths spread over 8..128
PER_OP_CLASS_S = 0.25  # docs/backends.md: "up to about a quarter of a second per op on its first call"
WITHIN = 0.10


def one_case(case: str, calls: int, threads: int) -> list[float]:
    """The milliseconds of each forward of ``case`` in this (fresh) process."""
    import torch

    import fastbert
    from fastbert.bench.workloads import Workload
    from fastbert.common.resolve import resolve_model

    torch.set_num_threads(threads)
    model_dir, config = resolve_model(None)
    lengths = CASES[case] or torch.linspace(8, 128, 32).round().long().tolist()
    inputs = Workload(case, len(lengths), 128, lengths, CASES[case] is None).inputs(config, torch.device("cpu"))
    model = fastbert.from_pretrained(model_dir).eval()
    times = []
    with torch.inference_mode():
        for _ in range(calls):
            start = time.perf_counter()
            model(**inputs)
            times.append((time.perf_counter() - start) * 1e3)
    return times


def summarize(times: list[float], steady_calls: int, op_classes: int) -> dict:
    from fastbert import backends

    steady = statistics.median(times[-steady_calls:])
    settled = next(i for i in range(len(times)) if all(t <= steady * (1 + WITHIN) for t in times[i:]))
    extra_s = sum(t - steady for t in times) / 1e3
    bound_s = op_classes * PER_OP_CLASS_S + 3 * steady / 1e3 + backends.FIRST_USE_BUDGET_S
    return {"steady_ms": round(steady, 2), "first_call_ms": round(times[0], 1), "calls_to_steady": settled + 1,
            "first_use_extra_s": round(extra_s, 2), "op_classes_measured": op_classes,
            "documented_bound_s": round(bound_s, 2), "within_bound": extra_s <= bound_s,
            "times_ms": [round(t, 2) for t in times]}


def child(args: argparse.Namespace) -> int:
    times = one_case(args.case, args.calls, args.threads)
    import torch

    from fastbert.backends import tuning

    op_classes = sum(1 for name in tuning.entries(torch.device("cpu")) if not name.startswith("model "))
    print(json.dumps(summarize(times, args.steady, op_classes)))
    return 0


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# First use: a fresh process with an empty tuning cache, to steady speed (CPU, all-MiniLM-L6-v2)", "",
             f"- Date: {m['date']}", f"- Machine: {m['cpu']}, {m['cpu_cores']} logical CPUs, {report['threads']} "
             f"threads; CPU flags: {', '.join(m.get('cpu_flags', []))}",
             f"- Command: `{report['command']}`",
             f"- Bound (docs/backends.md): op classes x {PER_OP_CLASS_S} s + 3 x steady + "
             f"{report['first_use_budget_s']} s (FIRST_USE_BUDGET_S)", "",
             "| case | first call ms | steady ms | calls to steady (within 10 %) | first-use cost s | op classes | "
             "bound s | within |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for case, r in report["cases"].items():
        lines.append(f"| {case} | {r['first_call_ms']} | {r['steady_ms']} | {r['calls_to_steady']} | "
                     f"{r['first_use_extra_s']} | {r['op_classes_measured']} | {r['documented_bound_s']} | "
                     f"{'yes' if r['within_bound'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--steady", type=int, default=10, help="the last calls whose median is the steady speed")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process's one case
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.case:
        return child(args)
    from fastbert import backends
    from fastbert.bench.machine import machine_info

    cases = {}
    for case in args.cases:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "FASTBERT_CACHE_DIR": cache, "FASTBERT_TUNE": "1"}
            done = subprocess.run([sys.executable, __file__, "--case", case, "--calls", str(args.calls), "--steady",
                                   str(args.steady), "--threads", str(args.threads)], env=env, cwd=ROOT,
                                  capture_output=True, text=True, check=True)
            cases[case] = json.loads(done.stdout.strip().splitlines()[-1])
            print(case, {k: v for k, v in cases[case].items() if k != "times_ms"})
    report = {"command": " ".join([os.path.relpath(sys.executable), *sys.argv]), "machine": machine_info("cpu"),
              "threads": args.threads, "first_use_budget_s": backends.FIRST_USE_BUDGET_S, "cases": cases}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "first-use.json").write_text(json.dumps(report, indent=1) + "\n")
        (Path(args.out) / "first-use.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
