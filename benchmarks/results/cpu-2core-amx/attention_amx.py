"""The cpp attention (on AMX tiles for bf16 here: `fastbert.backends.cpp.amx_attention`) against PyTorch's SDPA in
bf16, packed q/k/v as fastbert's QKV projection returns them (strided views of one [T, 3, heads, D] buffer): SDPA
per sequence (what fastbert's eager backend runs on packed input) and, for equal lengths, batched. Best of 5 timed
loops, ms per call, 2 threads.

    cd benchmarks/results/cpu-2core-amx && ../../../.venv/bin/python attention_amx.py > attention_amx.txt
"""

import time

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.backends import cpp
from fastbert.bench.machine import machine_info

backends.load("cpp")
torch.set_num_threads(2)
attention = torch.ops.fastbert.cpp_attention


def best_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def time_case(heads: int, dim: int, lengths: list[int], gen: torch.Generator) -> str:
    """'cpp X ms, SDPA per sequence Y[, SDPA batched Z]' for one packed batch of these lengths."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = torch.randn(sum(lengths), 3, heads, dim, generator=gen).bfloat16().unbind(1)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    calls = max(5, 20000 // sum(lengths))

    def per_sequence():
        return [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v))) for a, b in bounds]

    with torch.inference_mode():
        ours = best_ms(lambda: attention(q, k, v, cu, max(lengths), None, None, None, 0.0, 0), calls)
        line = f"cpp {ours:.3f} ms, SDPA per sequence {best_ms(per_sequence, calls):.3f}"
        if len(set(lengths)) == 1:
            shaped = [t.reshape(len(lengths), lengths[0], heads, dim).transpose(1, 2) for t in (q, k, v)]
            line += f", SDPA batched {best_ms(lambda: F.scaled_dot_product_attention(*shaped), calls):.3f}"
    return line


def main() -> None:
    machine = machine_info(torch.device("cpu"))
    print(f"{machine['cpu']}, flags {', '.join(machine['cpu_flags'])}; torch {torch.__version__}; {machine['date']}")
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randint(8, 129, (32,), generator=gen).tolist()
    cases = [("MiniLM 1 x 128", 12, 32, [128]), ("MiniLM 8 x 128", 12, 32, [128] * 8),
             ("MiniLM 32 x 8..128", 12, 32, mixed), ("MiniLM 2 x 512", 12, 32, [512] * 2),
             ("BERT-base 8 x 128", 12, 64, [128] * 8), ("BERT-base 1 x 1024", 12, 64, [1024])]
    for name, heads, dim, lengths in cases:
        print(f"{name} (heads {heads}, D {dim}, AMX kernel {cpp.amx_attention(dim)}): "
              f"{time_case(heads, dim, lengths, gen)}")


if __name__ == "__main__":
    main()
