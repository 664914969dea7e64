"""linear_residual_layernorm (LayerNorm(x W^T + b + residual), BERT's post-LN sublayer end) on every backend: the
forward against fp64 references with plain PyTorch in the same dtype as the error yardstick (triton's checks are
`tools.op_checks`', shared with benchmarks/gpu_check.py); the backward against the eager op's autograd (fp32
within 1e-5 of an fp64 reference, fp16/bf16 by fastbert.numerics' rule) and by gradcheck of the spec's formula,
the triton backward's own kernels (two-stage fp32 dW/dB, the sum recomputed by the forward's GEMM); dropout fused
into the triton GEMM (gradients against an fp64 reference built with the forward's mask); opcheck of the torch ops.
On CPU the triton kernels run in the Triton interpreter: a cheap subset is unmarked, the rest `interpreter`."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from fastbert.ops.spec import SPECS
from tests.helpers import (
    ALL_DTYPES,
    CPP_DTYPES,
    CPP_WIDTHS,
    IN_FEATURES,
    OUT_FEATURES,
    OpsSeen,
    as_fp64,
    assert_accurate,
    assert_accurate_fp64,
    backend_op,
    check_grads,
    cpp_linear_inputs,
    for_backend,
    forward_mask,
    ln_op_args,
    masked_reference,
    op_args,
    rate_tolerance,
    run_grads,
    triton_call,
    upcast,
)
from tests.ops.helpers import BERT_SHAPE_IDS, BERT_SHAPES, grad_tests, layernorm_op_tests, triton_grad_tests
from tools.op_checks import check_linear_residual_layernorm

OP = "linear_residual_layernorm"


# ------------------------------------------------------------------------------------------------- forward
def test_triton_fp16():
    check_linear_residual_layernorm(7, 384, torch.float16, strided=False)


def test_triton_without_ln_bias_fp16():
    check_linear_residual_layernorm(7, 130, torch.float16, strided=True, with_ln_bias=False, inner=383)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,heads", BERT_SHAPES, ids=BERT_SHAPE_IDS)
def test_triton(rows, hidden, heads, dtype):
    check_linear_residual_layernorm(rows, hidden, dtype, strided=rows == 7)


@pytest.mark.interpreter
def test_triton_without_bias():
    check_linear_residual_layernorm(7, 384, torch.bfloat16, strided=True, with_bias=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,inner", [(1, 7, 130), (130, 383, 7), (7, 768, 1152)],
                         ids=["rows1-n7-k130", "rows130-n383-k7", "rows7-n768-k1152"])
def test_triton_without_ln_bias(rows, hidden, inner, dtype):
    check_linear_residual_layernorm(rows, hidden, dtype, strided=rows == 7, with_ln_bias=False, inner=inner)


@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("width", CPP_WIDTHS)
def test_cpp_with_and_without_biases(width, dtype):
    """Through the dispatch, K = N = width, a strided 3-D x."""
    t = cpp_linear_inputs(width, dtype)
    for bias, ln_bias in ((t["b"], t["ln_b"]), (None, t["ln_b"]), (t["b"], None)):
        args = (t["x"], t["w"], bias, t["residual"], t["ln_w"], ln_bias, 1e-5)
        fast = ops.linear_residual_layernorm(*args, backend="cpp")
        plain = ops.linear_residual_layernorm_reference(*args)
        ref = ops.linear_residual_layernorm_reference(*as_fp64(*args[:-1]), 1e-5)
        assert_accurate_fp64(fast, plain, ref, f"linear-res-ln ln_bias={ln_bias is not None}")


def _cpp_opcheck_cases():
    torch.manual_seed(0)
    yield (torch.randn(5, 8), torch.randn(9, 8), None, torch.randn(5, 9), torch.randn(9), torch.randn(9), 1e-5)
    yield (torch.randn(5, 8), torch.randn(9, 8), torch.randn(9), torch.randn(5, 9), torch.randn(9), None, 1e-5)


@pytest.mark.parametrize("case", list(enumerate(_cpp_opcheck_cases())), ids=lambda c: f"case{c[0]}")
def test_cpp_opcheck_forward(case):
    torch.library.opcheck(backend_op("cpp", "linear_residual_layernorm").default, case[1])


def test_cpp_op_rejects_bad_shapes():
    op = backend_op("cpp", "linear_residual_layernorm")
    with pytest.raises(RuntimeError, match=r"residual must be \[3, 5\]"):
        op(torch.randn(3, 8), torch.randn(5, 8), None, torch.randn(3, 4), torch.randn(5), torch.randn(5), 1e-5)


def test_checks_name_the_bad_argument():
    x, weight, residual, ones = torch.randn(3, 8), torch.randn(5, 8), torch.randn(3, 5), torch.ones(5)
    with pytest.raises(ValueError, match=r"residual must be \(3, 5\)"):
        ops.linear_residual_layernorm(x, weight, None, torch.randn(3, 4), ones, None, 1e-5)
    with pytest.raises(ValueError, match=r": bias must be \[5\], got \(4,\)"):
        ops.linear_residual_layernorm(x, weight, torch.ones(4), residual, ones, None, 1e-5)
    with pytest.raises(ValueError, match=r"ln_weight must be \[5\], got \(4,\)"):
        ops.linear_residual_layernorm(x, weight, None, residual, torch.ones(4), None, 1e-5)
    with pytest.raises(ValueError, match=r"ln_bias must be \[5\], got \(6,\)"):
        ops.linear_residual_layernorm(x, weight, None, residual, ones, torch.ones(6), 1e-5)


# ------------------------------------------------------------------------------------------------ backward
TestGrads = grad_tests(OP)
TestTritonGrads = triton_grad_tests(OP, "fastbert::triton_layernorm_rows_backward")
TestLayerNormOp = layernorm_op_tests(OP)  # dW/dB over many rows, and dropout


def test_cpp_batched_leading_shape_and_only_some_inputs_requiring_grad():
    """x [B, S, K] (the model's padded form), the weight frozen: only the inputs that require grad get one."""
    x, weight, bias, residual, ln_weight, ln_bias, eps = op_args(OP, 12, torch.float32)
    x = x.detach().view(3, 4, IN_FEATURES).requires_grad_()
    residual = residual.detach().view(3, 4, OUT_FEATURES)
    weight.requires_grad_(False)
    check_grads(OP, (x, weight, bias, residual, ln_weight, ln_bias, eps), "cpp")


@pytest.mark.interpreter
def test_triton_batched_leading_shape_and_frozen_weight():
    """x [B, S, K], the weight frozen, the gradient broadcast from a sum (stride-0 rows)."""
    x, weight, bias, residual, ln_weight, ln_bias, eps = ln_op_args(OP, 12, 48, torch.float32)
    x = x.detach().view(3, 4, -1).requires_grad_()
    residual = residual.detach().view(3, 4, -1).requires_grad_()
    weight.requires_grad_(False)
    check_grads(OP, (x, weight, bias, residual, ln_weight, ln_bias, eps), "triton")
    out = triton_call(OP, (x, weight, bias, residual, ln_weight, ln_bias, eps))
    (grad,) = torch.autograd.grad(out.sum(), x)  # dL/dout expanded from a scalar: strides (0, 0, 0)
    reference = torch.autograd.grad(ops.linear_residual_layernorm(x, weight, bias, residual, ln_weight, ln_bias, eps,
                                                                  backend="eager").sum(), x)[0]
    torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_triton_torch_op_backward_recomputes_the_sum(p):
    """linear_residual_layernorm's torch op has its own backward (the sum recomputed by the forward's GEMM); the
    backend's function under autograd runs prenorm's op instead (no recomputation). Both give the eager op's
    gradients (p = 0) or the fp64 reference's with the forward's mask (p > 0)."""
    args = ln_op_args(OP, 7, 48, torch.float32)
    torch_op = backend_op("triton", "linear_residual_layernorm")
    if p == 0:
        check_grads(OP, args, "triton", call=lambda name: SPECS[OP].eager if name == "eager" else torch_op)
    else:
        keep = forward_mask(OP, args, p, 99)
        fast = run_grads(lambda *a: torch_op(*a, p, 99), args)
        reference = run_grads(masked_reference(OP, args, keep, p), upcast(args))
        for index, (f, r) in enumerate(zip(fast, reference, strict=True)):
            assert_accurate(f, f, r, what=f"{OP} torch op dropout grad {index}")
    for function, recomputes in ((lambda *a: torch_op(*a, p, 99), True),
                                 (lambda *a: triton_call(OP, a, p, 99), False)):
        out = function(*args)
        with OpsSeen() as seen:
            out.sum().backward()
        assert ("fastbert::triton_linear_dropout_residual" in seen.names) == recomputes, sorted(seen.names)
        assert "fastbert::triton_layernorm_rows_backward" in seen.names


# ------------------------------------------------------------------------------------------------- dropout
@pytest.mark.interpreter
def test_triton_keep_rate_through_its_gemm_mask():
    """linear_residual_layernorm's dropout acts inside, before the LayerNorm: its output equals the LayerNorm of
    (prenorm's dropped sum), i.e. the same GEMM mask, whose keep rate prenorm's test measures."""
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in ln_op_args(OP, 130, 384, torch.float32))
    with torch.no_grad():
        out = triton_call(OP, args, 0.4, 9)
        summed, normed = triton_call("linear_residual_prenorm", args, 0.4, 9)
    torch.testing.assert_close(out, normed, rtol=0, atol=0)
    assert abs((summed != args[3]).float().mean().item() - 0.6) < rate_tolerance(0.4, summed.numel())


# ------------------------------------------------------------------------------------------------- opcheck
def test_triton_opcheck_with_grad_without_optionals():
    args = for_backend("triton", op_args(OP, 5, torch.float32, "none"))
    torch.library.opcheck(backend_op("triton", "linear_residual_layernorm").default, args)
