"""fastbert.bench.peers: the precision peers (fastbert int8 and bfloat16, ONNX Runtime int8, OpenVINO)."""

import pytest
import torch

from fastbert import cpu, quantization
from fastbert.bench import peers
from fastbert.bench.workloads import Workload
from fastbert.common.resolve import resolve_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def minilm():
    model_dir, config = resolve_model(None)
    inputs = Workload("peers", 2, 13, [13, 6], True).inputs(config, CPU)
    return model_dir, config, inputs


def _run(name, minilm, tmp_path):
    model_dir, config, inputs = minilm
    run, notes = peers.build_peer(name, model_dir, config, torch.float32, CPU, "auto", False, str(tmp_path))
    with torch.inference_mode():
        return run(inputs), notes


def _reference(minilm, tmp_path):
    return _run("hf-eager", minilm, tmp_path)[0]


def test_fastbert_int8_peer_is_close_to_hf_fp32(minilm, tmp_path):
    out, notes = _run("fastbert-int8", minilm, tmp_path)
    real = minilm[2]["attention_mask"].bool()
    cosine = torch.nn.functional.cosine_similarity(out[real], _reference(minilm, tmp_path)[real], dim=-1)
    assert float(cosine.min()) > 0.98 and "int8" in notes[0]


def test_fastbert_bf16_peer_only_where_the_cpu_computes_bfloat16(minilm, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda path="/proc/cpuinfo": ("avx512f", "avx512_vnni"))
    with pytest.raises(peers.PeerUnavailable, match="emulated"):
        _run("fastbert-bf16", minilm, tmp_path)
    # native but measured slower than float32: dtype="auto" takes float32 there, the peer is still benchmarked
    monkeypatch.setattr(cpu, "cpu_flags", lambda path="/proc/cpuinfo": ("avx512f", "avx512_bf16"))
    monkeypatch.setattr(quantization, "bf16_gemm_speedup", lambda: 0.6)
    assert quantization.auto_cpu_dtype(("avx512f", "avx512_bf16"))[0] == torch.float32
    out, notes = _run("fastbert-bf16", minilm, tmp_path)
    assert out.dtype == torch.float32 and "bfloat16" in notes[0]


def test_unknown_peer_is_named():
    with pytest.raises(peers.PeerUnavailable, match="openvino-default"):
        peers.build_peer("nope", "", None, torch.float32, CPU, "auto", False, "")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["openvino", "openvino-default", "onnxruntime-int8"])
def test_runtime_peers_run_minilm(minilm, tmp_path, name):
    pytest.importorskip("openvino" if name.startswith("openvino") else "onnxruntime")
    out, notes = _run(name, minilm, tmp_path)
    reference = _reference(minilm, tmp_path)
    real = minilm[2]["attention_mask"].bool()
    error = float((out[real] - reference[real]).abs().max() / reference[real].abs().max())
    if name == "onnxruntime-int8":  # per-tensor activations: far from fp32, but the same model
        assert 1e-3 < error < 1.0 and "quantize_dynamic" in " ".join(notes)
    elif "inference precision bf16" in notes[-1]:  # OpenVINO's default on a CPU with native bfloat16
        assert name == "openvino-default" and 1e-5 < error < 2e-2, error
    else:
        assert "inference precision f32" in notes[-1] and error < 1e-4, (error, notes[-1])
