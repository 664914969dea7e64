"""The triton backend's registration (every op with its backward), its `supports` reasons, the CPU-without-interpreter
refusal, torch.compile(fullgraph=True) over the custom ops, the GEMM configs and the backward kernels' own torch ops
(opcheck)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fastbert import backends, kernels, ops  # noqa: F401 (kernels: registers the triton torch ops called directly)
from tests.helpers import DEVICE, rand

OPS = tuple(ops.SPECS)


def test_all_ops_registered():
    assert backends.available()["triton"] is None
    for op in OPS:
        assert "triton" in backends._REGISTRY[op], f"{op} has no triton implementation"
        assert hasattr(torch.ops.fastbert, f"triton_{op}")


def test_supports_reasons():
    x64 = torch.zeros(3, 8, dtype=torch.float64, device=DEVICE)
    w64 = torch.zeros(8, 8, dtype=torch.float64, device=DEVICE)
    assert "dtype float64" in backends.why_not("linear_activation", "triton", x64, w64, None, "gelu")
    x16 = x64.half()
    assert "mixed dtypes" in backends.why_not("linear_activation", "triton", x16, w64, None, "gelu")
    with torch.enable_grad():  # every op has a backward (its spec's): grad mode is no reason to refuse
        w = w64.float().requires_grad_()
        assert backends.why_not("linear_activation", "triton", x64.float(), w, None, "gelu") is None
    assert backends.why_not("linear_activation", "triton", x16, w64.half(), None, "gelu") is None


def test_cpu_without_interpreter_is_refused_with_the_reason():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = (
        "import torch, fastbert\n"
        "x = torch.zeros(2, 8, dtype=torch.float16)\n"
        "print(fastbert.backends.why_not('linear_activation', 'triton', x, torch.zeros(4, 8, dtype=torch.float16),"
        " None, 'gelu'))\n"
        "try:\n"
        "    fastbert.ops.linear_activation(x, torch.zeros(4, 8, dtype=torch.float16), None, 'gelu',"
        " backend='triton')\n"
        "except fastbert.BackendUnavailable as err:\n"
        "    print('raised', err)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tensors are on cpu and TRITON_INTERPRET is not set" in out.stdout
    assert "raised" in out.stdout


def _layer(x, qkv_w, qkv_b, out_w, out_b, ln_w, ln_b, cu_seqlens):
    q, k, v = ops.qkv_projection(x, qkv_w, qkv_b, 2, backend="triton")
    context = ops.attention(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=5, backend="triton")
    return ops.linear_residual_layernorm(context.flatten(1), out_w, out_b, x, ln_w, ln_b, 1e-12, backend="triton")


def test_torch_compile_fullgraph_over_triton_ops():
    dtype = torch.float16
    args = (rand(8, 64, dtype=dtype), rand(192, 64, dtype=dtype, scale=0.1), rand(192, dtype=dtype),
            rand(64, 64, dtype=dtype, scale=0.1), rand(64, dtype=dtype), rand(64, dtype=dtype).abs() + 0.5,
            rand(64, dtype=dtype), torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE))
    eager = _layer(*args)
    compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_fp16_dots_run_unmodified_in_the_interpreter():
    """The interpreter widens only bf16 `tl.dot` operands (its bf16 dot is wrong); fp16 tests therefore run the
    dot the GPU runs."""
    from fastbert.kernels import common

    assert not common.dot_in_fp32(torch.float16)
    assert common.dot_in_fp32(torch.bfloat16) == common.INTERPRETER


def test_every_op_has_a_triton_backward():
    assert backends.available()["triton"] is None
    for op in OPS:
        assert backends._REGISTRY[op]["triton"].has_backward, op


def test_gemm_partial_sums_fit_every_config():
    """The backward epilogue's bias partial sums have one row per MIN_BLOCK_M GEMM rows: every BLOCK_M any config
    (autotuner list, M table, interpreter) can pick is a multiple of it, so the buffer is filled whole whichever
    config ran (stale rows from the autotuner's trial runs would be summed otherwise)."""
    from fastbert.kernels import gemm

    blocks = {c.kwargs["BLOCK_M"] for dtype in (torch.float16, torch.float32) for heavy in (False, True)
              for c in (*gemm.gpu_configs(dtype, heavy), *(gemm.table_config(m, dtype, heavy)
                                                             for m in (1, 100, 5000)))}
    blocks |= {gemm.interpreter_config(m)["BLOCK_M"] for m in (1, 20, 1000)}
    assert all(b % gemm.MIN_BLOCK_M == 0 for b in blocks), blocks


@pytest.mark.interpreter
def test_backward_kernel_ops_opcheck():
    """The backward's own torch ops (fakes against the kernels, schemas) on small inputs."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 48, generator=gen).to(DEVICE)
    grad = torch.randn(9, 48, generator=gen).to(DEVICE)
    weight = torch.randn(48, generator=gen).to(DEVICE)
    for extra, p in ((None, 0.0), (grad.clone(), 0.3)):
        torch.library.opcheck(torch.ops.fastbert.triton_layernorm_rows_backward.default,
                              (x, grad, weight, 1e-5, extra, p, 5, torch.float32))
    linear = torch.randn(48, 16, generator=gen).to(DEVICE)
    inputs = torch.randn(9, 16, generator=gen).to(DEVICE)
    torch.library.opcheck(torch.ops.fastbert.triton_linear_dropout_residual.default,
                          (inputs, linear, weight, x, 0.3, 5))
    for activation, output in (("gelu", None), ("relu", torch.relu(x))):
        torch.library.opcheck(torch.ops.fastbert.triton_linear_activation_grad.default,
                              (inputs, linear, weight, grad, output, activation, True))
