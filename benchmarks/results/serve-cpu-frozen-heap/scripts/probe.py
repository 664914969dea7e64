"""Every 20 ms for SECONDS: GET /health on a kept connection and on a fresh one; print latency percentiles.

    python probe.py PORT SECONDS
"""

import http.client
import sys
import time

import numpy as np

port, seconds = int(sys.argv[1]), float(sys.argv[2])
kept, fresh = [], []
connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)


def timed_get(conn: http.client.HTTPConnection) -> float:
    start = time.perf_counter()
    conn.request("GET", "/health")
    conn.getresponse().read()
    return time.perf_counter() - start


end = time.time() + seconds
while time.time() < end:
    kept.append(timed_get(connection))
    other = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    fresh.append(timed_get(other))
    other.close()
    time.sleep(0.02)
for name, values in (("kept", kept), ("fresh", fresh)):
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) * 1e3
    print(f"{name} {len(values)} p50 {p50:.1f} p90 {p90:.1f} p99 {p99:.1f} max {max(values) * 1e3:.1f} ms")
