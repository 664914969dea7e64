"""The triton linear_glu kernel (two accumulators, GeGLU epilogue) and linear_residual_prenorm (GEMM + residual,
then the LayerNorm of the stored sum) against fp64 references, plain PyTorch in the same dtype as the error
yardstick (the checks are `tools.op_checks`', shared with benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from tests.helpers import DEVICE, DTYPE_IDS, rand
from tools.op_checks import check_linear_glu, check_linear_residual_prenorm

ALL_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16, torch.float32)]
# (rows, hidden, intermediate): odd sizes everywhere, and ModernBERT-base's 768 -> 1152
GLU_SHAPES = [(1, 7, 7), (7, 130, 383), (130, 768, 1152)]
GLU_IDS = [f"rows{r}-h{h}-i{i}" for r, h, i in GLU_SHAPES]
# (rows, hidden N, in_features K)
PRENORM_SHAPES = [(1, 7, 130), (7, 383, 130), (130, 768, 1152)]
PRENORM_IDS = [f"rows{r}-n{n}-k{k}" for r, n, k in PRENORM_SHAPES]


# ---------------------------------------------------------------------------------- cheap subset (CI, unmarked)
def test_linear_glu_fp16_gelu_strided_no_bias():
    check_linear_glu(7, 130, 383, torch.float16, "gelu", strided=True, with_bias=False)


def test_linear_residual_prenorm_fp16_without_ln_bias():
    check_linear_residual_prenorm(7, 130, 383, torch.float16, strided=False, with_ln_bias=False)


def test_triton_ops_pass_opcheck():
    x, weight, bias = rand(5, 16, dtype=torch.float16), rand(14, 16, dtype=torch.float16), rand(14, dtype=torch.float16)
    torch.library.opcheck(torch.ops.fastbert.triton_linear_glu.default, (x, weight, bias, "gelu"))
    torch.library.opcheck(torch.ops.fastbert.triton_linear_glu.default, (x, weight, None, "silu"))
    residual, ln_weight = rand(5, 14, dtype=torch.float16), rand(14, dtype=torch.float16)
    for ln_bias in (None, bias):
        torch.library.opcheck(torch.ops.fastbert.triton_linear_residual_prenorm.default,
                              (x, weight, None, residual, ln_weight, ln_bias, 1e-5))


def test_empty_rows_give_empty_outputs():
    x = torch.empty(0, 32, dtype=torch.float16, device=DEVICE)
    weight = rand(20, 32, dtype=torch.float16)
    assert ops.linear_glu(x, weight, None, "gelu", backend="triton").shape == (0, 10)
    summed, normed = ops.linear_residual_prenorm(x, weight, None, torch.empty(0, 20, dtype=torch.float16,
                                                                               device=DEVICE),
                                                 torch.ones(20, dtype=torch.float16, device=DEVICE), None, 1e-5,
                                                 backend="triton")
    assert summed.shape == normed.shape == (0, 20)


def test_supports_refuses_what_the_kernels_cannot_run():
    from fastbert import backends

    x, weight = rand(3, 8, dtype=torch.float16), rand(10, 8, dtype=torch.float16)
    assert "mixed dtypes" in backends.why_not("linear_glu", "triton", x, weight.float(), None, "gelu")
    assert "K = 0" in backends.why_not("linear_glu", "triton", x[:, :0], weight[:, :0], None, "gelu")
    assert backends.why_not("linear_glu", "triton", x, weight, None, "silu") is None
    wide = torch.zeros(65537, 8, dtype=torch.float16, device=DEVICE)
    assert "exceeds" in backends.why_not("linear_residual_prenorm", "triton", x, wide, None,
                                         torch.zeros(3, 65537, dtype=torch.float16, device=DEVICE),
                                         wide[:, 0], None, 1e-5)


# ------------------------------------------------------------------------------------ full grid (interpreter)
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,inner", GLU_SHAPES, ids=GLU_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_linear_glu_gelu(rows, hidden, inner, dtype, with_bias):
    check_linear_glu(rows, hidden, inner, dtype, "gelu", strided=rows == 7, with_bias=with_bias)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu"])
def test_linear_glu_other_activations(dtype, activation):
    check_linear_glu(7, 130, 383, dtype, activation, strided=True)


@pytest.mark.interpreter
def test_linear_glu_batched_input():
    check_linear_glu(12, 130, 70, torch.bfloat16, "gelu", strided=False, with_bias=False, leading=(3, 4))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,inner", PRENORM_SHAPES, ids=PRENORM_IDS)
@pytest.mark.parametrize("ln_bias", [False, True], ids=["no-ln-bias", "ln-bias"])
def test_linear_residual_prenorm(rows, hidden, inner, dtype, ln_bias):
    check_linear_residual_prenorm(rows, hidden, inner, dtype, strided=rows == 7, with_bias=not ln_bias,
                                  with_ln_bias=ln_bias)
