"""benchmarks/short_queries_cpu.py at a tiny size, so it cannot rot: every runner of every case reports a time,
and the filled and exact forwards both run (no timed assertion: the figures are the benchmark's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_reports_every_runner(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "short_queries_cpu.py"), "--models", "minilm",
                    "--lengths", "1", "7", "--rounds", "1", "--calls", "1", "--out", str(tmp_path)], check=True,
                   timeout=600, capture_output=True, cwd=ROOT)
    report = json.loads((tmp_path / "short_queries_cpu.json").read_text())
    assert {r["tokens"] for r in report["results"]} == {1, 7} and report["machine"]["cpu_flags"] is not None
    for result in report["results"]:
        assert set(result["median_ms"]) == {"HF SDPA", "fastbert filled", "fastbert exact"}
        assert min(result["median_ms"].values()) > 0
    assert "exact vs filled" in (tmp_path / "short_queries_cpu.md").read_text()
