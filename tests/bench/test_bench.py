"""fastbert.bench and its neighbours: cost formulas on hand-computed numbers, workloads, backend recording, pooling
against sentence-transformers (fastbert.common.text), user-input checks (fastbert.common.resolve), the end-to-end
benchmark in quick mode (so it cannot rot)."""

import datetime
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fastbert import backends
from fastbert.bench import costs, e2e, machine, peers, recording, report, timing, workloads
from fastbert.common import resolve, text
from fastbert.config import FastBertConfig

# The ops a BERT encoder (MiniLM here) runs: ModernBERT's qkv_rotary, linear_glu and linear_residual_prenorm are not
# among them, so a BERT forward records a subset of recording.OPS.
BERT_OPS = {"embedding_layernorm", "qkv_projection", "attention", "linear_activation", "linear_residual_layernorm"}


# ------------------------------------------------------------------------------------------------ formulas
def test_encoder_flops_bert_base_known_number():
    # BERT-base, S=128: 12 * (24 * 768^2 + 4 * 128 * 768) = 12 * 14_548_992
    assert costs.encoder_flops_per_token(12, 768, 128) == 174_587_904


def test_encoder_flops_minilm_and_explicit_intermediate():
    # MiniLM-L6-H384: I = 1536 = 4H, so both forms agree: 6 * (24 * 384^2 + 4 * 16 * 384)
    assert costs.encoder_flops_per_token(6, 384, 16) == 6 * (24 * 384**2 + 4 * 16 * 384) == 21_381_120
    assert costs.encoder_flops_per_token(6, 384, 16, intermediate=1536) == 21_381_120
    # I = 2H (not 4H): per layer 8H^2 + 4*H*I + 4SH = 16H^2 + 4SH
    assert costs.encoder_flops_per_token(1, 10, 3, intermediate=20) == 8 * 100 + 4 * 10 * 20 + 4 * 3 * 10


def test_batch_flops_sums_real_lengths_only():
    config = FastBertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    expected = 3 * costs.encoder_flops_per_token(2, 8, 3, 32) + 5 * costs.encoder_flops_per_token(2, 8, 5, 32)
    assert costs.batch_flops(config, [3, 5]) == expected


def test_gemm_op_costs_by_hand():
    # T=2, H=4, fp32: FLOPs 2*T*H*3H = 192; bytes (x 8 + W 48 + b 12 + qkv out 24) * 4 = 368
    assert costs.qkv_projection_cost(2, 4, 4) == costs.OpCost(192.0, 368.0)
    # T=3, K=5, N=7, fp16: FLOPs 2*3*5*7 = 210; bytes (15 + 35 + 7 + 21) * 2 = 156
    assert costs.linear_activation_cost(3, 5, 7, 2) == costs.OpCost(210.0, 156.0)
    # + 10 FLOPs per output element for bias, residual and LayerNorm; bytes (15 + 35 + 21 + 2*21) * 2 = 226
    assert costs.linear_residual_layernorm_cost(3, 5, 7, 2) == costs.OpCost(210.0 + 210.0, 226.0)


def test_attention_cost_counts_each_sequence_square():
    # lengths 2 and 3, 4 heads, D=8: 4 * (4 + 9) * 4 * 8 FLOPs; q, k, v, out: 4 * 5 tokens * 32 * 2 bytes
    assert costs.attention_cost([2, 3], 4, 8, 2) == costs.OpCost(4 * 13 * 32.0, 4 * 5 * 32 * 2.0)


def test_embedding_layernorm_cost_by_hand():
    # T=2, E=4, fp32, token types: read 3 rows (48 B) + 3 int64 ids (24 B) per token, LN params 32 B, write 16 B
    cost = costs.embedding_layernorm_cost(2, 4, 4, token_types=True)
    assert cost.bytes == 2 * (48 + 24) + 32 + 2 * 16
    assert cost.flops == 2 * 4 * (2 + 8)
    assert costs.embedding_layernorm_cost(2, 4, 4, token_types=False).bytes == 2 * (32 + 16) + 32 + 2 * 16


def test_percentile_interpolates():
    assert timing.percentile([4, 1, 3, 2], 50) == 2.5
    assert timing.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == pytest.approx(9.1)
    assert timing.percentile([7], 90) == 7
    with pytest.raises(ValueError):
        timing.percentile([], 50)


