"""The three GEMM ops of the triton backend (qkv_projection, linear_activation, linear_residual_layernorm)
against fp64 references, with plain PyTorch in the same dtype as the error yardstick."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from tests.kernels.numerics import DEVICE, DTYPE_IDS, assert_accurate, rand

ALL_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16, torch.float32)]
# (rows, hidden, heads): few rows at BERT widths, odd row counts included
SHAPES = [(1, 1024, 16), (7, 768, 12), (130, 384, 6)]
SHAPE_IDS = [f"rows{r}-h{h}" for r, h, _ in SHAPES]


def _maybe_strided(rows: int, cols: int, dtype, strided: bool, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols], as a column slice of a wider tensor (non-contiguous rows) when strided."""
    if not strided:
        return rand(rows, cols, dtype=dtype, scale=scale)
    return rand(rows, cols + 9, dtype=dtype, scale=scale)[:, 5:5 + cols]


def _weight(out_features: int, in_features: int, dtype, transposed: bool) -> torch.Tensor:
    """[out, in] weight; transposed: a .t() view of an [in, out] tensor (column-major)."""
    if transposed:
        return rand(in_features, out_features, dtype=dtype, scale=0.05).t()
    return rand(out_features, in_features, dtype=dtype, scale=0.05)


def check_linear_activation(rows, hidden, dtype, activation, strided):
    inner = 4 * hidden
    x = _maybe_strided(rows, hidden, dtype, strided)
    weight, bias = _weight(inner, hidden, dtype, strided), rand(inner, dtype=dtype, scale=0.5)
    fast = ops.linear_activation(x, weight, bias, activation, backend="triton")
    plain = ops.linear_activation(x, weight, bias, activation, backend="eager")
    reference = ops.linear_activation(x.double(), weight.double(), bias.double(), activation, backend="eager")
    assert fast.is_contiguous()
    assert_accurate(fast, plain, reference, f"linear_activation {activation}")


def check_qkv_projection(rows, hidden, heads, dtype, strided, leading=()):
    x = _maybe_strided(rows, hidden, dtype, strided)
    if leading:
        x = x.reshape(*leading, hidden)
    weight, bias = _weight(3 * hidden, hidden, dtype, strided), rand(3 * hidden, dtype=dtype, scale=0.5)
    fast = ops.qkv_projection(x, weight, bias, heads, backend="triton")
    plain = ops.qkv_projection(x, weight, bias, heads, backend="eager")
    reference = ops.qkv_projection(x.double(), weight.double(), bias.double(), heads, backend="eager")
    base = fast[0].untyped_storage().data_ptr()
    for name, f, p, r in zip("qkv", fast, plain, reference, strict=True):
        assert f.shape == (*x.shape[:-1], heads, hidden // heads)
        assert f.untyped_storage().data_ptr() == base, "q, k, v must be views of one buffer (no copies)"
        assert_accurate(f, p, r, f"qkv_projection {name}")


def check_linear_residual_layernorm(rows, hidden, dtype, strided, with_bias=True):
    inner = 4 * hidden
    x = _maybe_strided(rows, inner, dtype, strided)
    weight = _weight(hidden, inner, dtype, strided)
    bias = rand(hidden, dtype=dtype, scale=0.5) if with_bias else None
    residual = _maybe_strided(rows, hidden, dtype, strided, scale=2.0)
    ln_weight, ln_bias = rand(hidden, dtype=dtype).abs() + 0.5, rand(hidden, dtype=dtype, scale=0.2)
    args = (x, weight, bias, residual, ln_weight, ln_bias, 1e-12)
    fast = ops.linear_residual_layernorm(*args, backend="triton")
    plain = ops.linear_residual_layernorm(*args, backend="eager")
    reference = ops.linear_residual_layernorm(*(a.double() if isinstance(a, torch.Tensor) else a for a in args),
                                              backend="eager")
    assert_accurate(fast, plain, reference, "linear_residual_layernorm")


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
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
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
