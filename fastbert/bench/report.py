"""Benchmark output: aligned plain-text and Markdown tables (`format_table`), the end-to-end results as a table,
a Markdown report, JSON and PNG plots (`write_results`), and where a run writes without --out (`default_out_dir`).
Every file is written atomically through `fastbert.files` (figures with `save_figure`).

matplotlib is imported when plotting, so importing this module stays cheap."""

from __future__ import annotations

import datetime as _dt
import json
import os
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fastbert.bench.machine import machine_tag
from fastbert.files import replace_atomic, temporary_path, write_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes  # matplotlib is imported when plotting
    from matplotlib.typing import ColorType


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
    """An aligned plain-text table, or a Markdown one."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
        return "\n".join(lines)
    widths = [max(display_width(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c + " " * (w - display_width(c)) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def display_width(text: str) -> int:
    """Columns ``text`` takes in a terminal: wide (CJK) characters two, combining marks none."""
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
               for ch in text)


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.{digits}g}"


TABLE_HEADERS = ("workload", "implementation", "p50 ms", "p90 ms", "seq/s", "tokens/s", "% roofline",
                 "fastbert speed-up", "max err vs HF fp32", "note")


def result_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for workload in results["workloads"]:
        for name, entry in workload["results"].items():
            if entry.get("status") != "ok":
                rows.append([workload["name"], name, "-", "-", "-", "-", "-", "-", "-",
                             f"{entry['status']}: {entry['reason']}"])
                continue
            speedup = entry.get("fastbert_speedup")
            rows.append([workload["name"], name, _fmt(entry["p50_ms"]), _fmt(entry["p90_ms"]),
                         _fmt(entry["sequences_per_s"]), f"{entry['tokens_per_s']:.0f}",
                         f"{100 * entry['roofline_fraction']:.1f}",
                         "-" if name == "fastbert" or speedup is None else f"{speedup:.2f}x",
                         _fmt(entry["max_abs_err_vs_reference"], 2), ""])
    return rows


def _loads(values: Sequence[float] | None) -> str:
    return "-" if not values else "/".join(f"{v:.1f}" for v in values)


def summary_lines(results: dict[str, Any]) -> list[str]:
    machine, settings = results["machine"], results["settings"]
    device = machine["gpu"] or f"{machine['cpu']} ({machine['cpu_cores']} cores, {machine['torch_threads']} threads)"
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    model = results["model"]
    lines = [
        f"model: {model['name']} ({model['family']}, {model['layers']} layers, H={model['hidden']}, "
        f"heads={model['heads']}, I={model['intermediate']}); {settings['dtype']} on {device}",
        f"date: {machine['date']}; load average (1, 5, 15 min) at start {_loads(machine.get('load_average_at_start'))}"
        f", at end {_loads(machine['load_average'])}",
        f"versions: {versions}",
        *([f"CPU flags: {', '.join(machine['cpu_flags']) or 'none of interest'}; torch CPU capability "
           f"{machine.get('torch_cpu_capability')}"] if "cpu_flags" in machine else []),
        f"peak: {results['peak_flops']['value'] / 1e12:.3f} TFLOP/s ({results['peak_flops']['source']})",
        "fastbert ops ran on: " + (", ".join(f"{op}={b}" for op, b in results["fastbert_backends"].items()) or "-"),
        "backends: " + "; ".join(f"{k}: {v}" for k, v in results["backend_availability"].items()),
    ]
    return lines


def markdown_report(results: dict[str, Any]) -> str:
    settings = results["settings"]
    lines = [f"# fastbert end-to-end benchmark: {results['machine']['tag']}", ""]
    if settings.get("note"):
        lines += [f"Note: {settings['note']}", ""]
    lines += [f"- {line}" for line in summary_lines(results)]
    lines += [f"- {settings['repeats']} timed calls after {settings['warmup']} warm-up calls per implementation "
              f"and workload{' (quick mode: tiny shapes, numbers mean nothing)' if settings['quick'] else ''}; "
              f"timing {settings['timing']}",
              f"- FLOPs: {results['flops_formula']}",
              f"- agreement reference: {results['reference']}", ""]
    lines.append(format_table(TABLE_HEADERS, result_rows(results), markdown=True))
    lines += ["", "fastbert speed-up = that implementation's p50 / fastbert's p50, both measured in this run "
                  "(> 1: fastbert is faster).", "", "## How each implementation ran", ""]
    for name, notes in results["peer_notes"].items():
        lines.append(f"- {name}: " + ("; ".join(notes) if notes else "see table"))
    lines += ["", "## Workloads", ""]
    for w in results["workloads"]:
        lines.append(f"- {w['name']}: {w['batch']} x {w['seqlen']} padded, {w['tokens']} real tokens"
                     + (f", lengths {w['lengths']}" if w["varlen"] else ""))
    return "\n".join(lines) + "\n"


def grouped_bars(ax: Axes, categories: list[str], series: dict[str, list[float | None]], label: Callable[[float], str],
                 colors: Mapping[str, ColorType] | None = None, missing_at: float = 0.0) -> None:
    """One group of bars per category, one bar per series, each annotated with ``label(value)``; a value of None
    (the implementation did not run) is written as "n/a" at height ``missing_at``."""
    width = 0.8 / max(1, len(series))
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(xs, [float("nan") if v is None else v for v in values], width, label=name,
               color=(colors or {}).get(name))
        for x, value in zip(xs, values, strict=True):
            ax.annotate("n/a" if value is None else label(value), (x, missing_at if value is None else value),
                        ha="center", va="bottom", fontsize=7, rotation=90 if len(series) > 3 else 0)
    ax.set_xticks(range(len(categories)), categories)


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save a matplotlib figure as PNG at ``path`` atomically (a temporary name, then renamed) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    written = temporary_path(path)
    fig.tight_layout()
    fig.savefig(written, dpi=dpi, format="png")  # the temporary name's suffix is not .png
    plt.close(fig)
    replace_atomic(written, path)
    return path


def _column(results: dict[str, Any], name: str, key: str) -> list[float | None]:
    """``key`` of implementation ``name`` on each workload (None where it did not run)."""
    return [w["results"].get(name, {}).get(key) or None for w in results["workloads"]]


def _figure(plt: Any, workloads: int, series: int) -> tuple[Any, Any]:
    """A figure wide enough for ``workloads`` groups of ``series`` bars."""
    return plt.subplots(figsize=(max(7.0, 1.2 * workloads * max(1, series) / 2.5), 4.5))


def plot_results(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Two PNGs: p50 latency per workload and implementation, and fastbert's speed-up over each peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w["name"] for w in results["workloads"]]
    names = list(results["settings"]["peers"])
    peers = [n for n in names if n != "fastbert"]
    colors = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(names)}
    title = (f"{results['model']['name']} {results['settings']['dtype']}, {results['machine']['tag']} "
             f"({results['machine']['gpu'] or results['machine']['cpu']})")

    fig, ax = _figure(plt, len(workloads), len(names))
    measured = [e["p50_ms"] for w in results["workloads"] for e in w["results"].values() if e.get("p50_ms")]
    floor = min(measured) / 2 if measured else 1.0  # where "n/a" is written for an implementation that did not run
    grouped_bars(ax, workloads, {n: _column(results, n, "p50_ms") for n in names}, lambda v: f"{v:.3g}", colors, floor)
    ax.set_ylabel("p50 latency per batch (ms, log scale)")
    ax.set_yscale("log")
    ax.set_ylim(floor / 1.5, (max(measured) if measured else 1.0) * 4)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.margins(y=0.3)
    latency = save_figure(fig, out_dir / "e2e_latency.png")

    fig, ax = _figure(plt, len(workloads), len(peers))
    speedups = {f"vs {n}": _column(results, n, "fastbert_speedup") for n in peers}
    grouped_bars(ax, workloads, speedups, lambda v: f"{v:.2f}x", {f"vs {n}": colors[n] for n in peers})
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel("fastbert speed-up (peer p50 / fastbert p50)")
    ax.set_title(title + "; > 1: fastbert faster", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.margins(y=0.2)
    return [latency, save_figure(fig, out_dir / "e2e_speedup.png")]


DEFAULT_OUT_ROOT = Path("bench-results")
"""Where `fastbert bench` writes without --out, relative to the current directory (git-ignored in the checkout).
Not benchmarks/results/: the figures committed there, which README.md cites, change only when --out names them,
never because a smoke run was started without --out."""


def default_out_dir(device: torch.device | str, now: _dt.datetime | None = None) -> Path:
    """A new folder per run, ``bench-results/<machine-tag>-e2e-<YYYYmmdd-HHMMSS>`` (local time)."""
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return DEFAULT_OUT_ROOT / f"{machine_tag(device)}-e2e-{stamp}"


def write_results(results: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """e2e.json (every figure), e2e.md (the table) and the PNG plots under ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "e2e.json", out / "e2e.md"
    write_atomic(json_path, json.dumps(results, indent=2) + "\n")
    write_atomic(md_path, markdown_report(results))
    return [json_path, md_path] + plot_results(results, out)


