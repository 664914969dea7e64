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


def test_plain_table_columns_line_up_in_a_terminal_with_wide_characters():
    rows = [["日本語", "1.000"], ["abc", "0.500"], ["e\u0301x", "0.200"]]  # wide, narrow, a combining accent
    lines = report.format_table(("text", "[0]"), rows).split("\n")
    seconds = ["[0]"] + [second for _, second in rows]
    columns = [report.display_width(line[:line.index(second)]) for line, second in zip(lines[:1] + lines[2:], seconds,
                                                                                       strict=True)]
    assert columns == [8, 8, 8, 8], lines


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


def _one_case_report(runners: dict) -> dict:
    machine_fields = {"date": "2026-12-07", "cpu": "CPU", "cpu_cores": 2, "threads": 2, "python": "3.11",
                      "versions": {"torch": "2.13.0"}}
    cases = {"1x8": {"batch": [1, 8], "real_tokens": 8, "runners": runners}}
    targets = [{"case": "1x8", "runner": "fast", "peer": "plain", "needed": 1.2, "speedup": 2.0, "met": True}]
    return report.interleaved_report(machine_fields, "model", 3, cases, targets)


def test_interleaved_markdown_against_another_baseline_and_error():
    """Speed-ups against the runner named as baseline, errors under the key named (a bf16 run has no HF eager)."""
    runners = {"plain": {"median_ms": 8.0, "min_ms": 7.0, "times_ms": [8.0], "max_rel_err_vs_fp32": 2e-3},
               "fast": {"median_ms": 4.0, "min_ms": 3.5, "times_ms": [4.0], "max_rel_err_vs_fp32": 1e-3}}
    lines = report.interleaved_markdown(_one_case_report(runners), "T", "(set)", "(protocol)", ms_digits=1,
                                        baseline="plain", error_key="max_rel_err_vs_fp32")
    text = "\n".join(lines)
    assert "| runner | median ms | min ms | speed-up vs plain (median) | rel err |" in text
    assert "| plain | 8.0 | 7.0 | 1.00x | 2.0e-03 |" in text
    assert "| fast | 4.0 | 3.5 | 2.00x | 1.0e-03 |" in text
    with pytest.raises(KeyError):  # the default baseline, HF eager, is not among these runners
        report.interleaved_markdown(_one_case_report(runners), "T", "(set)", "(protocol)", ms_digits=1)
