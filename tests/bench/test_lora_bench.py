"""benchmarks/lora_bench.py at a tiny size, so the PEFT LoRA benchmark cannot rot: every runner is checked (loss and
every trainable gradient against peft-eager, memory saved for backward) and timed, the inference section runs, and
a fastbert runner that fell back to transformers' code is marked so and never meets a target; fastbert's runner takes
its own path with PEFT's gradients. No timed assertion."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
CASE = "tiny varlen r8 qkvd, dropout off"
TINY = ["--cases", "tiny:varlen:r8:qkvd:nodropout", "--batch", "2", "--seqlen", "16", "--rounds", "1",
        "--warmup", "0", "--infer-batch", "2x16"]
FELL_BACK = "fastbert: this call runs transformers' code (no speed-up): a LoRA adapter ..."


def load_lora_bench() -> ModuleType:
    """The script as a module; it imports train_bench from its own folder, as it does when run as a script."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("lora_bench", ROOT / "benchmarks" / "lora_bench.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["lora_bench"] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


@pytest.fixture(scope="module")
def lora_bench() -> Iterator[ModuleType]:
    threads = torch.get_num_threads()
    yield load_lora_bench()
    torch.set_num_threads(threads)  # main() sets the thread count for the rest of the process


def test_tiny_run_checks_times_and_reports_every_runner(lora_bench: ModuleType, tmp_path: Path) -> None:
    assert lora_bench.main([*TINY, "--threads", str(torch.get_num_threads()), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    case = report["cases"][CASE]
    assert list(case["runners"]) == ["peft-eager", "peft-sdpa", "fastbert"] and case["failed"] == {}
    assert case["rank"] == 8 and case["target_modules"] == ["query", "key", "value", "dense"] and case["dropout"] == 0
    assert 4 <= case["real_tokens"] < 32 and max(case["lengths"]) == 16
    trainable = {entry["trainable_params"] for entry in case["runners"].values()}
    assert len(trainable) == 1 and trainable.pop() > 0
    for name, entry in case["runners"].items():
        assert len(entry["times_ms"]) == 1 and entry["median_ms"] > 0 and entry["min_ms"] > 0
        assert entry["saved_for_backward_bytes"] > 0 and entry["params_without_grad"] == []
        assert entry["fell_back"] is (lora_bench.fell_back(entry) if name == "fastbert" else None)
    for name in ("peft-sdpa", "fastbert"):  # dropout off, the same weights and adapter: compared with peft-eager
        entry = case["runners"][name]
        assert isinstance(entry["loss_rel_err"], float) and isinstance(entry["grad_worst_rel_err"], float)
        assert entry["grad_worst_param"].startswith("base_model.model.")
    assert case["runners"]["peft-sdpa"]["loss_rel_err"] <= 1e-5
    assert case["runners"]["peft-sdpa"]["grad_worst_rel_err"] <= 1e-4
    fast = case["runners"]["fastbert"]
    assert fast["fell_back"] is False and fast["loss_rel_err"] <= 1e-5 and fast["grad_worst_rel_err"] <= 1e-5
    inference = report["inference"]["tiny varlen r8 qkvd"]
    assert list(inference["runners"]) == ["fastbert-unmerged", "fastbert-merged"] and inference["failed"] == {}
    assert all(entry["median_ms"] > 0 for entry in inference["runners"].values())
    assert inference["logits_rel_err"] <= 1e-4 and inference["unmerged_over_merged_speed"] > 0
    assert {(t["section"], t["peer"]) for t in report["targets"]} == {
        ("train step", "peft-sdpa"), ("train step", "peft-eager"), ("inference", "fastbert-merged")}
    assert not any(t["met"] and t["fell_back"] for t in report["targets"])
    assert report["machine"]["cpuinfo_flags"] and report["source"]["fastbert"]
    markdown = (tmp_path / "results.md").read_text()
    assert f"## {CASE}: batch 2 x 16" in markdown and "## Targets" in markdown and "## Inference" in markdown
    assert ("**fell back**" in markdown) is (case["runners"]["fastbert"]["fell_back"]
                                             or any(e["fell_back"] for e in inference["runners"].values()))


def ran(path: str = "BertModel: fastbert's path (backend auto)", ops: dict | None = None,
        warnings: tuple[str, ...] = ()) -> dict:
    return {"path": path, "ops_ran_on": {"attention": "cpp"} if ops is None else ops, "warnings": list(warnings)}


def test_fell_back_unless_explain_ops_and_warnings_all_say_fastbert(lora_bench: ModuleType) -> None:
    assert lora_bench.fell_back(ran()) is False
    assert lora_bench.fell_back(ran(warnings=("fastbert: some other note",))) is False
    assert lora_bench.fell_back(ran(warnings=(FELL_BACK,))) is True
    assert lora_bench.fell_back(ran(path="BertModel: transformers' code runs: a LoRA adapter ...")) is True
    assert lora_bench.fell_back(ran(ops={})) is True
    assert lora_bench.fell_back(ran(path=None)) is True


def entries(lora_bench: ModuleType, fastbert_ms: float, fell_back: bool) -> dict:
    out = {"peft-eager": {"median_ms": 300.0}, "peft-sdpa": {"median_ms": 200.0},
           "fastbert": {"median_ms": fastbert_ms, "fell_back": fell_back}}
    lora_bench.add_speedups(out)
    return out


@pytest.mark.parametrize(("fastbert_ms", "fell_back", "met"), [(100.0, False, True), (100.0, True, False),
                                                               (150.0, False, False)])
def test_the_step_target_is_met_only_on_fastbert_s_path(lora_bench: ModuleType, fastbert_ms: float, fell_back: bool,
                                                        met: bool) -> None:
    cases = {"minilm varlen r8 qkvd": {"size": "minilm", "rank": 8, "targets": "qkvd",
                                       "runners": entries(lora_bench, fastbert_ms, fell_back)},
             "minilm varlen r16 qkvd": {"size": "minilm", "rank": 16, "targets": "qkvd",
                                        "runners": entries(lora_bench, fastbert_ms, fell_back)}}
    rows = {(t["case"], t["peer"]): t for t in lora_bench.step_targets(cases)}
    target = rows[("minilm varlen r8 qkvd", "peft-sdpa")]
    assert target["needed"] == 1.5 and target["met"] is met and target["fell_back"] is fell_back
    assert target["speedup"] == pytest.approx(200.0 / fastbert_ms, abs=1e-3)
    others = [t for key, t in rows.items() if key != ("minilm varlen r8 qkvd", "peft-sdpa")]
    assert len(others) == 3 and all(t["needed"] is None and t["met"] is None for t in others)


def test_the_inference_target_needs_both_models_on_fastbert_s_path(lora_bench: ModuleType) -> None:
    def data(ratio: float, unmerged_fell_back: bool) -> dict:
        return {"unmerged_over_merged_speed": ratio, "runners": {"fastbert-unmerged": {"fell_back": unmerged_fell_back},
                                                                 "fastbert-merged": {"fell_back": False}}}

    rows = lora_bench.inference_targets({"a": data(0.97, False), "b": data(0.97, True), "c": data(0.9, False),
                                         "d": {"failed": {"inference": "boom"}, "runners": {}}})
    assert [(t["case"], t["met"]) for t in rows] == [("a", True), ("b", False), ("c", False)]


def test_cases_parse_and_bad_cases_exit(lora_bench: ModuleType) -> None:
    case = lora_bench.LoraCase.parse("base:fixed:r16:attn:nodropout")
    assert (case.size, case.kind, case.rank, case.targets, case.dropout) == ("base", "fixed", 16, "attn", False)
    assert case.name == "base fixed r16 attn, dropout off" and case.adapter == "base fixed r16 attn"
    config = lora_bench.LoraCase.parse("minilm:varlen:r8:qkvd").lora_config()
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 16, 0.1)
    assert set(config.target_modules) == {"query", "key", "value", "dense"}
    for bad in ("minilm:varlen:qkvd", "minilm:varlen:r0:qkvd", "minilm:varlen:r8:all", "huge:varlen:r8:qkvd",
                "minilm:varlen:r8:qkvd:dropout"):
        with pytest.raises(SystemExit):
            lora_bench.LoraCase.parse(bad)


def test_memory_saved_for_backward_leaves_the_parameters_out(lora_bench: ModuleType) -> None:
    linear = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with lora_bench.saved_for_backward(linear) as saved:
        linear(x).sum().backward()
    assert saved == {"bytes": x.numel() * 4, "storages": 1}  # the input; the weight is the model's own