# ------------------------------------------------------------------------------ interleaved runner benchmarks
# benchmarks/cpu_bench.py and benchmarks/modernbert_bench.py: cases x runners timed in interleaved rounds, with
# targets (a needed speed-up of a runner over a peer); one record layout and one Markdown rendering.
def interleaved_report(machine: dict[str, Any], model: str, rounds: int, cases: dict[str, Any],
                       targets: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The JSON record of an interleaved benchmark: the command, date, machine and versions of the run, then the
    cases (each runner's times rounded to 0.01 ms) and the targets; ``extra``: the script's own fields."""
    import sys

    for case in cases.values():
        for entry in case["runners"].values():
            entry["times_ms"] = [round(t, 2) for t in entry["times_ms"]]
    return {
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "date_utc": machine["date"],
        "machine": machine,
        "versions": {"python": machine["python"], **{k: v for k, v in machine["versions"].items() if v}},
        "model": model,
        "rounds": rounds, "cases": cases, "targets": targets, **extra,
    }


def ratio_text(ratio: float) -> str:
    """A needed ratio as written: one decimal (1.5x), two where one would round it (0.97x)."""
    return f"{ratio:.1f}x" if round(ratio, 1) == ratio else f"{ratio:.2f}x"


def interleaved_markdown(report: dict[str, Any], title: str, machine_note: str, protocol: str,
                         ms_digits: int, baseline: str = "HF eager",
                         error_key: str = "max_rel_err_vs_hf_eager") -> list[str]:
    """The Markdown lines every interleaved benchmark shares: header (date, machine, versions, command, protocol),
    one table per case (median, min, speed-up vs the runner ``baseline``, each runner's ``error_key``) and the
    targets. ``machine_note``: what follows the machine's thread count (how threads were set); ``ms_digits``:
    decimals of the milliseconds."""
    m = report["machine"]
    lines = [
        f"# {title}",
        "",
        f"- Date: {report['date_utc']}",
        f"- Machine: {m['cpu']}, {m['cpu_cores']} logical CPUs, {m['threads']} threads for every runner "
        f"{machine_note}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        f"- Command: `{report['command']}`",
        f"- {report['rounds']} interleaved rounds per case {protocol}",
        "",
    ]
    for case, data in report["cases"].items():
        base = data["runners"][baseline]["median_ms"]
        rows = [[name, f"{entry['median_ms']:.{ms_digits}f}", f"{entry['min_ms']:.{ms_digits}f}",
                 f"{base / entry['median_ms']:.2f}x", f"{entry[error_key]:.1e}"]
                for name, entry in data["runners"].items()]
        lines += [f"## {case}: batch {data['batch'][0]} x {data['batch'][1]} ({data['real_tokens']} real tokens)", "",
                  format_table(("runner", "median ms", "min ms", f"speed-up vs {baseline} (median)", "rel err"), rows,
                               markdown=True), ""]
    rows = [[t["case"], t["runner"], t["peer"], ratio_text(t["needed"]), f"{t['speedup']:.2f}x",
             "yes" if t["met"] else "NO"] for t in report["targets"]]
    lines += ["## Targets", "", format_table(("case", "runner", "peer", "needed", "measured (median)", "met"), rows,
                                             markdown=True)]
    return lines


def write_interleaved(report: dict[str, Any], markdown: str, out: str | os.PathLike | None, name: str) -> None:
    """Print the targets; with ``out``, write <name>.json and <name>.md there."""
    print(json.dumps(report["targets"], indent=1))
    if out:
        directory = Path(out)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / f"{name}.json", json.dumps(report, indent=1) + "\n")
        write_atomic(directory / f"{name}.md", markdown)
