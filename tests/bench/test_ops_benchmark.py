"""benchmarks/test_ops_bench.py runs (so the per-op benchmark cannot rot)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # a pytest run of its own: ~16 s here
def test_ops_benchmark_runs_once_per_case(tmp_path):
    """benchmarks/test_ops_bench.py with the fewest timing rounds: every case checks its fused backends against the
    unfused PyTorch ops and the report (ops.md, ops.json, ops_speedup.png) is written, so the per-op benchmark
    cannot rot."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "ops"
    proc = subprocess.run([sys.executable, "-m", "pytest", str(root / "benchmarks" / "test_ops_bench.py"), "-q",
                           "--benchmark-min-rounds=1", "--benchmark-max-time=0.000001", "--benchmark-warmup=off",
                           "-p", "no:cacheprovider", f"--rootdir={root}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "FASTBERT_BENCH_OUT": str(out)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    rows = json.loads((out / "ops.json").read_text())["rows"]
    assert {row["op"] for row in rows} >= {"embedding_layernorm", "qkv_projection", "attention", "linear_activation",
                                           "linear_residual_layernorm"}
    assert "| attention-varlen | torch |" in (out / "ops.md").read_text()
    assert (out / "ops_speedup.png").stat().st_size > 10_000
