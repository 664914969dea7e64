"""What `fastbert pretrain` and `fastbert distill` write about a run besides its checkpoints: summary.json (the
first and last figures, `summarize_run`) and loss_curve.png (moving averages of the training figures against the
step, the held-out ones as points; `curve_figure` draws the frame, each command its own lines). matplotlib is
imported when a curve is drawn, never at import."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastbert.files import replace_atomic, temporary_path

SUMMARY_WINDOW = 50  # steps averaged at each end of a run in summary.json


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def curve_window(steps: int) -> int:
    """The moving average's window of a curve of ``steps`` steps: a twentieth of them, between 1 and 50."""
    return max(1, min(50, steps // 20))


def split_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training step records, held-out evaluation records) of a run's metrics, each in order."""
    return [r for r in records if not r.get("eval")], [r for r in records if r.get("eval")]


def summarize_run(records: list[dict[str, Any]], keys: Sequence[str], window: int = SUMMARY_WINDOW) -> dict[str, Any]:
    """Steps, tokens, time, the mean of each of ``keys`` (those the step records hold) over the first and the last
    ``window`` steps, the first and last held-out evaluations, and tokens per second."""
    steps, evals = split_records(records)
    summary: dict[str, Any] = {"steps": steps[-1]["step"] if steps else 0,
                               "tokens": sum(r["tokens"] for r in steps),
                               "elapsed_s": steps[-1]["elapsed_s"] if steps else 0.0}
    for key in keys:
        values = [r[key] for r in steps if key in r]
        if values:
            first, last = values[:window], values[-window:]
            summary[f"train_{key}_first_{len(first)}_steps"] = sum(first) / len(first)
            summary[f"train_{key}_last_{len(last)}_steps"] = sum(last) / len(last)
    if evals:
        summary["eval_first"], summary["eval_last"] = evals[0], evals[-1]
    if summary["elapsed_s"]:
        summary["tokens_per_s"] = summary["tokens"] / summary["elapsed_s"]
    return summary


@contextmanager
def curve_figure(path: Path, title: str, columns: int) -> Iterator[Any]:
    """The matplotlib axis of a new curve, to draw on (a second axis: ``axis.twinx()``); on leaving, one legend
    of every axis's lines under the plot in ``columns`` columns, the title, and the PNG written to ``path``
    atomically. Nothing is written when the drawing raises."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    try:
        yield axis
        handles, labels = [], []
        for each in figure.axes:  # the first axis, then those twinx added, in order
            more_handles, more_labels = each.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
        axis.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=columns, fontsize=8,
                    frameon=False)
        axis.set_title(title)
        figure.tight_layout()
        written = temporary_path(path)
        figure.savefig(written, format="png", dpi=110, bbox_inches="tight")
        replace_atomic(written, path)
    finally:
        plt.close(figure)
