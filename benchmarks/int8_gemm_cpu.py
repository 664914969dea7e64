"""int8 (and bfloat16) GEMM candidates on CPU at all-MiniLM-L6-v2's shapes, against fp32 ``F.linear``, interleaved.

Each candidate computes x [M, K] @ W^T + b with W int8 per output channel (symmetric) and x quantized at run time:

- ``fp32``: ``F.linear`` (MKL), the peer every ratio is against;
- ``fbgemm per-tensor``: ``torch.ops.quantized.linear_dynamic`` (FBGEMM, the ``x86`` engine's choice for dynamic
  linear): uint8 activations with one scale and zero point per call (min/max over the whole input);
- ``fbgemm per-token (torch ops)``: the same kernel on rows divided by their own absolute maximum, the result
  multiplied back per row and the bias added after, in torch ops: per-token scales through the same kernel;
- ``fastbert Int8Linear``: `fastbert.quantization.Int8Linear`, the route fastbert takes: rows mapped onto [0, 1]
  by their own minimum and range (8 bits per token, asymmetric) in one C++ pass (``csrc/int8.cpp``), the same
  FBGEMM kernel, the per-row rescale and bias in one C++ pass;
- ``onednn per-token``: ``torch.ops.onednn.qlinear_pointwise`` (the x86 inductor quantizer's op) on the same
  row-normalised activations, quantized to uint8 in torch ops;
- ``_int_mm per-token``: ``torch._int_mm`` (int8 x int8 -> int32) on per-token symmetric int8 activations, then
  the per-row x per-channel rescale (what torchao's int8 dynamic-activation/int8-weight linear computes on CPU);
- with ``--bf16``, where the CPU computes bfloat16 natively (`fastbert.cpu.native_bf16`): ``bf16``, ``F.linear`` on
  bfloat16 x, W and b (oneDNN; x cast before the timing, as a bfloat16 model holds it), and ``bf16 onednn
  packed``, the same GEMM on W packed once into oneDNN's blocked layout (`fastbert.backends.onednn`'s route).

Accuracy: max |y - y64| / max |y64| against the float64 GEMM. Timing: per round every candidate runs one untimed
and ``--repeats`` timed calls, the order rotated each round; the figures are medians over all timed calls.

    .venv/bin/python benchmarks/int8_gemm_cpu.py --threads 2 --rounds 9 --out benchmarks/results/cpu-2core-int8
    .venv/bin/python benchmarks/int8_gemm_cpu.py --threads 2 --rounds 9 --bf16 \
        --out benchmarks/results/cpu-2core-avx512bf16

Writes gemm.json and gemm.md into --out. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastbert.bench.machine import machine_info
from fastbert.bench.timing import time_ms
from fastbert.cpu import cpu_flags, native_bf16
from fastbert.quantization import Int8Linear, int8_weight

SHAPES = [(m, k, n) for m in (1024, 128) for k, n in ((384, 1152), (384, 384), (384, 1536), (1536, 384))]


def _row_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    return x / amax, amax


def candidates(w: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Name -> x -> y for one weight and bias."""
    n = w.shape[0]
    q, scale = int8_weight(w)
    with warnings.catch_warnings():  # (torch deprecates quantized tensors; the prepack ops still take them)
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(q.float() * scale[:, None], scale.double(), torch.zeros(n, dtype=torch.long),
                                        0, torch.qint8)
    torch.backends.quantized.engine = "x86"
    with_bias = torch.ops.quantized.linear_prepack(qw, b)
    no_bias = torch.ops.quantized.linear_prepack(qw, None)
    onednn_w = torch.ops.onednn.qlinear_prepack(q, None)
    zeros = torch.zeros(n, dtype=torch.long)
    int_mm_w = q.t().contiguous()

    def fbgemm_token(x):
        normed, amax = _row_scaled(x)
        return torch.ops.quantized.linear_dynamic(normed, no_bias, False).mul_(amax).add_(b)

    def onednn_token(x):
        normed, amax = _row_scaled(x)
        qx = torch.round(normed * 127.0).add_(128.0).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(qx, 1.0 / 127.0, 128, onednn_w, scale, zeros, None, 1.0, 0,
                                               torch.float32, "none", [], "")
        return y.mul_(amax).add_(b)

    def int_mm_token(x):
        amax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        qx = torch.round(x * (127.0 / amax)).to(torch.int8)
        return torch._int_mm(qx, int_mm_w).float().mul_(amax * (scale / 127.0)).add_(b)

    ours = Int8Linear(w, b)
    return {"fp32": lambda x: F.linear(x, w, b),
            "fbgemm per-tensor": lambda x: torch.ops.quantized.linear_dynamic(x, with_bias, False),
            "fbgemm per-token (torch ops)": fbgemm_token, "fastbert Int8Linear": ours,
            "onednn per-token": onednn_token, "_int_mm per-token": int_mm_token}


