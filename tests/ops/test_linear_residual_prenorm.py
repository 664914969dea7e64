"""linear_residual_prenorm ((x W^T + b + residual, its LayerNorm): a pre-LN sublayer's residual add and the next
norm, ModernBERT's) on every backend: the forward against fp64 references with plain PyTorch in the same dtype as
the error yardstick (triton's checks are `tools.op_checks`', shared with benchmarks/gpu_check.py); the backward
against the eager op's autograd and by gradcheck of the spec's formula, the triton backward's own kernels; dropout
fused into the triton GEMM (keep rate, scale, gradients with the forward's mask); opcheck of the torch ops; the
argument checks and the fake. On CPU the triton kernels run in the Triton interpreter: a cheap subset is unmarked,
the rest `interpreter`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastbert import backends, ops
from tests.helpers import (
    ALL_DTYPES,
    CPP_DTYPES,
    CPP_WIDTHS,
    DEVICE,
    assert_accurate,
    assert_accurate_fp64,
    backend_op,
    check_triton_keep_rate,
    rand,
    strided_rows,
    triton_call,
)
from tests.ops.helpers import grad_tests, layernorm_op_tests, triton_grad_tests
from tools.op_checks import check_linear_residual_prenorm

OP = "linear_residual_prenorm"
# (rows, hidden N, in_features K)
SHAPES = [(1, 7, 130), (7, 383, 130), (130, 768, 1152)]
SHAPE_IDS = [f"rows{r}-n{n}-k{k}" for r, n, k in SHAPES]


# ------------------------------------------------------------------------------------------------- forward
def test_triton_fp16_without_ln_bias():
    check_linear_residual_prenorm(7, 130, 383, torch.float16, strided=False, with_ln_bias=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,inner", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("ln_bias", [False, True], ids=["no-ln-bias", "ln-bias"])
def test_triton(rows, hidden, inner, dtype, ln_bias):
    check_linear_residual_prenorm(rows, hidden, inner, dtype, strided=rows == 7, with_bias=not ln_bias,
                                  with_ln_bias=ln_bias)


def test_triton_empty_rows_give_empty_outputs():
    x = torch.empty(0, 32, dtype=torch.float16, device=DEVICE)
    weight = rand(20, 32, dtype=torch.float16)
    summed, normed = ops.linear_residual_prenorm(x, weight, None, torch.empty(0, 20, dtype=torch.float16,
                                                                               device=DEVICE),
                                                 torch.ones(20, dtype=torch.float16, device=DEVICE), None, 1e-5,
                                                 backend="triton")
    assert summed.shape == normed.shape == (0, 20)


def test_triton_supports_refuses_a_width_past_the_kernel():
    x = rand(3, 8, dtype=torch.float16)
    wide = torch.zeros(65537, 8, dtype=torch.float16, device=DEVICE)
    assert "exceeds" in backends.why_not(OP, "triton", x, wide, None,
                                         torch.zeros(3, 65537, dtype=torch.float16, device=DEVICE),
                                         wide[:, 0], None, 1e-5)


@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("rows", (1, 7, 130))
@pytest.mark.parametrize("width", CPP_WIDTHS + (768,))
def test_cpp(width, rows, dtype):
    """(x W^T + b + residual, its LayerNorm); K = width + 3; normed is the LayerNorm of summed as returned."""
    gen = torch.Generator().manual_seed(width + rows)
    x = strided_rows(rows, width + 3, dtype, gen)
    w = (torch.randn(width, width + 3, generator=gen) / math.sqrt(width + 3)).to(dtype)
    b = torch.randn(width, generator=gen).to(dtype)
    residual = strided_rows(rows, width, dtype, gen) * 2
    ln_w, ln_b = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype), torch.randn(width, generator=gen).to(dtype)
    for bias, ln_bias in ((b, ln_b), (None, None), (b, None)):
        args = (x, w, bias, residual, ln_w, ln_bias, 1e-5)
        summed, normed = ops.linear_residual_prenorm(*args, backend="cpp")
        plain = ops.linear_residual_prenorm_reference(*args)
        ref = ops.linear_residual_prenorm_reference(*(None if a is None else a.double() for a in args[:-1]), 1e-5)
        what = f"prenorm bias={bias is not None} ln_bias={ln_bias is not None}"
        assert_accurate_fp64(summed, plain[0], ref[0], f"{what} summed")
        assert_accurate_fp64(normed, plain[1], ref[1], f"{what} normed")
        again = F.layer_norm(summed.double(), (width,), ln_w.double(), None if ln_bias is None else ln_bias.double(),
                             1e-5)
        assert_accurate_fp64(normed, again.to(dtype), again, f"{what} normed vs LayerNorm(summed)")


def _cpp_opcheck_cases():
    torch.manual_seed(0)
    yield (torch.randn(2, 3, 8), torch.randn(9, 8), None, torch.randn(2, 3, 9), torch.randn(9), None, 1e-5)
    yield (torch.randn(5, 8), torch.randn(9, 8), torch.randn(9), torch.randn(5, 9), torch.randn(9), torch.randn(9),
           1e-12)


@pytest.mark.parametrize("case", list(enumerate(_cpp_opcheck_cases())), ids=lambda c: f"case{c[0]}")
def test_cpp_opcheck_forward(case):
    torch.library.opcheck(backend_op("cpp", "linear_residual_prenorm").default, case[1])


def test_triton_opcheck_forward():
    x, weight = rand(5, 16, dtype=torch.float16), rand(14, 16, dtype=torch.float16)
    bias = rand(14, dtype=torch.float16)
    residual, ln_weight = rand(5, 14, dtype=torch.float16), rand(14, dtype=torch.float16)
    for ln_bias in (None, bias):
        torch.library.opcheck(backend_op("triton", "linear_residual_prenorm").default,
                              (x, weight, None, residual, ln_weight, ln_bias, 1e-5))


def test_cpp_op_rejects_bad_shapes():
    op = backend_op("cpp", "linear_residual_prenorm")
    with pytest.raises(RuntimeError, match=r"residual must be \[3, 5\]"):
        op(torch.randn(3, 8), torch.randn(5, 8), None, torch.randn(3, 4), torch.randn(5), None, 1e-5)
    with pytest.raises(RuntimeError, match=r"ln_bias must be \[5\]"):
        op(torch.randn(3, 8), torch.randn(5, 8), None, torch.randn(3, 5), torch.randn(5), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be Float like x"):
        op(torch.randn(3, 8), torch.randn(5, 8).bfloat16(), None, torch.randn(3, 5), torch.randn(5), None, 1e-5)


def test_checks_name_the_bad_argument():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"residual must be \(3, 5\)"):
        ops.linear_residual_prenorm(x, torch.randn(5, 8), None, torch.randn(3, 4), torch.ones(5), None, 1e-5)
    with pytest.raises(ValueError, match=r"ln_weight must be \[5\]"):
        ops.linear_residual_prenorm(x, torch.randn(5, 8), None, torch.randn(3, 5), torch.ones(4), None, 1e-5)
    with pytest.raises(ValueError, match=r"ln_bias must be \[5\]"):
        ops.linear_residual_prenorm(x, torch.randn(5, 8), None, torch.randn(3, 5), torch.ones(5), torch.ones(6), 1e-5)


def test_fake_gives_the_eager_shapes():
    x, weight, residual = torch.randn(2, 3, 8), torch.randn(10, 8), torch.randn(2, 3, 10)
    prenorm = ops.SPECS[OP]
    meta = [t.to("meta") for t in (x, weight, residual)]
    fake = prenorm.fake(meta[0], meta[1], None, meta[2], meta[1][:, 0], None, 1e-5)
    eager = prenorm.eager(x, weight, None, residual, weight[:, 0], None, 1e-5)
    assert [f.shape for f in fake] == [e.shape for e in eager] == [(2, 3, 10)] * 2


def test_layer_norm_fp32_without_bias_is_the_unshifted_layernorm():
    x = torch.randn(4, 9, dtype=torch.bfloat16)
    weight = torch.rand(9, dtype=torch.bfloat16) + 0.5
    expected = F.layer_norm(x.double(), (9,), weight.double(), None, 1e-5)
    assert_accurate(ops.layernorm.layer_norm_fp32(x, weight, None, 1e-5), F.layer_norm(x, (9,), weight, None, 1e-5),
                    expected, "bf16 LayerNorm without bias")


# ------------------------------------------------------------------------------------------------ backward
TestGrads = grad_tests(OP)
TestTritonGrads = triton_grad_tests(OP, "fastbert::triton_layernorm_rows_backward")
TestLayerNormOp = layernorm_op_tests(OP)  # dW/dB over many rows, and dropout


# ------------------------------------------------------------------------------------------------- dropout
def test_triton_backward_uses_the_forward_mask_identity_linear():
    """W = I, residual 0: summed = mask / (1 - p) * x and d(sum summed)/dx = mask / (1 - p), elementwise; any
    other mask in the backward puts nonzeros where the forward dropped."""
    rows, width, p = 64, 48, 0.5
    x = torch.randn(rows, width, device=DEVICE).requires_grad_()
    eye, zeros, ones = torch.eye(width, device=DEVICE), torch.zeros(rows, width, device=DEVICE), torch.ones(width)
    summed, _ = triton_call(OP, (x, eye, None, zeros, ones.to(DEVICE), None, 1e-5), p, 77)
    kept = summed != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    torch.testing.assert_close(summed[kept], x.detach()[kept] * 2.0, rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(summed.sum(), x)
    assert torch.equal(grad != 0, kept)
    assert torch.equal(grad[kept], torch.full_like(grad[kept], 2.0))


@pytest.mark.interpreter
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_keep_rate_and_scaling(p):
    check_triton_keep_rate(OP, p)
