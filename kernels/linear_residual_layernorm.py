"""Linear + bias + residual add + LayerNorm: LN(x @ W^T + b + residual), BERT's post-LN sublayer output.

Two kernels: the shared GEMM (`_gemm.py`) adds bias and residual in its epilogue (fp32, one rounding to the
output dtype, as PyTorch rounds the sum), then a row kernel normalises that buffer in place with fp32 statistics.
(Fusing the LayerNorm into the GEMM epilogue would need one program to own whole 768/1024-wide rows, which
starves the GEMM of parallelism at small token counts.)
Shapes: x [..., K], weight [N, K], bias [N] | None, residual [..., N], ln_weight/ln_bias [N] -> [..., N].
Any strides for 2-D x and residual. fp16, bf16, fp32. N up to 65536 (a row must fit one block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastbert.ops.linear_residual_layernorm import SPEC, linear_residual_layernorm_reference

from . import _gemm
from ._common import (
    cast_rtne,
    device_reason,
    first_reason,
    float_reason,
    layernorm_tile,
    row_block,
    row_warps,
    rows_per_program,
)

__all__ = ["layernorm_rows_", "linear_residual_layernorm", "linear_residual_layernorm_reference", "supports"]

MAX_WIDTH = 65536


@triton.jit
def _layernorm_rows_kernel(
    x_ptr,  # [rows, N] normalised in place, row stride stride_x (unit column stride)
    weight_ptr,  # [N] LayerNorm scale
    bias_ptr,  # [N] LayerNorm shift
    rows, N, stride_x,
    eps,
    ROWS: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # power of two >= N: one block holds a whole row
):
    pid = tl.program_id(0).to(tl.int64)
    offs_r = pid * ROWS + tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    col_mask = offs_n < N
    mask = (offs_r < rows)[:, None] & col_mask[None, :]
    ptrs = x_ptr + offs_r[:, None] * stride_x + offs_n[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    y = layernorm_tile(x, mask, offs_n, col_mask, weight_ptr, bias_ptr, N, eps)
    tl.store(ptrs, cast_rtne(y, x_ptr.dtype.element_ty), mask=mask)


def layernorm_rows_(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of a 2-D tensor with unit column stride, in place; returns x."""
    rows, width = x.shape
    if rows == 0:
        return x
    if width > 1 and x.stride(1) != 1:
        raise ValueError(f"layernorm_rows_: x must have unit column stride, got strides {x.stride()}")
    weight, bias = weight.contiguous(), bias.contiguous()  # read with unit stride; no copy when already so
    if width > MAX_WIDTH:
        raise ValueError(f"layernorm: width {width} exceeds {MAX_WIDTH}")
    per_program = rows_per_program(width)
    _layernorm_rows_kernel[(triton.cdiv(rows, per_program),)](
        x, weight, bias, rows, width, x.stride(0), eps, ROWS=per_program, BLOCK_N=row_block(width),
        num_warps=row_warps(width, per_program))
    return x


def supports(x, weight, bias, residual, ln_weight, ln_bias, eps) -> str | None:
    tensors = [x, weight, bias, residual, ln_weight, ln_bias]
    return first_reason(
        device_reason(tensors),
        float_reason(tensors),
        "K = 0 (empty reduction)" if weight.shape[1] == 0 else None,
        f"width {weight.shape[0]} exceeds {MAX_WIDTH}" if weight.shape[0] > MAX_WIDTH else None,
    )


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
            ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float) -> torch.Tensor:
    out = _gemm.linear(x, weight, bias, residual=residual)
    layernorm_rows_(out.view(-1, weight.shape[0]), ln_weight, ln_bias, eps)
    return out


# torch.ops.fastbert.triton_linear_residual_layernorm: schema and fake from the op's spec.
_op = SPEC.define("triton_", _launch)


def linear_residual_layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                              eps: float) -> torch.Tensor:
    """LayerNorm(x @ weight.T + bias + residual) -> [..., N] (the triton backend's
    `fastbert.ops.linear_residual_layernorm`)."""
    return torch.ops.fastbert.triton_linear_residual_layernorm(x, weight, bias, residual, ln_weight, ln_bias,
                                                               float(eps))
