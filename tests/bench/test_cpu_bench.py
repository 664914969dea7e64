"""benchmarks/cpu_bench.py's comparison of ``auto`` against each backend forced alone (issue 41's target: within
3 % of the fastest in every case), on made-up medians: no model runs here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cpu_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cpu_bench", ROOT / "benchmarks" / "cpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["cpu_bench"] = module
    spec.loader.exec_module(module)
    return module


def medians(**ms: float) -> dict:
    names = {"auto": "fastbert (from_pretrained)", "cpp": "fastbert cpp", "onednn": "fastbert onednn",
             "eager": "fastbert eager", "ort": "ONNX Runtime"}
    return {names[k]: {"median_ms": v} for k, v in ms.items()}


def test_auto_is_judged_against_the_fastest_forced_backend(cpu_bench: ModuleType) -> None:
    row = cpu_bench.forced_comparison("8x128", medians(auto=120.0, cpp=134.0, onednn=118.0, eager=141.0, ort=90.0),
                                      "onednn")
    assert row["peer"] == "fastbert onednn (fastest forced: onednn 118.0, cpp 134.0, eager 141.0 ms; auto ran: onednn)"
    assert row["speedup"] == pytest.approx(118.0 / 120.0, abs=1e-3)
    assert row["met"] and row["needed"] == 0.97


def test_auto_more_than_three_percent_slower_misses(cpu_bench: ModuleType) -> None:
    row = cpu_bench.forced_comparison("varlen32", medians(auto=200.0, cpp=190.0, onednn=210.0))
    assert row["peer"].startswith("fastbert cpp") and not row["met"]


def test_no_forced_runners_no_row(cpu_bench: ModuleType) -> None:
    assert cpu_bench.forced_comparison("1x128", medians(auto=10.0, ort=12.0)) is None


def test_the_whole_model_choice_of_the_cases_class_is_named(cpu_bench: ModuleType) -> None:
    threads = cpu_bench.torch.get_num_threads()
    choices = {f"model bert-1 float32 no-grad t{threads} tokens<=1024": {"choice": "onednn"},
               f"model bert-1 float32 no-grad t{threads} tokens<=4096": {"choice": "per-op table"},
               f"model bert-1 bfloat16 no-grad t{threads} tokens<=1024": {"choice": "cpp"}}
    assert cpu_bench.whole_model_choice(choices, 1024) == "onednn"
    assert cpu_bench.whole_model_choice(choices, 2176) == "per-op table"
    assert cpu_bench.whole_model_choice(choices, 128) is None
