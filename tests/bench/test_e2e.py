"""fastbert.bench.e2e in quick mode (so it cannot rot): figures, failed peers reported, results written."""

import json

import pytest
import torch

from fastbert.bench import e2e, report
from fastbert.common import resolve


def test_run_e2e_quick_reports_figures_and_failed_peers(minilm_dir, tmp_path, monkeypatch, bert_ops):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler in this test")

    monkeypatch.setattr(torch, "compile", no_compiler)
    settings = e2e.quick_settings(minilm_dir, peers=["hf-eager", "compile", "onnxruntime"], seqs=[12])
    results = e2e.run_e2e(settings, progress=False)

    assert results["schema"] == e2e.RESULT_SCHEMA
    for key in ("machine", "model", "settings", "peak_flops", "flops_formula", "reference", "fastbert_backends",
                "backend_availability", "peer_notes", "workloads"):
        assert key in results
    assert results["machine"]["cpu_cores"] >= 1 and results["machine"]["versions"]["torch"]
    assert [w["name"] for w in results["workloads"]] == ["b2 s12", "varlen b2 s<=12"]
    assert set(results["fastbert_backends"]) == bert_ops
    for workload in results["workloads"]:
        row = workload["results"]
        assert row["compile"]["status"] == "unavailable" and "no C++ compiler" in row["compile"]["reason"]
        for name in ("fastbert", "hf-eager", "onnxruntime"):
            entry = row[name]
            assert entry["status"] == "ok", entry
            assert entry["p50_ms"] <= entry["p90_ms"] and len(entry["times_ms"]) == settings.repeats
            assert entry["max_abs_err_vs_reference"] < 1e-4
            assert entry["tokens_per_s"] == pytest.approx(workload["tokens"] / entry["p50_ms"] * 1e3)
            assert entry["roofline_fraction"] > 0
        assert row["hf-eager"]["fastbert_speedup"] == pytest.approx(row["hf-eager"]["p50_ms"]
                                                                    / row["fastbert"]["p50_ms"])
    assert results["workloads"][1]["tokens"] < results["workloads"][1]["padded_tokens"]

    paths = report.write_results(results, tmp_path)
    assert sorted(p.name for p in paths) == ["e2e.json", "e2e.md", "e2e_latency.png", "e2e_speedup.png"]
    assert json.loads((tmp_path / "e2e.json").read_text())["workloads"][0]["results"]["fastbert"]["status"] == "ok"
    markdown = (tmp_path / "e2e.md").read_text()
    assert "| workload | implementation | p50 ms" in markdown and "unavailable: torch.compile failed" in markdown
    flags = ", ".join(results["machine"]["cpu_flags"]) or "none of interest"
    assert f"- CPU flags: {flags}; torch CPU capability" in markdown  # every CPU result names the flags
    assert all(p.stat().st_size > 10_000 for p in paths if p.suffix == ".png")


def test_run_e2e_rejects_unknown_peer(minilm_dir):
    with pytest.raises(resolve.UserError, match="unknown peer"):
        e2e.run_e2e(e2e.quick_settings(minilm_dir, peers=["hf-eager", "tensorrt"]), progress=False)
