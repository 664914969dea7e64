"""Drive a running server: closed loop at C clients or open loop at R requests/s for D seconds; print figures.

    python drive.py URL closed|open VALUE SECONDS     (from the repository root)
"""

import asyncio
import sys

import numpy as np

sys.path.insert(0, "benchmarks")
import serve_bench as sb

url, mode, value, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
workload, _ = sb.make_workload(4000, 8)
if mode == "closed":
    phase = asyncio.run(sb.closed_loop(url, workload, int(value), seconds, 100000))
else:
    phase = asyncio.run(sb.open_loop(url, workload, value, seconds, 100000, 0))
latency = np.array([s.latency for s in phase.samples])
texts = sum(len(s.texts) for s in phase.samples)
p50, p90, p99 = np.percentile(latency, [50, 90, 99]) * 1e3
print(f"{mode} {value} req {len(latency)} texts/s {texts / phase.wall:.1f} "
      f"p50 {p50:.1f} p90 {p90:.1f} p99 {p99:.1f} ms")
statuses = np.array([s.status for s in phase.samples])
for code in (200, 429):
    chosen = latency[statuses == code]
    if chosen.size:
        print(f"status {code}: n={chosen.size} p50 {np.percentile(chosen, 50) * 1e3:.1f} "
              f"p99 {np.percentile(chosen, 99) * 1e3:.1f} ms")
