"""Linear + bias + dropout + residual add, and the LayerNorm of that sum: (summed, LN(summed)), a pre-LN sublayer's
end.

Two kernels, as linear_residual_layernorm: the shared GEMM (`gemm.py`) adds bias, drops out (Philox at each
element's flat index, before the residual) and adds the residual in its epilogue, storing the sum (fp32, one rounding
to the output dtype: the new residual stream), then the shared row kernel
(`linear_residual_layernorm.layernorm_rows`) reads that stored sum and writes its LayerNorm (fp32 statistics) to a
second buffer, so normed is exactly LN(summed) as returned.
Shapes: x [..., K], weight [N, K], bias [N] | None, residual [..., N], ln_weight [N], ln_bias [N] | None (no
shift) -> (summed, normed), both [..., N] contiguous. Any strides for 2-D x and residual. fp16, bf16, fp32.
N up to 65536 (a row must fit one block); with dropout, fewer than 2**31 elements per output.

Backward: summed is an output, saved as it is (no GEMM to recompute). One row kernel
(`linear_residual_layernorm.layernorm_rows_backward`) adds summed's own gradient to the LayerNorm's (statistics
recomputed in fp32 from summed): the residual's gradient; through the regenerated dropout mask, the linear
output's; and the fp32 column sums (two-stage) of the LayerNorm's dW/dB and the linear bias's gradient. dL/dx and
dL/dW are plain matmuls (cuBLAS via torch).
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

from fastbert.ops.linear_residual_prenorm import SPEC, linear_residual_prenorm_reference

from . import gemm
from .common import dropout_reason

# The same two kernels as linear_residual_layernorm, so the same limits: its check.
from .linear_residual_layernorm import (
    layernorm_rows,
    layernorm_rows_backward_op,
    linear_layernorm_input_grads,
    supports,
)

__all__ = ["backward", "linear_residual_prenorm", "linear_residual_prenorm_reference", "setup_context", "supports"]


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
            ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
            dropout_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    reason = dropout_reason(dropout_p, residual.numel())
    if reason:
        raise ValueError(f"fastbert triton linear_residual_prenorm: {reason}")
    summed = gemm.linear(x, weight, bias, residual=residual, dropout_p=dropout_p, dropout_seed=dropout_seed)
    normed = torch.empty_like(summed)
    width = weight.shape[0]
    layernorm_rows(summed.view(-1, width), normed.view(-1, width), ln_weight, ln_bias, eps)
    return summed, normed


# ------------------------------------------------------------------------------------------------------ autograd
def setup_context(ctx: FunctionCtx, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, dropout_seed = inputs
    ctx.eps, ctx.dropout_p, ctx.dropout_seed = eps, dropout_p, dropout_seed
    ctx.has_ln_bias = ln_bias is not None
    ctx.residual_shape = residual.shape
    ctx.save_for_backward(x, weight, bias, ln_weight, output[0])  # summed: the LayerNorm's input
    ctx.set_materialize_grads(False)  # an unused output's gradient comes as None, not a zero tensor to read


def backward(ctx: FunctionCtx, grad_summed: torch.Tensor | None, grad_normed: torch.Tensor | None) -> tuple:
    """`layernorm_rows_backward` on the saved sum with summed's own gradient added, then the matmuls. The vendor
    backend's prenorm op takes this formula too (its dropout_p is always 0)."""
    x, weight, bias, ln_weight, summed = ctx.saved_tensors
    width = weight.shape[0]
    if grad_normed is None:  # only summed was used (rare: normed feeds the next sublayer)
        grad_normed = torch.zeros_like(summed)
    grad_total, grad_dropped, sums = layernorm_rows_backward_op(
        summed.view(-1, width), gemm.as_rows(grad_normed), ln_weight, ctx.eps,
        None if grad_summed is None else gemm.as_rows(grad_summed), ctx.dropout_p, ctx.dropout_seed, summed.dtype)
    grad_linear = grad_dropped if ctx.dropout_p > 0 else grad_total
    return linear_layernorm_input_grads(ctx, grad_linear, grad_total, sums, x, weight, bias, ctx.residual_shape,
                                        ln_weight.dtype)


# torch.ops.fastbert.triton_linear_residual_prenorm: schema and fake from the op's spec, the backward above.
_op = SPEC.define("triton_", _launch, setup_context=setup_context, backward=backward)


def linear_residual_prenorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                            eps: float, dropout_p: float = 0.0,
                            dropout_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(dropout(x @ weight.T + bias) + residual, its LayerNorm), each [..., N] (the triton backend's
    `fastbert.ops.linear_residual_prenorm`)."""
    return torch.ops.fastbert.triton_linear_residual_prenorm(x, weight, bias, residual, ln_weight, ln_bias,
                                                             float(eps), float(dropout_p), int(dropout_seed))
