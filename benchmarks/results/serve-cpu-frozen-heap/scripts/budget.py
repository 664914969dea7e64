"""The server's engine: microseconds per token of a packed forward vs its token budget (real sentences of the
serve benchmark's pool), six interleaved rounds, each size run once before it is timed (row buckets).

    python budget.py float32|bfloat16     (from the repository root)
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import serve_bench as sb

from fastbert.serving.engines import load_engine

dtype = sys.argv[1]
torch.set_num_threads(2)
engine = load_engine("embed", None, "cpu", dtype)
workload, _ = sb.make_workload(4000, 8)
tokens = engine.encode(workload.pool[:3000], False, "right")


def batch(budget: int, offset: int) -> tuple[list, int]:
    chosen, total, i = [], 0, offset
    while total + len(tokens[i % len(tokens)]) <= budget:
        chosen.append(tokens[i % len(tokens)])
        total += len(tokens[i % len(tokens)])
        i += 1
    return chosen, total


sizes = [256, 512, 1024, 1536, 2048, 3072, 4096]
per_token: dict[int, list[float]] = {n: [] for n in sizes}
for round_ in range(6):
    for n in sizes:
        inputs, total = batch(n, round_ * 37 + n)
        engine.run(inputs)
        start = time.perf_counter()
        engine.run(inputs)
        per_token[n].append((time.perf_counter() - start) / total * 1e6)
for n in sizes:
    print(f"{dtype} budget {n:5d}: {statistics.median(per_token[n]):6.1f} us/token")
