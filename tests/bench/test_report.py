"""fastbert.bench.report: tables, where a run writes by default, and result files written whole (through
fastbert.files, no temporary file left)."""

import datetime
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from fastbert.bench import machine, report


def test_default_output_is_a_new_ignored_folder_not_the_committed_results():
    first = report.default_out_dir("cpu", now=datetime.datetime(2025, 3, 4, 5, 6, 7))
    assert first == Path("bench-results") / f"{machine.machine_tag('cpu')}-e2e-20250304-050607"
    assert Path("benchmarks", "results") not in first.parents
    assert report.default_out_dir("cpu", now=datetime.datetime(2025, 3, 4, 5, 6, 8)) != first
    repo = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", str(first / "e2e.json")])
    assert ignored.returncode == 0, f"{first} is not git-ignored: a smoke run's files would show as changes"


def test_format_table_plain_and_markdown():
    plain = report.format_table(("a", "bee"), [[1, 2], ["long", 3]])
    assert plain.splitlines() == ["a     bee", "----  ---", "1     2", "long  3"]
    assert report.format_table(("a", "b"), [[1, 2]], markdown=True) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_interleaved_results_and_figures_are_written_whole(tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = {"targets": [{"case": "c", "met": True}], "cases": {}}
    report.write_interleaved(record, "# title\n", tmp_path / "out", "run")
    assert json.loads((tmp_path / "out" / "run.json").read_text()) == record
    assert (tmp_path / "out" / "run.md").read_text() == "# title\n"
    assert '"met": true' in capsys.readouterr().out
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    saved = report.save_figure(fig, tmp_path / "out" / "plot.png")
    assert saved.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["plot.png", "run.json", "run.md"]
