"""benchmarks/cpu_varying_batches.py at a tiny size, so it cannot rot: both sections run and report every figure
(no timed assertion: the figures are the benchmark's, not the test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_reports_both_sections(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_varying_batches.py"), "--dtype", "bfloat16",
                    "--batches", "2", "--requests", "3", "--out", str(tmp_path)], check=True, timeout=600,
                   capture_output=True, cwd=ROOT)
    report = json.loads((tmp_path / "varying-batches-bfloat16.json").read_text())
    assert [p["pass"] for p in report["row_buckets"]] == [1, 2]
    for one in report["row_buckets"]:
        assert one["batches"] == 2 and one["tokens"] > 0 and one["seconds_on"] > 0 and one["seconds_off"] > 0
    thread = report["model_thread"]
    assert thread["forwards"] == 3 and thread["released"] is True
    assert min(thread["main_ms"], thread["other_thread_ms"], thread["other_thread_after_release_ms"]) > 0
    assert report["machine"]["cpu_flags"]
    assert "row buckets on" in (tmp_path / "varying-batches-bfloat16.md").read_text()
