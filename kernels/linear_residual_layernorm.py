"""Linear + bias + dropout + residual add + LayerNorm: LN(dropout(x @ W^T + b) + residual), BERT's post-LN sublayer
output.

Two kernels: the shared GEMM (`gemm.py`) adds bias, drops out (Philox at each element's flat index, before the
residual) and adds the residual in its epilogue (fp32, one rounding to the output dtype, as PyTorch rounds the sum),
then a row kernel normalises that buffer in place with fp32 statistics (`layernorm_rows`, which
linear_residual_prenorm shares: it writes the LayerNorm beside the sum instead).
(Fusing the LayerNorm into the GEMM epilogue would need one program to own whole 768/1024-wide rows, which
starves the GEMM of parallelism at small token counts.)
Shapes: x [..., K], weight [N, K], bias [N] | None, residual [..., N], ln_weight [N], ln_bias [N] | None (no
shift) -> [..., N].
Any strides for 2-D x and residual. fp16, bf16, fp32. N up to 65536 (a row must fit one block); with dropout,
fewer than 2**31 output elements.

Backward: the LayerNorm's input s = dropout(x @ W^T + b) + residual is recomputed by the same GEMM (bit for bit the
forward's, the mask regenerated from the seed; the op returns only LN(s), so s is not kept), then one row kernel
(`layernorm_rows_backward`, shared with linear_residual_prenorm) computes dL/ds (the residual's gradient) from the
recomputed fp32 statistics, dL/ds through the dropout mask (the linear layer's output gradient), and per-program
fp32 column sums for the LayerNorm's dW/dB and the linear bias's gradient (two-stage: `common.column_sum` adds
the partial rows). dL/dx and dL/dW are plain matmuls (cuBLAS via torch).
That backward is the torch op's (``torch.ops.fastbert.triton_linear_residual_layernorm``). The backend's function
(`linear_residual_layernorm`), under autograd, runs linear_residual_prenorm's torch op instead and returns its
LayerNorm: the same kernels and the same output bit for bit (the LayerNorm written beside the sum instead of over
it), and a backward that reads the saved sum instead of recomputing the GEMM (a third GEMM beside the backward's
two; the price is the [M, N] sum kept until the backward, as eager PyTorch keeps its LayerNorm's input).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastbert.ops.linear_residual_layernorm import SPEC, linear_residual_layernorm_reference

from . import gemm
from .common import (
    MAX_WIDTH,
    backward_row_warps,
    backward_rows_per_program,
    cast_rtne,
    cdiv,
    column_sum,
    define_kernel_op,
    device_reason,
    dropout_args,
    dropout_keep,
    dropout_reason,
    first_reason,
    float_reason,
    launch,
    layernorm_backward_tile,
    layernorm_tile,
    reduction_programs,
    row_block,
    row_tile,
    row_warps,
    rows_per_program,
)

__all__ = ["layernorm_rows", "layernorm_rows_backward", "linear_residual_layernorm",
           "linear_residual_layernorm_reference", "supports"]


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
    offs_r, offs_n, col_mask, mask = row_tile(rows, N, ROWS, BLOCK_N)
    x = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    y = layernorm_tile(x, mask, offs_n, col_mask, weight_ptr, bias_ptr, N, eps, HAS_BIAS)
    tl.store(out_ptr + offs_r[:, None] * stride_out + offs_n[None, :], cast_rtne(y, out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _layernorm_rows_backward_kernel(
    x_ptr,  # [rows, N] the LayerNorm's input, row stride stride_x (unit column stride)
    grad_ptr,  # [rows, N] dL/d(LayerNorm output), strides (stride_gr, stride_gc)
    extra_grad_ptr,  # [rows, N] dL/dx from x's other uses, added (ignored unless HAS_EXTRA_GRAD), strides
    #                  (stride_er, stride_ec)
    weight_ptr,  # [N] LayerNorm scale
    grad_x_ptr,  # [rows, N] contiguous: dL/dx
    grad_dropped_ptr,  # [rows, N] contiguous: dL/dx through the dropout mask and scale (ignored unless DROPOUT)
    partial_ptr,  # [programs, 3, N] fp32 contiguous: this program's column sums of grad * x_hat (LayerNorm weight),
    #               grad (LayerNorm bias) and of the gradient through the mask (the linear layer's bias)
    rows, N,
    stride_x, stride_gr, stride_gc, stride_er, stride_ec,
    eps,
    seed, dropout_p, keep_scale,  # dropout (ignored unless DROPOUT): Philox seed, probability, 1 / (1 - p)
    HAS_EXTRA_GRAD: tl.constexpr,
    DROPOUT: tl.constexpr,
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # power of two >= N: one block holds a whole row
):
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    col_mask = offs_n < N
    weight = tl.load(weight_ptr + offs_n, mask=col_mask, other=0.0).to(tl.float32)
    sum_weight = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sum_bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    sum_dropped = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Row tiles pid, pid + programs, ...: each program's fp32 column sums cover a strided share of the rows.
    for tile in range(pid, tl.cdiv(rows, ROWS), programs):
        offs_r = tile * ROWS + tl.arange(0, ROWS)
        mask = (offs_r < rows)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + offs_r[:, None] * stride_gr + offs_n[None, :] * stride_gc, mask=mask,
                       other=0.0).to(tl.float32)
        grad_x, x_hat = layernorm_backward_tile(x, grad, mask, weight, N, eps)
        if HAS_EXTRA_GRAD:
            grad_x += tl.load(extra_grad_ptr + offs_r[:, None] * stride_er + offs_n[None, :] * stride_ec, mask=mask,
                              other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + offs_r[:, None] * N + offs_n[None, :], cast_rtne(grad_x, grad_x_ptr.dtype.element_ty),
                 mask=mask)
        sum_weight += tl.sum(grad * x_hat, axis=0)
        sum_bias += tl.sum(grad, axis=0)
        if DROPOUT:
            keep = dropout_keep(seed, offs_r[:, None] * N + offs_n[None, :], dropout_p)
            grad_x = tl.where(keep & mask, grad_x * keep_scale, 0.0)
            tl.store(grad_dropped_ptr + offs_r[:, None] * N + offs_n[None, :],
                     cast_rtne(grad_x, grad_dropped_ptr.dtype.element_ty), mask=mask)
        sum_dropped += tl.sum(grad_x, axis=0)
    part = partial_ptr + pid * 3 * N + offs_n
    tl.store(part, sum_weight, mask=col_mask)
    tl.store(part + N, sum_bias, mask=col_mask)
    tl.store(part + 2 * N, sum_dropped, mask=col_mask)


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
    launch(_layernorm_rows_kernel, (cdiv(rows, per_program),),
        x, out, weight, bias, rows, width, x.stride(0), out.stride(0), eps, HAS_BIAS=has_bias, ROWS=per_program,
        BLOCK_N=row_block(width), num_warps=row_warps(width, per_program))
    return out


def layernorm_rows_backward(x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, eps: float,
                            extra_grad: torch.Tensor | None = None, dropout_p: float = 0.0, dropout_seed: int = 0,
                            grad_x_dtype: torch.dtype | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Backward of `layernorm_rows` over x [rows, N] (unit column stride; the LayerNorm's input as the forward
    read it) given grad = dL/d(output) [rows, N] (any strides), plus ``extra_grad`` [rows, N] (x's gradient from
    its other uses) when given. Returns (grad_x [rows, N] in ``grad_x_dtype`` (default x's): dL/dx;
    grad_dropped: dL/dx through the dropout mask of (p, seed) times 1/(1-p), in x's dtype, or None without
    dropout; sums [3, N] fp32: the LayerNorm weight's and bias's gradients and the column sums of the gradient
    through the mask (= of grad_x without dropout), each reduced in fp32 in two stages)."""
    rows, width = x.shape
    if width > 1 and x.stride(1) != 1:
        raise ValueError(f"layernorm_rows_backward: x must have unit column stride, got strides {x.stride()}")
    if width > MAX_WIDTH:
        raise ValueError(f"layernorm_rows_backward: width {width} exceeds {MAX_WIDTH}")
    dropout = dropout_p > 0
    grad_x = torch.empty((rows, width), dtype=grad_x_dtype or x.dtype, device=x.device)
    grad_dropped = torch.empty((rows, width), dtype=x.dtype, device=x.device) if dropout else None
    per_program = backward_rows_per_program(width)
    programs = reduction_programs(cdiv(rows, per_program), x.device)
    partial = torch.empty((programs, 3 * width), dtype=torch.float32, device=x.device)
    if rows == 0:
        return grad_x, grad_dropped, torch.zeros((3, width), dtype=torch.float32, device=x.device)
    extra = extra_grad if extra_grad is not None else grad
    launch(_layernorm_rows_backward_kernel, (programs,),
        x, grad, extra, weight.contiguous(), grad_x, grad_dropped if dropout else grad_x, partial, rows, width,
        x.stride(0), grad.stride(0), grad.stride(1), extra.stride(0), extra.stride(1), eps,
        *dropout_args(dropout_p, dropout_seed),
        HAS_EXTRA_GRAD=extra_grad is not None, DROPOUT=dropout, ROWS=per_program, BLOCK_N=row_block(width),
        num_warps=backward_row_warps(width, per_program))
    return grad_x, grad_dropped, column_sum(partial, torch.float32).view(3, width)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
            ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
            dropout_seed: int = 0) -> torch.Tensor:
    reason = dropout_reason(dropout_p, residual.numel())
    if reason:
        raise ValueError(f"fastbert triton linear_residual_layernorm: {reason}")
    out = gemm.linear(x, weight, bias, residual=residual, dropout_p=dropout_p, dropout_seed=dropout_seed)
    rows = out.view(-1, weight.shape[0])
    layernorm_rows(rows, rows, ln_weight, ln_bias, eps)
    return out


