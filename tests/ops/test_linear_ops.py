"""The three GEMM ops of the triton backend (qkv_projection, linear_activation, linear_residual_layernorm)
against fp64 references, with plain PyTorch in the same dtype as the error yardstick (the checks are
`tools.op_checks`', shared with benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from tests.helpers import DEVICE, DTYPE_IDS, assert_accurate, rand
from tools.op_checks import (
    check_linear_activation,
    check_linear_residual_layernorm,
    check_qkv_projection,
)

ALL_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16, torch.float32)]
# (rows, hidden, heads): few rows at BERT widths, odd row counts included
SHAPES = [(1, 1024, 16), (7, 768, 12), (130, 384, 6)]
SHAPE_IDS = [f"rows{r}-h{h}" for r, h, _ in SHAPES]


# ---------------------------------------------------------------------------------- cheap subset (CI, unmarked)
def test_linear_activation_fp16_gelu_strided():
    check_linear_activation(7, 384, torch.float16, "gelu", strided=True)


def test_qkv_projection_fp16():
    check_qkv_projection(7, 384, 6, torch.float16, strided=False)


def test_linear_residual_layernorm_fp16():
    check_linear_residual_layernorm(7, 384, torch.float16, strided=False)


def test_linear_gelu_tanh_bf16_strided():
    check_linear_activation(7, 384, torch.bfloat16, "gelu_tanh", strided=True)


# ------------------------------------------------------------------------------------ full grid (interpreter)
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,heads", SHAPES, ids=SHAPE_IDS)
def test_linear_gelu(rows, hidden, heads, dtype):
    check_linear_activation(rows, hidden, dtype, "gelu", strided=rows == 7)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu"])
def test_linear_other_activations(dtype, activation):
    check_linear_activation(7, 384, dtype, activation, strided=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,heads", SHAPES, ids=SHAPE_IDS)
def test_qkv_projection(rows, hidden, heads, dtype):
    check_qkv_projection(rows, hidden, heads, dtype, strided=rows == 7)


@pytest.mark.interpreter
def test_qkv_projection_batched_input():
    check_qkv_projection(12, 384, 6, torch.bfloat16, strided=False, leading=(3, 4))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,heads", SHAPES, ids=SHAPE_IDS)
def test_linear_residual_layernorm(rows, hidden, heads, dtype):
    check_linear_residual_layernorm(rows, hidden, dtype, strided=rows == 7)


@pytest.mark.interpreter
def test_linear_residual_layernorm_without_bias():
    check_linear_residual_layernorm(7, 384, torch.bfloat16, strided=True, with_bias=False)


def test_linear_residual_layernorm_without_ln_bias_fp16():
    check_linear_residual_layernorm(7, 130, torch.float16, strided=True, with_ln_bias=False, inner=383)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,inner", [(1, 7, 130), (130, 383, 7), (7, 768, 1152)],
                         ids=["rows1-n7-k130", "rows130-n383-k7", "rows7-n768-k1152"])
def test_linear_residual_layernorm_without_ln_bias(rows, hidden, inner, dtype):
    check_linear_residual_layernorm(rows, hidden, dtype, strided=rows == 7, with_ln_bias=False, inner=inner)


@pytest.mark.interpreter
def test_linear_activation_no_bias_3d_input():
    x = rand(2, 5, 384, dtype=torch.float16)
    weight = rand(96, 384, dtype=torch.float16, scale=0.05)
    fast = ops.linear_activation(x, weight, None, "relu", backend="triton")
    reference = ops.linear_activation(x.double(), weight.double(), None, "relu", backend="eager")
    assert_accurate(fast, ops.linear_activation(x, weight, None, "relu", backend="eager"), reference, "3-d relu")


def test_empty_rows_give_empty_output():
    x = torch.empty(0, 384, dtype=torch.float16, device=DEVICE)
    weight = rand(96, 384, dtype=torch.float16)
    assert ops.linear_activation(x, weight, None, "gelu", backend="triton").shape == (0, 96)
