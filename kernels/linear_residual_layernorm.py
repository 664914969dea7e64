"""Linear + bias + residual add + LayerNorm: LN(x @ W^T + b + residual), BERT's post-LN sublayer output.

Two kernels: the shared GEMM (`_gemm.py`) adds bias and residual in its epilogue (fp32, one rounding to the
output dtype, as PyTorch rounds the sum), then a row kernel normalises that buffer in place with fp32 statistics
(`layernorm_rows`, which linear_residual_prenorm shares: it writes the LayerNorm beside the sum instead).
(Fusing the LayerNorm into the GEMM epilogue would need one program to own whole 768/1024-wide rows, which
starves the GEMM of parallelism at small token counts.)
Shapes: x [..., K], weight [N, K], bias [N] | None, residual [..., N], ln_weight [N], ln_bias [N] | None (no
shift) -> [..., N].
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

__all__ = ["layernorm_rows", "linear_residual_layernorm", "linear_residual_layernorm_reference", "supports"]

MAX_WIDTH = 65536


@triton.jit
def _layernorm_rows_kernel(
    x_ptr,  # [rows, N] input, row stride stride_x (unit column stride)
    out_ptr,  # [rows, N] output, row stride stride_out (unit column stride); may be x_ptr (in place)
    weight_ptr,  # [N] LayerNorm scale
    bias_ptr,  # [N] LayerNorm shift (ignored unless HAS_BIAS)
    rows, N, stride_x, stride_out,
    eps,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # power of two >= N: one block holds a whole row
):
    pid = tl.program_id(0).to(tl.int64)
    offs_r = pid * ROWS + tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    col_mask = offs_n < N
    mask = (offs_r < rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    y = layernorm_tile(x, mask, offs_n, col_mask, weight_ptr, bias_ptr, N, eps, HAS_BIAS)
    tl.store(out_ptr + offs_r[:, None] * stride_out + offs_n[None, :], cast_rtne(y, out_ptr.dtype.element_ty),
             mask=mask)


def layernorm_rows(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of a 2-D tensor x into out (same shape and dtype; may be x itself: in place),
    both with unit column stride; bias None: no shift. Returns out."""
    rows, width = x.shape
    if rows == 0:
        return out
    for name, t in (("x", x), ("out", out)):
        if width > 1 and t.stride(1) != 1:
            raise ValueError(f"layernorm_rows: {name} must have unit column stride, got strides {t.stride()}")
    if width > MAX_WIDTH:
        raise ValueError(f"layernorm: width {width} exceeds {MAX_WIDTH}")
    weight = weight.contiguous()  # read with unit stride; no copy when already so
    has_bias = bias is not None
    bias = bias.contiguous() if has_bias else weight  # a placeholder the kernel never reads without HAS_BIAS
    per_program = rows_per_program(width)
    _layernorm_rows_kernel[(triton.cdiv(rows, per_program),)](
        x, out, weight, bias, rows, width, x.stride(0), out.stride(0), eps, HAS_BIAS=has_bias, ROWS=per_program,
        BLOCK_N=row_block(width), num_warps=row_warps(width, per_program))
    return out


def supports(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0) -> str | None:
    tensors = [x, weight, bias, residual, ln_weight, ln_bias]
    return first_reason(
        device_reason(tensors),
        float_reason(tensors),
        "K = 0 (empty reduction)" if weight.shape[1] == 0 else None,
        f"width {weight.shape[0]} exceeds {MAX_WIDTH}" if weight.shape[0] > MAX_WIDTH else None,
        "dropout_p > 0: this kernel has no dropout yet" if dropout_p > 0 else None,
    )


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
            ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
            dropout_seed: int = 0) -> torch.Tensor:
    if dropout_p > 0:
        raise ValueError("fastbert triton linear_residual_layernorm: no dropout in this kernel yet (dropout_p > 0)")
    out = _gemm.linear(x, weight, bias, residual=residual)
    rows = out.view(-1, weight.shape[0])
    layernorm_rows(rows, rows, ln_weight, ln_bias, eps)
    return out


# torch.ops.fastbert.triton_linear_residual_layernorm: schema and fake from the op's spec.
_op = SPEC.define("triton_", _launch)


def linear_residual_layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                              eps: float, dropout_p: float = 0.0, dropout_seed: int = 0) -> torch.Tensor:
    """LayerNorm(x @ weight.T + bias + residual) -> [..., N] (the triton backend's
    `fastbert.ops.linear_residual_layernorm`)."""
    return torch.ops.fastbert.triton_linear_residual_layernorm(x, weight, bias, residual, ln_weight, ln_bias,
                                                               float(eps), float(dropout_p), int(dropout_seed))