# ----------------------------------------------------------------------------------------------- workloads
def test_make_workloads_fixed_and_varlen():
    made = workloads.make_workloads([1, 5], [32], varlen=True, seed=3)
    names = [w.name for w in made]
    assert names == ["b1 s32", "b5 s32", "varlen b5 s<=32"]  # no varlen batch of one sequence
    fixed, varlen = made[1], made[2]
    assert fixed.lengths == [32] * 5 and fixed.tokens == 160
    assert len(varlen.lengths) == 5 and max(varlen.lengths) == 32 and min(varlen.lengths) >= 4
    assert varlen.tokens == sum(varlen.lengths) < 160


def test_workload_inputs_pad_where_masked():
    config = FastBertConfig(model_type="roberta", vocab_size=50, hidden_size=8, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=16, pad_token_id=1)
    workload = workloads.Workload("w", 3, 6, [6, 2, 4], True)
    batch = workload.inputs(config, torch.device("cpu"))
    assert batch["attention_mask"].sum(dim=1).tolist() == [6, 2, 4]
    real = batch["attention_mask"].bool()
    assert bool((batch["input_ids"][~real] == 1).all())
    assert not bool((batch["input_ids"][real] == 1).any())


# ------------------------------------------------------------------------------------------ model helpers
def test_record_backends_counts_every_op_and_restores_dispatch(minilm_dir):
    model = peers.load_fastbert(minilm_dir, backend="eager")
    original = backends.dispatch
    with torch.inference_mode(), recording.record_backends() as seen:
        model(input_ids=torch.tensor([[101, 7592, 2088, 102]]))
    assert backends.dispatch is original
    assert BERT_OPS <= set(recording.OPS) and set(seen) == BERT_OPS
    assert seen["attention"]["eager"] == model.config.num_hidden_layers
    assert recording.backends_used(seen) == {op: "eager" for op in BERT_OPS}


def test_mean_pooling_matches_sentence_transformers(minilm_dir):
    from sentence_transformers import SentenceTransformer

    texts = ["The cat sat on the mat.", "A much longer sentence, so that the first one is padded in the batch."]
    config = FastBertConfig.from_json_file(f"{minilm_dir}/config.json")
    batch = text.TextEncoder(minilm_dir, config)(texts)
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()  # padding really happens
    with torch.inference_mode():
        hidden = peers.load_fastbert(minilm_dir)(**batch).last_hidden_state
    ours = text.mean_pool(hidden, batch["attention_mask"])
    theirs = torch.from_numpy(SentenceTransformer(minilm_dir, device="cpu").encode(texts, normalize_embeddings=True))
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


def test_resolve_errors_are_user_errors(tmp_path):
    with pytest.raises(resolve.UserError, match="does not exist"):
        resolve.resolve_model(str(tmp_path / "absent"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(resolve.UserError, match="not supported"):
        resolve.resolve_model(str(tmp_path))
    with pytest.raises(resolve.UserError, match="dtype"):
        resolve.resolve_dtype("float64", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(resolve.UserError, match="not present"):
            resolve.resolve_device("cuda")


# ------------------------------------------------------------------------------------------ e2e quick mode
def test_run_e2e_quick_reports_figures_and_failed_peers(minilm_dir, tmp_path, monkeypatch):
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
    assert set(results["fastbert_backends"]) == BERT_OPS
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
    assert all(p.stat().st_size > 10_000 for p in paths if p.suffix == ".png")


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


def test_run_e2e_rejects_unknown_peer(minilm_dir):
    with pytest.raises(resolve.UserError, match="unknown peer"):
        e2e.run_e2e(e2e.quick_settings(minilm_dir, peers=["hf-eager", "tensorrt"]), progress=False)


def test_ops_benchmark_runs_once_per_case(tmp_path):
    """benchmarks/test_ops_bench.py with the fewest timing rounds: every case checks its fused backends against the
    unfused PyTorch ops and the report (ops.md, ops.json, ops_speedup.png) is written, so the per-op benchmark
    cannot rot."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "ops"
    proc = subprocess.run([sys.executable, "-m", "pytest", str(root / "benchmarks" / "test_ops_bench.py"), "-q",
                           "--benchmark-min-rounds=1", "--benchmark-max-time=0.000001", "--benchmark-warmup=off",
                           "-p", "no:cacheprovider", f"--rootdir={root}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "FASTBERT_BENCH_OUT": str(out)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    rows = json.loads((out / "ops.json").read_text())["rows"]
    assert {row["op"] for row in rows} >= {"embedding_layernorm", "qkv_projection", "attention", "linear_activation",
                                           "linear_residual_layernorm"}
    assert "| attention-varlen | torch |" in (out / "ops.md").read_text()
    assert (out / "ops_speedup.png").stat().st_size > 10_000
