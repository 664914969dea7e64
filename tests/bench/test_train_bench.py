"""benchmarks/train_bench.py at a tiny size, so the training benchmark cannot rot: every runner is checked and timed,
a fallback of fastbert.optimize is never reported as fastbert, the dropout-off checks hold the fp32 rule, and a
torch.compile that fails is recorded as that runner's result instead of stopping the run. No timed assertion."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--batch", "4", "--seqlen", "16", "--rounds", "1", "--warmup", "0"]


def load_train_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_bench", ROOT / "benchmarks" / "train_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_bench"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def train_bench() -> Iterator[ModuleType]:
    threads = torch.get_num_threads()
    yield load_train_bench()
    torch.set_num_threads(threads)  # main() sets the thread count for the rest of the process


def run(train_bench: ModuleType, out: Path, *args: str) -> dict:
    assert train_bench.main([*args, *TINY, "--threads", str(torch.get_num_threads()), "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def test_tiny_run_checks_times_and_reports_every_runner(train_bench, tmp_path):
    report = run(train_bench, tmp_path, "--cases", "tiny:fixed", "tiny:varlen:nodropout",
                 "--runners", "hf-eager", "hf-sdpa", "optimize", "own")
    names = ["HF eager", "HF SDPA", "fastbert (optimize)", "fastbert (from_pretrained)"]
    assert list(report["cases"]) == ["tiny fixed", "tiny varlen, dropout off"]
    for case in report["cases"].values():
        assert list(case["runners"]) == names and not case["failed"]
        for entry in case["runners"].values():
            assert len(entry["times_ms"]) == 1 and entry["median_ms"] > 0
            assert entry["params_without_grad"] == []
    fixed, varlen = report["cases"]["tiny fixed"], report["cases"]["tiny varlen, dropout off"]
    assert fixed["dropout"] == 0.1 and varlen["dropout"] == 0.0
    assert fixed["real_tokens"] == 64 and 16 <= varlen["real_tokens"] < 64 and max(varlen["lengths"]) == 16
    assert fixed["runners"]["HF eager"]["dropout_observed"] is True
    assert all(entry["dropout_observed"] is False for entry in varlen["runners"].values())
    for name in names[1:]:  # dropout off, same weights: the fp32 rule against HF eager
        assert varlen["runners"][name]["loss_rel_err_vs_hf_eager"] <= 1e-5
    for name in ("HF SDPA", "fastbert (optimize)"):
        assert varlen["runners"][name]["grad_max_rel_err_vs_hf_eager"] <= 1e-5
    optimized = varlen["runners"]["fastbert (optimize)"]
    fell_back = "transformers' code runs" in optimized["path"]
    assert optimized["runs_fastbert"] is (not fell_back and bool(optimized["ops_ran_on"]))
    assert varlen["runners"]["fastbert (from_pretrained)"]["runs_fastbert"] is True
    [target] = report["targets"]
    assert target["case"] == "tiny varlen, dropout off" and target["runner"] == "fastbert (optimize)"
    assert target["runs_fastbert"] is optimized["runs_fastbert"]
    assert not (target["met"] and fell_back)
    markdown = (tmp_path / "results.md").read_text()
    assert "## tiny varlen, dropout off: batch 4 x 16" in markdown and "## Targets" in markdown
    assert ("FALLBACK" in markdown) is fell_back


def test_failed_compile_is_recorded_not_raised(train_bench, tmp_path, monkeypatch):
    def broken_compile(model, *args, **kwargs):
        def call(**inputs):
            raise RuntimeError("no C++ compiler here")
        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    report = run(train_bench, tmp_path, "--cases", "tiny:varlen", "--runners", "hf-eager", "compile")
    case = report["cases"]["tiny varlen"]
    assert list(case["runners"]) == ["HF eager"]
    assert "no C++ compiler here" in case["failed"]["torch.compile (HF SDPA)"]
    assert "torch.compile (HF SDPA): not timed: " in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_tiny_run_with_torch_compile(train_bench, tmp_path):
    """The real inductor compilation of a training step (about a minute on 2 cores)."""
    report = run(train_bench, tmp_path, "--cases", "tiny:varlen:nodropout", "--runners", "hf-eager", "compile")
    compiled = report["cases"]["tiny varlen, dropout off"]["runners"]["torch.compile (HF SDPA)"]
    assert compiled["median_ms"] > 0 and compiled["loss_rel_err_vs_hf_eager"] <= 1e-5
    assert compiled["grad_max_rel_err_vs_hf_eager"] <= 1e-5
