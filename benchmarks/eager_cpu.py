"""The eager backend's CPU pieces that lean on PyTorch's own kernels, timed against what they replaced:

- packed attention (`fastbert.ops.attention`): SDPA per run of consecutive sequences of one length ("per run", the
  eager path now) vs the whole batch padded to its longest sequence for one masked call ("padded", the path CUDA and
  traced calls take) vs the cpp kernel; 12 heads of 32 (MiniLM), q/k/v views of one packed QKV buffer;
- LayerNorm without autograd (`fastbert.ops.layernorm.layer_norm_fp32`): fp16/bf16 straight into F.layer_norm
  ("direct", the path now) vs widened to fp32 and narrowed back ("widened").

Medians of interleaved rounds (the variants of a case alternate, so the shared VM's drift hits all alike), wall clock.

    .venv/bin/python benchmarks/eager_cpu.py --threads 2 --out benchmarks/results/cpu-2core-ops-onednn

Writes eager_cpu.json and eager_cpu.md (machine, CPU flags, versions, command) into --out.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fastbert import ops
from fastbert.bench.machine import machine_info
from fastbert.bench.report import format_table
from fastbert.files import write_atomic
from fastbert.ops.layernorm import layer_norm_fp32

attention_module = importlib.import_module("fastbert.ops.attention")
ATTENTION_CASES = {"8x128": [128] * 8, "32x8..128": torch.linspace(8, 128, 32).round().long().tolist(),
                   "256x4..16": [4 + i % 13 for i in range(256)], "40 short + 1x512": [1, 2] * 20 + [512]}
LAYERNORM_SHAPES = ((1024, 384), (4096, 768))


def interleaved(variants: dict, rounds: int) -> dict[str, float]:
    """Median ms per variant over ``rounds`` rounds, one call of each per round after two warm-up calls."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn(), fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: round(statistics.median(values), 3) for name, values in times.items()}


def padded_attention(q, k, v, cu, max_seqlen):
    """The eager packed attention as CUDA and traced calls run it: one masked call on the padded batch."""
    original = attention_module.runs_per_sequence
    attention_module.runs_per_sequence = lambda q, cu_seqlens: False
    try:
        return ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, backend="eager")
    finally:
        attention_module.runs_per_sequence = original


def attention_variants(q, k, v, cu, longest) -> dict:
    return {"per run": lambda: ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=longest, backend="eager"),
            "padded": lambda: padded_attention(q, k, v, cu, longest),
            "cpp": lambda: ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=longest, backend="cpp")}


def layernorm_variants(x, weight, bias) -> dict:
    width = x.shape[-1:]
    return {"direct": lambda: layer_norm_fp32(x, weight, bias, 1e-12),
            "widened": lambda: F.layer_norm(x.float(), width, weight.float(), bias.float(), 1e-12).to(x.dtype)}


def attention_rows(dtype: torch.dtype, rounds: int) -> list[dict]:
    rows = []
    for name, lengths in ATTENTION_CASES.items():
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = torch.randn(int(cu[-1]), 3, 12, 32).to(dtype).unbind(1)
        times = interleaved(attention_variants(q, k, v, cu, max(lengths)), rounds)
        rows.append({"case": f"attention {name}", "dtype": str(dtype)[6:], **times,
                     "speed-up": round(times["padded"] / times["per run"], 2)})
    return rows


def layernorm_rows(dtype: torch.dtype, rounds: int) -> list[dict]:
    rows = []
    for shape in LAYERNORM_SHAPES:
        x = (torch.randn(*shape) * 3 + 1).to(dtype)
        weight, bias = (torch.rand(shape[-1]) + 0.5).to(dtype), torch.randn(shape[-1]).to(dtype)
        with torch.no_grad():
            times = interleaved(layernorm_variants(x, weight, bias), rounds)
        rows.append({"case": f"layernorm {shape[0]}x{shape[1]}", "dtype": str(dtype)[6:], **times,
                     "speed-up": round(times["widened"] / times["direct"], 2)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None, help="directory for eager_cpu.json / eager_cpu.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        attention = [row for dtype in (torch.float32, torch.bfloat16) for row in attention_rows(dtype, args.rounds)]
    layernorm = [row for dtype in (torch.bfloat16, torch.float16) for row in layernorm_rows(dtype, args.rounds)]
    info = {**machine_info("cpu"), "command": " ".join(["benchmarks/eager_cpu.py", *sys.argv[1:]]),
            "rounds": args.rounds}
    tables = [format_table(("case", "dtype", "per run ms", "padded ms", "cpp ms", "padded / per run"),
                           [[r["case"], r["dtype"], r["per run"], r["padded"], r["cpp"], r["speed-up"]]
                            for r in attention], markdown=True),
              format_table(("case", "dtype", "direct ms", "widened ms", "widened / direct"),
                           [[r["case"], r["dtype"], r["direct"], r["widened"], r["speed-up"]] for r in layernorm],
                           markdown=True)]
    header = (f"# eager CPU pieces: {info['cpu']} ({', '.join(info.get('cpu_flags', [])) or 'no precision flags'}), "
              f"{args.threads} threads, {info['date']}, torch {info['versions']['torch']}, load "
              + "/".join(f"{v:.1f}" for v in info["load_average"] or []) + f"\n\n`{info['command']}`; medians of "
              f"{args.rounds} interleaved rounds, ms")
    text = "\n\n".join([header, *tables]) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "eager_cpu.md", text)
        write_atomic(out / "eager_cpu.json", json.dumps({"machine": info, "attention": attention,
                                                          "layernorm": layernorm}, indent=1, default=str))


if __name__ == "__main__":
    main()
