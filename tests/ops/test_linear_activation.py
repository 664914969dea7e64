"""linear_activation (act(x W^T + b)) on every backend: the forward against fp64 references with plain PyTorch in the
same dtype as the error yardstick (triton's checks are `tools.op_checks`', shared with benchmarks/gpu_check.py), the
backward against the eager op's autograd and by gradcheck of the spec's formula, opcheck of the torch ops, and the
activation names of transformers. On CPU the triton kernels run in the Triton interpreter: a cheap subset is
unmarked, the rest `interpreter`."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from fastbert import ops
from fastbert.ops.linear_activation import HF_ACTIVATIONS
from tests.helpers import (
    ALL_DTYPES,
    CPP_DTYPES,
    CPP_WIDTHS,
    DEVICE,
    HALF_DTYPES,
    as_fp64,
    assert_accurate,
    assert_accurate_fp64,
    backend_op,
    check_grads,
    cpp_linear_inputs,
    for_backend,
    ln_op_args,
    op_args,
    rand,
)
from tests.ops.helpers import BERT_SHAPE_IDS, BERT_SHAPES, activation_grad_tests, grad_tests, triton_grad_tests
from tools.op_checks import check_linear_activation

OP = "linear_activation"


# ------------------------------------------------------------------------------------------------- forward
def test_triton_fp16_gelu_strided():
    check_linear_activation(7, 384, torch.float16, "gelu", strided=True)


def test_triton_gelu_tanh_bf16_strided():
    check_linear_activation(7, 384, torch.bfloat16, "gelu_tanh", strided=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,heads", BERT_SHAPES, ids=BERT_SHAPE_IDS)
def test_triton_gelu(rows, hidden, heads, dtype):
    check_linear_activation(rows, hidden, dtype, "gelu", strided=rows == 7)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu"])
def test_triton_other_activations(dtype, activation):
    check_linear_activation(7, 384, dtype, activation, strided=True)


@pytest.mark.interpreter
def test_triton_no_bias_3d_input():
    x = rand(2, 5, 384, dtype=torch.float16)
    weight = rand(96, 384, dtype=torch.float16, scale=0.05)
    fast = ops.linear_activation(x, weight, None, "relu", backend="triton")
    reference = ops.linear_activation(x.double(), weight.double(), None, "relu", backend="eager")
    assert_accurate(fast, ops.linear_activation(x, weight, None, "relu", backend="eager"), reference, "3-d relu")


def test_triton_empty_rows_give_empty_output():
    x = torch.empty(0, 384, dtype=torch.float16, device=DEVICE)
    weight = rand(96, 384, dtype=torch.float16)
    assert ops.linear_activation(x, weight, None, "gelu", backend="triton").shape == (0, 96)


@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("width", CPP_WIDTHS)
def test_cpp_every_activation_with_and_without_bias(width, dtype):
    """Through the dispatch, K = N = width, a strided 3-D x."""
    t = cpp_linear_inputs(width, dtype)
    for activation in ops.ACTIVATIONS:
        for bias in (t["b"], None):
            fast = ops.linear_activation(t["x"], t["w"], bias, activation, backend="cpp")
            plain = ops.linear_activation_reference(t["x"], t["w"], bias, activation)
            ref = ops.linear_activation_reference(*as_fp64(t["x"], t["w"], bias), activation)
            assert_accurate_fp64(fast, plain, ref, f"linear-{activation}")


def test_cpp_opcheck_forward():
    torch.manual_seed(0)
    args = (torch.randn(2, 3, 8), torch.randn(9, 8), torch.randn(9), "relu")
    torch.library.opcheck(backend_op("cpp", "linear_activation").default, args)


def test_cpp_op_rejects_bad_shapes():
    op = backend_op("cpp", "linear_activation")
    with pytest.raises(RuntimeError, match=r"weight must be \[N, 8\]"):
        op(torch.randn(3, 8), torch.randn(5, 7), None, "gelu")
    with pytest.raises(RuntimeError, match="activation must be one of"):
        op(torch.randn(3, 8), torch.randn(5, 8), None, "swish")


# ------------------------------------------------------------------------------------- transformers' names
@pytest.mark.parametrize("name", sorted(HF_ACTIVATIONS))
def test_activation_from_hf_computes_transformers_activation(name):
    x = torch.linspace(-9, 9, 2001, dtype=torch.float64)
    ours = ops.apply_activation(x, ops.activation_from_hf(name))
    torch.testing.assert_close(ours, ACT2FN[name](x), rtol=1e-6, atol=1e-6)


def test_activation_from_hf_refuses_other_functions():
    for name in ("quick_gelu", "gelu_10", "tanh", "mish"):
        with pytest.raises(ValueError, match="not supported"):
            ops.activation_from_hf(name)


# ------------------------------------------------------------------------------------------------ backward
TestGrads = grad_tests(OP)
TestTritonGrads = triton_grad_tests(OP, "fastbert::triton_linear_activation_grad")
TestActivationGrads = activation_grad_tests(OP)


def test_triton_grads_fp32_seven_rows():
    check_grads(OP, for_backend("triton", op_args(OP, 7, torch.float32)), "triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES], ids=["fp32", "fp16", "bf16"])
def test_triton_grads_every_activation(activation, dtype):
    """The backward epilogue's derivative of each activation (relu: from the saved output)."""
    check_grads(OP, ln_op_args(OP, 37, 96, dtype, activation=activation), "triton")