# ------------------------------------------------------------------------------------------------------ autograd
def _layernorm_rows_backward_impl(x, grad, weight, eps, extra_grad, dropout_p, dropout_seed, grad_x_dtype):
    grad_x, grad_dropped, sums = layernorm_rows_backward(x, grad, weight, eps, extra_grad, dropout_p, dropout_seed,
                                                         grad_x_dtype)
    return grad_x, grad_dropped if grad_dropped is not None else x.new_empty((0, x.shape[1])), sums


def _layernorm_rows_backward_fake(x, grad, weight, eps, extra_grad, dropout_p, dropout_seed, grad_x_dtype):
    rows, width = x.shape
    return (x.new_empty((rows, width), dtype=grad_x_dtype), x.new_empty((rows if dropout_p > 0 else 0, width)),
            x.new_empty((3, width), dtype=torch.float32))


# torch.ops.fastbert.triton_layernorm_rows_backward: `layernorm_rows_backward` as a torch op (grad_dropped [0, N]
# without dropout), for the backward formulas here and in linear_residual_prenorm.
layernorm_rows_backward_op = define_kernel_op(
    "triton_layernorm_rows_backward",
    "(Tensor x, Tensor grad, Tensor weight, float eps, Tensor? extra_grad, float dropout_p, int dropout_seed, "
    "ScalarType grad_x_dtype) -> (Tensor, Tensor, Tensor)",
    _layernorm_rows_backward_impl, _layernorm_rows_backward_fake)


