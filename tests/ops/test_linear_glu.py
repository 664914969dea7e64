"""linear_glu (act(x W_in^T + b_in) * (x W_gate^T + b_gate), ModernBERT's MLP input) on every backend: the forward
against fp64 references with plain PyTorch in the same dtype as the error yardstick (triton's checks are
`tools.op_checks`', shared with benchmarks/gpu_check.py) and against transformers' ModernBertMLP; the backward
against the eager op's autograd and by gradcheck of the spec's formula; opcheck of the torch ops; the argument
checks and the fake. On CPU the triton kernels run in the Triton interpreter: a cheap subset is unmarked, the rest
`interpreter`."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

from fastbert import backends, ops
from fastbert.numerics import assert_accurate
from tests.helpers import (
    ALL_DTYPES,
    CPP_DTYPES,
    DEVICE,
    assert_accurate_fp64,
    backend_op,
    rand,
    strided_rows,
)
from tests.ops.helpers import activation_grad_tests, grad_tests, modernbert_config, randomised
from tools.op_checks import check_linear_glu

OP = "linear_glu"
CPU_BACKENDS = ["eager", "cpp"]
# (rows, hidden, intermediate): odd sizes everywhere, and ModernBERT-base's 768 -> 1152
TRITON_SHAPES = [(1, 7, 7), (7, 130, 383), (130, 768, 1152)]
TRITON_IDS = [f"rows{r}-h{h}-i{i}" for r, h, i in TRITON_SHAPES]
CPP_SIZES = [(7, 7), (130, 383), (383, 130), (768, 1152)]  # (hidden K, intermediate I): odd, and ModernBERT-base


# ------------------------------------------------------------------------------------------------- forward
def test_triton_fp16_gelu_strided_no_bias():
    check_linear_glu(7, 130, 383, torch.float16, "gelu", strided=True, with_bias=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,inner", TRITON_SHAPES, ids=TRITON_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_triton_gelu(rows, hidden, inner, dtype, with_bias):
    check_linear_glu(rows, hidden, inner, dtype, "gelu", strided=rows == 7, with_bias=with_bias)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu"])
def test_triton_other_activations(dtype, activation):
    check_linear_glu(7, 130, 383, dtype, activation, strided=True)


@pytest.mark.interpreter
def test_triton_batched_input():
    check_linear_glu(12, 130, 70, torch.bfloat16, "gelu", strided=False, with_bias=False, leading=(3, 4))


def test_triton_empty_rows_give_empty_output():
    x = torch.empty(0, 32, dtype=torch.float16, device=DEVICE)
    weight = rand(20, 32, dtype=torch.float16)
    assert ops.linear_glu(x, weight, None, "gelu", backend="triton").shape == (0, 10)


def test_triton_supports_refuses_what_the_kernel_cannot_run():
    x, weight = rand(3, 8, dtype=torch.float16), rand(10, 8, dtype=torch.float16)
    assert "mixed dtypes" in backends.why_not(OP, "triton", x, weight.float(), None, "gelu")
    assert "K = 0" in backends.why_not(OP, "triton", x[:, :0], weight[:, :0], None, "gelu")
    assert backends.why_not(OP, "triton", x, weight, None, "silu") is None


@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("hidden,inner", CPP_SIZES, ids=[f"h{h}-i{i}" for h, i in CPP_SIZES])
def test_cpp(hidden, inner, dtype):
    """Every activation, with and without bias, strided 3-D x."""
    gen = torch.Generator().manual_seed(hidden + inner)
    x = strided_rows(2 * 7, hidden, dtype, gen).view(2, 7, hidden)
    w = (torch.randn(2 * inner, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)
    b = torch.randn(2 * inner, generator=gen).to(dtype)
    for activation in ops.ACTIVATIONS:
        for bias in (b, None):
            fast = ops.linear_glu(x, w, bias, activation, backend="cpp")
            plain = ops.linear_glu_reference(x, w, bias, activation)
            ref = ops.linear_glu_reference(x.double(), w.double(), None if bias is None else bias.double(), activation)
            assert fast.shape == (2, 7, inner) and fast.is_contiguous()
            assert_accurate_fp64(fast, plain, ref, f"linear-glu-{activation} bias={bias is not None}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("hidden_activation", ["gelu", "gelu_pytorch_tanh", "silu", "relu"])
@pytest.mark.parametrize("mlp_bias", [False, True], ids=["no-bias", "bias"])
def test_mlp_sublayer_matches_modernbert(backend, hidden_activation, mlp_bias):
    """hidden + Wo(act(Wi_in h) * Wi_gate h) with h = mlp_norm(hidden): transformers' ModernBertMLP and
    LayerNorm(bias=False) against linear_glu + linear_residual_prenorm (fp32, within the 1e-5 rule)."""
    config = modernbert_config(hidden_activation=hidden_activation, mlp_bias=mlp_bias)
    mlp = randomised(ModernBertMLP(config), seed=1)
    mlp_norm = randomised(torch.nn.LayerNorm(130, eps=config.norm_eps, bias=config.norm_bias), seed=2)
    next_norm = randomised(torch.nn.LayerNorm(130, eps=config.norm_eps, bias=config.norm_bias), seed=3)
    hidden = torch.randn(2, 7, 130, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected_sum = hidden + mlp(mlp_norm(hidden))
        expected_next = next_norm(expected_sum)
        activation = ops.activation_from_hf(config.hidden_activation)
        gated = ops.linear_glu(mlp_norm(hidden), mlp.Wi.weight, mlp.Wi.bias, activation, backend=backend)
        summed, next_normed = ops.linear_residual_prenorm(gated, mlp.Wo.weight, mlp.Wo.bias, hidden,
                                                          next_norm.weight, next_norm.bias, config.norm_eps,
                                                          backend=backend)
    assert_accurate(summed, expected_sum, expected_sum.double(), "summed")
    assert_accurate(next_normed, expected_next, expected_next.double(), "next norm")


def test_splits_weight_rows_as_chunk():
    """The first I rows of Wi project the input half, the last I the gate: a gate of zeros gives zeros."""
    x = torch.randn(4, 6)
    weight = torch.cat([torch.randn(5, 6), torch.zeros(5, 6)])
    assert ops.linear_glu(x, weight, None, "gelu", backend="eager").abs().max() == 0
    weight = torch.cat([torch.zeros(5, 6), torch.randn(5, 6)])  # act(0) = 0 for every activation
    for backend in CPU_BACKENDS:
        assert ops.linear_glu(x, weight, None, "silu", backend=backend).abs().max() == 0


def _cpp_opcheck_cases():
    torch.manual_seed(0)
    yield (torch.randn(2, 3, 8), torch.randn(18, 8), torch.randn(18), "gelu")
    yield (torch.randn(5, 8).bfloat16(), torch.randn(14, 8).bfloat16(), None, "silu")


@pytest.mark.parametrize("case", list(enumerate(_cpp_opcheck_cases())), ids=lambda c: f"case{c[0]}")
def test_cpp_opcheck_forward(case):
    torch.library.opcheck(backend_op("cpp", "linear_glu").default, case[1])


def test_triton_opcheck_forward():
    x, weight, bias = rand(5, 16, dtype=torch.float16), rand(14, 16, dtype=torch.float16), rand(14, dtype=torch.float16)
    torch.library.opcheck(backend_op("triton", "linear_glu").default, (x, weight, bias, "gelu"))
    torch.library.opcheck(backend_op("triton", "linear_glu").default, (x, weight, None, "silu"))


def test_cpp_op_rejects_bad_shapes():
    op = backend_op("cpp", "linear_glu")
    with pytest.raises(RuntimeError, match=r"weight must be \[2I, 8\]"):
        op(torch.randn(3, 8), torch.randn(5, 8), None, "gelu")
    with pytest.raises(RuntimeError, match=r"weight must be \[2I, 8\]"):
        op(torch.randn(3, 8), torch.randn(6, 7), None, "gelu")
    with pytest.raises(RuntimeError, match=r"bias must be \[6\]"):
        op(torch.randn(3, 8), torch.randn(6, 8), torch.randn(3), "gelu")
    with pytest.raises(RuntimeError, match="activation must be one of"):
        op(torch.randn(3, 8), torch.randn(6, 8), None, "swish")


def test_checks_name_the_bad_argument():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"weight must be \[2I, 8\]"):
        ops.linear_glu(x, torch.randn(7, 8), None, "gelu")
    with pytest.raises(ValueError, match=r"weight must be \[2I, 8\]"):
        ops.linear_glu(x, torch.randn(6, 9), None, "gelu")
    with pytest.raises(ValueError, match=r"bias must be \[6\]"):
        ops.linear_glu(x, torch.randn(6, 8), torch.randn(3), "gelu")
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        ops.linear_glu(x, torch.randn(6, 8), None, "swish")  # transformers' name: activation_from_hf maps it


def test_fake_gives_the_eager_shape():
    x, weight = torch.randn(2, 3, 8), torch.randn(10, 8)
    glu = ops.SPECS[OP]
    meta = [t.to("meta") for t in (x, weight)]
    assert glu.fake(meta[0], meta[1], None, "gelu").shape == glu.eager(x, weight, None, "gelu").shape == (2, 3, 5)


# ------------------------------------------------------------------------------------------------ backward
TestGrads = grad_tests(OP)
TestActivationGrads = activation_grad_tests(OP)
