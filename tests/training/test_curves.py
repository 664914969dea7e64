"""fastbert.training.curves: the summary and the loss-curve frame that pretrain and distill share."""

import pytest

from fastbert.training.curves import curve_figure, curve_window, moving_average, summarize_run


def _records(steps: int) -> list[dict]:
    records = [{"step": s, "tokens": 10, "elapsed_s": 0.5 * s, "mlm_loss": float(s)} for s in range(1, steps + 1)]
    return records + [{"eval": True, "step": 2, "eval_mlm_loss": 3.0}, {"eval": True, "step": 4, "eval_mlm_loss": 1.0}]


def test_moving_average_over_fewer_values_at_the_start():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 5) == [2.0, 3.0]
    assert curve_window(10) == 1 and curve_window(400) == 20 and curve_window(10_000) == 50


def test_summarize_run_means_over_each_end_and_the_first_and_last_evaluations():
    summary = summarize_run(_records(4), ("mlm_loss", "nsp_accuracy"), window=2)
    assert summary["steps"] == 4 and summary["tokens"] == 40 and summary["elapsed_s"] == 2.0
    assert summary["train_mlm_loss_first_2_steps"] == 1.5 and summary["train_mlm_loss_last_2_steps"] == 3.5
    assert not any("nsp" in key for key in summary)  # a key the records lack is left out
    assert summary["eval_first"]["eval_mlm_loss"] == 3.0 and summary["eval_last"]["eval_mlm_loss"] == 1.0
    assert summary["tokens_per_s"] == 20.0
    assert summarize_run([], ("mlm_loss",)) == {"steps": 0, "tokens": 0, "elapsed_s": 0.0}


def test_curve_figure_writes_the_png_and_nothing_when_the_drawing_raises(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "loss_curve.png"
    with curve_figure(path, "title", columns=2) as axis:
        axis.plot([1, 2], [3, 4], label="train")
        axis.twinx().plot([1, 2], [0.5, 0.6], label="held-out")
    assert path.read_bytes()[:4] == b"\x89PNG"
    failed = tmp_path / "failed.png"
    with pytest.raises(RuntimeError), curve_figure(failed, "title", columns=2):
        raise RuntimeError("drawing failed")
    assert not failed.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["loss_curve.png"]