def _linear_dropout_residual_impl(x, weight, bias, residual, dropout_p, dropout_seed):
    return gemm.linear(x, weight, bias, residual=residual, dropout_p=dropout_p, dropout_seed=dropout_seed)


def _linear_dropout_residual_fake(x, weight, bias, residual, dropout_p, dropout_seed):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# torch.ops.fastbert.triton_linear_dropout_residual: dropout(x @ W^T + b) + residual by the forward's GEMM, the
# backward's recomputation of the LayerNorm's input.
linear_dropout_residual_op = define_kernel_op(
    "triton_linear_dropout_residual",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor residual, float dropout_p, int dropout_seed) -> Tensor",
    _linear_dropout_residual_impl, _linear_dropout_residual_fake)


def linear_input_grads(grad_linear: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       needs: tuple[bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dL/dx, dL/dW) of x @ W^T given its output's gradient [rows, N] in x's dtype: plain matmuls (cuBLAS)."""
    grad_x = (grad_linear @ weight).view(x.shape) if needs[0] else None
    grad_weight = grad_linear.t() @ gemm.as_rows(x) if needs[1] else None
    return grad_x, grad_weight


def linear_layernorm_input_grads(ctx, grad_linear: torch.Tensor, grad_total: torch.Tensor, sums: torch.Tensor,
                                 x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 residual_shape: torch.Size, ln_dtype: torch.dtype) -> tuple:
    """The nine input gradients of linear_residual_layernorm / _prenorm (eps and dropout get None) from
    `layernorm_rows_backward`'s outputs: grad_linear [rows, N] the linear layer's output gradient, grad_total
    [rows, N] the sum's (the residual's), sums [3, N] its column sums."""
    needs = ctx.needs_input_grad
    grad_x, grad_weight = linear_input_grads(grad_linear, x, weight, needs[:2])
    grad_bias = sums[2].to(bias.dtype) if needs[2] and bias is not None else None
    grad_residual = grad_total.view(residual_shape) if needs[3] else None
    grad_ln_weight = sums[0].to(ln_dtype) if needs[4] else None
    grad_ln_bias = sums[1].to(ln_dtype) if needs[5] and ctx.has_ln_bias else None
    return grad_x, grad_weight, grad_bias, grad_residual, grad_ln_weight, grad_ln_bias, None, None, None


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, dropout_seed = inputs
    ctx.eps, ctx.dropout_p, ctx.dropout_seed = eps, dropout_p, dropout_seed
    ctx.has_ln_bias = ln_bias is not None
    ctx.save_for_backward(x, weight, bias, residual, ln_weight)


def _backward(ctx, grad):
    """s = dropout(x @ W^T + b) + residual recomputed by the forward's GEMM, then `layernorm_rows_backward` and the
    matmuls (module docstring)."""
    x, weight, bias, residual, ln_weight = ctx.saved_tensors
    width = weight.shape[0]
    dropout = ctx.dropout_p > 0
    summed = linear_dropout_residual_op(x, weight, bias, residual, ctx.dropout_p, ctx.dropout_seed)
    grad_summed, grad_dropped, sums = layernorm_rows_backward_op(
        summed.view(-1, width), gemm.as_rows(grad), ln_weight, ctx.eps, None, ctx.dropout_p, ctx.dropout_seed,
        residual.dtype)
    grad_linear = grad_dropped if dropout else grad_summed.to(x.dtype)
    return linear_layernorm_input_grads(ctx, grad_linear, grad_summed, sums, x, weight, bias, residual.shape,
                                        ln_weight.dtype)


# torch.ops.fastbert.triton_linear_residual_layernorm: schema and fake from the op's spec, the backward above.
_op = SPEC.define("triton_", _launch, setup_context=_setup_context, backward=_backward)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
             ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
             dropout_seed: int = 0) -> str | None:
    tensors = [x, weight, bias, residual, ln_weight, ln_bias]
    return first_reason(
        device_reason(tensors),
        float_reason(tensors),
        "K = 0 (empty reduction)" if weight.shape[1] == 0 else None,
        f"width {weight.shape[0]} exceeds {MAX_WIDTH}" if weight.shape[0] > MAX_WIDTH else None,
        dropout_reason(dropout_p, residual.numel()),
    )


def linear_residual_layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                              eps: float, dropout_p: float = 0.0, dropout_seed: int = 0) -> torch.Tensor:
    """LayerNorm(dropout(x @ weight.T + bias) + residual) -> [..., N] (the triton backend's
    `fastbert.ops.linear_residual_layernorm`). Under autograd it runs as linear_residual_prenorm (module
    docstring: the same output, and a backward without the GEMM's recomputation)."""
    args = (x, weight, bias, residual, ln_weight, ln_bias, float(eps), float(dropout_p), int(dropout_seed))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args[:6]):
        return torch.ops.fastbert.triton_linear_residual_prenorm(*args)[1]
    return torch.ops.fastbert.triton_linear_residual_layernorm(*args)