def bf16_candidates(w: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Name -> x (bfloat16) -> y: the bfloat16 GEMMs, as stored and on a weight packed once."""
    wb, bb = w.bfloat16(), b.bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, None)
    return {"bf16": lambda x: F.linear(x, wb, bb),
            "bf16 onednn packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bb, "none", [], "")}


def bench_shape(m: int, k: int, n: int, rounds: int, repeats: int, bf16: bool = False) -> dict:
    gen = torch.Generator().manual_seed(m * 7 + k * 3 + n)
    x = torch.randn(m, k, generator=gen)
    x[:, :4] *= 8.0  # a few outlier channels, as BERT's hidden states have
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) * 0.1
    exact = F.linear(x.double(), w.double(), b.double())
    runs = {name: (fn, x) for name, fn in candidates(w, b).items()}
    if bf16:
        runs.update({name: (fn, x.bfloat16()) for name, fn in bf16_candidates(w, b).items()})
    entry = {}
    with torch.inference_mode():
        for name, (fn, inputs) in runs.items():
            err = float((fn(inputs).double() - exact).abs().max() / exact.abs().max())
            entry[name] = {"max_rel_err": err, "times_ms": []}
        names = list(runs)
        for index in range(rounds):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                fn, inputs = runs[name]
                entry[name]["times_ms"] += time_ms(lambda fn=fn, inputs=inputs: fn(inputs), repeats=repeats,
                                                   warmup=1)
    base = statistics.median(entry["fp32"]["times_ms"])
    for value in entry.values():
        value["median_ms"] = statistics.median(value["times_ms"])
        value["speedup_vs_fp32"] = base / value["median_ms"]
    return entry


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = ["# int8 (and bfloat16) GEMM candidates vs fp32 F.linear (CPU)", "",
             f"- Date: {machine['date']}",
             f"- Machine: {machine['cpu']}, {machine['cpu_cores']} logical CPUs, {report['threads']} threads; "
             f"CPU flags: {', '.join(report['cpu_flags']) or 'none of fastbert.cpu.FEATURES'}; "
             f"torch CPU capability {report['torch_cpu_capability']}",
             f"- Load average before/after: {report['load_before']:.2f}/{machine['load_average'][0]:.2f} "
             "(load moves the milliseconds more than the ratios of one round)",
             f"- Versions: torch {machine['versions']['torch']}, python {machine['python']}",
             f"- Command: `{report['command']}`",
             f"- {report['rounds']} interleaved rounds x {report['repeats']} timed calls; median ms; speed-up = fp32 "
             "median / candidate median; err = max |y - y_fp64| / max |y_fp64| (x: randn with 4 outlier channels "
             "x8, W: randn / sqrt(K))", ""]
    names = list(next(iter(report["shapes"].values())))
    lines += ["| M x K -> N | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for shape, entry in report["shapes"].items():
        cells = [f"{entry[n]['median_ms']:.2f} ms ({entry[n]['speedup_vs_fp32']:.2f}x, err "
                 f"{entry[n]['max_rel_err']:.1e})" for n in names]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="also the bfloat16 GEMMs (CPUs with native bfloat16)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.bf16 and not native_bf16():
        parser.error("--bf16: this CPU has no native bfloat16 (neither AMX nor AVX-512 BF16): it would time emulation")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    shapes = {}
    for m, k, n in SHAPES:
        key = f"{m} x {k} -> {n}"
        shapes[key] = bench_shape(m, k, n, args.rounds, args.repeats, args.bf16)
        print(key, "  ".join(f"{name} {v['median_ms']:.2f} ms ({v['speedup_vs_fp32']:.2f}x, err {v['max_rel_err']:.1e})"
                             for name, v in shapes[key].items()), flush=True)
    command = ".venv/bin/python benchmarks/int8_gemm_cpu.py " + " ".join(argv if argv is not None else os.sys.argv[1:])
    report = {"machine": machine_info("cpu"), "cpu_flags": cpu_flags(), "threads": args.threads,
              "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_before": load_before,
              "rounds": args.rounds, "repeats": args.repeats, "command": command.strip(), "shapes": shapes}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gemm.json"), "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
        with open(os.path.join(args.out, "gemm.md"), "w", encoding="utf-8") as handle:
            handle.write(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
