"""bfloat16 attention on CPU: fastbert's cpp kernel (on the kernel `fastbert.backends.cpp.bf16_attention_kernel`
names for the head dim: AMX tiles, AVX512-BF16 register tiles or the fp32-product vector kernel) against PyTorch's
SDPA in bf16, globally and in ModernBERT's sliding window (SDPA then takes the band as a boolean mask, as transformers'
ModernBERT does). q/k/v are packed as fastbert's QKV projection returns them (strided views of one [T, 3, heads, D]
buffer); SDPA runs per sequence (what fastbert's eager backend runs on packed input) and, for equal lengths,
batched. Rounds interleave the runners; each round's figure is the mean of a timed loop; the median and minimum
over rounds are reported, in ms per call. Prints a table and writes JSON (machine, flags, cases) to --out.

    .venv/bin/python benchmarks/attention_bf16_cpu.py --threads 2 --rounds 7 --out /tmp/attention-bf16.json
    .venv/bin/python benchmarks/attention_bf16_cpu.py --cases window   # the sliding-window cases alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.backends import cpp
from fastbert.bench.machine import machine_info

CASES = [  # name, heads, head dim, lengths (None: 32 random lengths in 8..128), window (None: global)
    ("MiniLM 1 x 128", 12, 32, [128], None),
    ("MiniLM 8 x 128", 12, 32, [128] * 8, None),
    ("MiniLM 32 x 8..128", 12, 32, None, None),
    ("MiniLM 2 x 512", 12, 32, [512] * 2, None),
    ("BERT-base 8 x 128", 12, 64, [128] * 8, None),
    ("BERT-base 1 x 1024", 12, 64, [1024], None),
    ("ModernBERT-base local 8 x 512", 12, 64, [512] * 8, 128),
    ("ModernBERT-base local 1 x 2048", 12, 64, [2048], 128),
    ("ModernBERT-base local 32 x 8..128", 12, 64, None, 128),
]


def loop_ms(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def band(length: int, window: int | None) -> torch.Tensor | None:
    """bool [length, length]: |i - j| <= window // 2 (ModernBERT's local layers), None when global."""
    if window is None:
        return None
    positions = torch.arange(length)
    return (positions[:, None] - positions[None, :]).abs() <= window // 2


def runners(heads: int, dim: int, lengths: list[int], window: int | None,
            gen: torch.Generator) -> dict[str, Callable[[], object]]:
    """The runners of one packed batch of these lengths, by name."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = torch.randn(sum(lengths), 3, heads, dim, generator=gen).bfloat16().unbind(1)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    masks = {n: band(n, window) for n in set(lengths)}
    attention = torch.ops.fastbert.cpp_attention

    def per_sequence():
        return [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                               attn_mask=masks[b - a]) for a, b in bounds]

    found = {"cpp": lambda: attention(q, k, v, cu, max(lengths), None, None, window, 0.0, 0),
             "SDPA per sequence": per_sequence}
    if len(set(lengths)) == 1:
        shaped = [t.reshape(len(lengths), lengths[0], heads, dim).transpose(1, 2) for t in (q, k, v)]
        found["SDPA batched"] = lambda: F.scaled_dot_product_attention(*shaped, attn_mask=masks[lengths[0]])
    return found


def time_case(heads: int, dim: int, lengths: list[int], window: int | None, rounds: int,
              gen: torch.Generator) -> dict[str, dict]:
    named = runners(heads, dim, lengths, window, gen)
    calls = max(5, 20000 // sum(lengths))
    times: dict[str, list[float]] = {name: [] for name in named}
    with torch.inference_mode():
        for fn in named.values():
            loop_ms(fn, 3)
        for _ in range(rounds):
            for name, fn in named.items():
                times[name].append(loop_ms(fn, calls))
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "rounds_ms": t} for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cases", choices=("all", "global", "window"), default="all",
                        help="global: the cases without a window; window: ModernBERT's local layers")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    backends.load("cpp")
    torch.set_num_threads(args.threads)
    machine = machine_info(torch.device("cpu"))
    print(f"{machine['cpu']}, flags {', '.join(machine['cpu_flags'])}; torch {torch.__version__}; {machine['date']}")
    results = []
    for index, (name, heads, dim, lengths, window) in enumerate(CASES):
        if args.cases != "all" and (window is None) != (args.cases == "global"):
            continue
        gen = torch.Generator().manual_seed(index)  # a case's inputs do not depend on which cases run
        lengths = lengths or torch.randint(8, 129, (32,), generator=gen).tolist()
        timed = time_case(heads, dim, lengths, window, args.rounds, gen)
        kernel = cpp.bf16_attention_kernel(dim, window=window is not None and window // 2 < max(lengths) - 1)
        results.append({"case": name, "heads": heads, "head_dim": dim, "lengths": lengths, "window": window,
                        "kernel": kernel, "runners": timed})
        cells = ", ".join(f"{runner} {t['median_ms']:.3f} (min {t['min_ms']:.3f})" for runner, t in timed.items())
        print(f"{name} (heads {heads}, D {dim}, kernel {kernel}): {cells}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "threads": args.threads, "rounds": args.rounds, "cases": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
