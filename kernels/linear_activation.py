"""Linear + bias + activation in one GEMM: act(x @ W^T + b), the activation applied in the GEMM's epilogue.

Activations: "gelu" (exact erf), "gelu_tanh", "relu", "silu". Shapes: x [..., K] (any strides for 2-D x), weight [N, K]
(any strides), bias [N] | None -> [..., N] contiguous. fp16, bf16, fp32 (fp32 without TF32). The kernel is the
shared GEMM in `gemm.py`; this file holds the op's checks, registration and backward.

Backward (Triton + cuBLAS): dL/d(pre-activation) comes from the shared GEMM run again with its backward epilogue
(`gemm.linear_activation_grad`: the pre-activation x @ W^T + b recomputed, the incoming gradient multiplied by the
activation's derivative in fp32, one rounding, and the bias gradient's fp32 column sums in the same pass; no
[M, N] pre-activation kept from the forward). relu needs no GEMM: its derivative is read from the saved output
(relu(y) > 0 iff y > 0) by a row kernel here, which also sums the bias gradient. Then dL/dx = g @ W and
dL/dW = g^T @ x are plain matmuls (cuBLAS via torch) with g in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastbert.ops.linear_activation import ACTIVATIONS, SPEC, linear_activation_reference

from . import gemm
from .common import (
    INTERPRETER,
    cast_rtne,
    cdiv,
    column_sum,
    define_kernel_op,
    device_reason,
    first_reason,
    float_reason,
    launch,
    tile_offsets,
)

__all__ = ["linear_activation", "linear_activation_reference", "supports"]


@triton.jit
def _relu_grad_kernel(
    grad_ptr,  # [rows, N] dL/d(output), strides (stride_gm, stride_gn)
    out_ptr,  # [rows, N] the forward's output relu(y), strides (stride_om, stride_on)
    grad_pre_ptr,  # [rows, N] contiguous: dL/dy = grad where out > 0, else 0
    partial_ptr,  # [cdiv(rows, BLOCK_M), N] fp32 contiguous: this block's column sums of dL/dy (bias gradient)
    rows, N,
    stride_gm, stride_gn,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m, offs_n, n_mask, mask = tile_offsets(rows, N, BLOCK_M, BLOCK_N)
    grad = tl.load(grad_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn, mask=mask, other=0.0)
    out = tl.load(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, mask=mask, other=0.0)
    grad_pre = tl.where(out > 0, grad.to(tl.float32), 0.0)
    tl.store(grad_pre_ptr + offs_m[:, None] * N + offs_n[None, :], cast_rtne(grad_pre, grad_pre_ptr.dtype.element_ty),
             mask=mask)
    tl.store(partial_ptr + tl.program_id(0).to(tl.int64) * N + offs_n, tl.sum(grad_pre, axis=0), mask=n_mask)


def _relu_grad(grad: torch.Tensor, out: torch.Tensor, bias_dtype: torch.dtype | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dL/dy [rows, N] in out's dtype, the bias gradient in ``bias_dtype`` or None when it is None) for out =
    relu(y)."""
    grad, out = gemm.as_rows(grad), gemm.as_rows(out)
    rows, width = out.shape
    grad_pre = torch.empty((rows, width), dtype=out.dtype, device=out.device)
    block_m, block_n = (64, 256) if INTERPRETER else (32, 128)
    partial = torch.empty((cdiv(rows, block_m), width), dtype=torch.float32, device=out.device)
    if rows and width:
        launch(_relu_grad_kernel, (cdiv(rows, block_m), cdiv(width, block_n)),
            grad, out, grad_pre, partial, rows, width, grad.stride(0), grad.stride(1), out.stride(0), out.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    bias_grad = None
    if bias_dtype is not None:
        bias_grad = column_sum(partial, bias_dtype) if rows else torch.zeros(width, dtype=bias_dtype,
                                                                             device=out.device)
    return grad_pre, bias_grad


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    return gemm.linear(x, weight, bias, activation=activation)


# ------------------------------------------------------------------------------------------------------ autograd
def _pre_activation_grad_impl(x, weight, bias, grad, output, activation, bias_grad):
    if output is not None:  # relu: from the saved output
        grad_pre, grad_bias = _relu_grad(grad, output, bias.dtype if bias_grad else None)
    else:
        grad_pre, grad_bias = gemm.linear_activation_grad(x, weight, bias, grad, activation, bias_grad)
    return grad_pre, grad_bias if grad_bias is not None else x.new_empty((0,))


def _pre_activation_grad_fake(x, weight, bias, grad, output, activation, bias_grad):
    width = weight.shape[0]
    return x.new_empty((x.shape[:-1].numel(), width)), bias.new_empty((width,)) if bias_grad else x.new_empty((0,))


# torch.ops.fastbert.triton_linear_activation_grad: (dL/d(pre-activation) [rows, N], the bias gradient or [0]).
pre_activation_grad_op = define_kernel_op(
    "triton_linear_activation_grad",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor grad, Tensor? output, str activation, bool bias_grad) "
    "-> (Tensor, Tensor)",
    _pre_activation_grad_impl, _pre_activation_grad_fake)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    ctx.activation = activation
    # relu's derivative reads from the output (y > 0 iff relu(y) > 0): no GEMM to recompute
    ctx.save_for_backward(x, weight, bias, output if activation == "relu" else None)


def _backward(ctx, grad):
    """dL/d(pre-activation) by a Triton kernel (module docstring), then the matmuls."""
    x, weight, bias, output = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if not any(needs[:3]):
        return None, None, None, None
    want_bias = bias is not None and needs[2]
    grad_pre, grad_bias = pre_activation_grad_op(x, weight, bias, grad, output, ctx.activation, want_bias)
    grad_x = (grad_pre @ weight).view(x.shape) if needs[0] else None
    grad_weight = grad_pre.t() @ gemm.as_rows(x) if needs[1] else None
    return grad_x, grad_weight, grad_bias if want_bias else None, None


# torch.ops.fastbert.triton_linear_activation: schema and fake from the op's spec, the backward above.
_op = SPEC.define("triton_", _launch, setup_context=_setup_context, backward=_backward)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> str | None:
    tensors = [x, weight, bias]
    return first_reason(
        device_reason(tensors),
        float_reason(tensors),
        None if activation in ACTIVATIONS else f"activation {activation!r} not in {ACTIVATIONS}",
        "K = 0 (empty reduction)" if weight.shape[1] == 0 else None,
    )


def linear_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      activation: str) -> torch.Tensor:
    """act(x @ weight.T + bias) -> [..., N] (the triton backend of `fastbert.ops.linear_activation`)."""
    return torch.ops.fastbert.triton_linear_activation(x, weight, bias, activation)
