"""Linear + bias + residual add + LayerNorm (BERT's post-LN sublayer output): LN(x @ W^T + b + residual).

Shapes: x [..., K], weight [N, K], bias [N] | None, residual [..., N], LayerNorm weight [N] and bias [N] | None
(None: no shift) -> [..., N]. LayerNorm statistics in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.ops.backward import layer_norm_grads, linear_grads
from fastbert.ops.layernorm import layer_norm_fp32
from fastbert.ops.spec import OpCost, OpSpec, declare


def linear_residual_layernorm_reference(x, weight, bias, residual, ln_weight, ln_bias, eps):
    return layer_norm_fp32(F.linear(x, weight, bias) + residual, ln_weight, ln_bias, eps)


def _check(x, weight, bias, residual, ln_weight, ln_bias, eps) -> None:
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear_residual_layernorm: weight must be [N, {x.shape[-1]}], got {tuple(weight.shape)}")
    expected = (*x.shape[:-1], weight.shape[0])
    if tuple(residual.shape) != expected:
        raise ValueError(f"linear_residual_layernorm: residual must be {expected}, got {tuple(residual.shape)}")


def _fake(x, weight, bias, residual, ln_weight, ln_bias, eps):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_residual_layernorm_cost(tokens: int, in_features: int, out_features: int, dtype_bytes: int) -> OpCost:
    """LayerNorm(x [T, K] @ W^T + b + residual [T, N]). Bytes: x, W, b, residual, LN weight and bias, output."""
    flops = 2 * tokens * in_features * out_features + 10 * tokens * out_features
    moved = (tokens * in_features + in_features * out_features + 3 * out_features
             + 2 * tokens * out_features) * dtype_bytes
    return OpCost(float(flops), float(moved))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, residual, ln_weight, ln_bias, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, weight, bias, residual, ln_weight, ln_bias)


def _backward(ctx, grad):
    """The LayerNorm's input x @ W^T + b + residual is recomputed (one GEMM), its gradient (fp32 statistics and
    weight/bias sums) is the residual's and the linear layer's upstream gradient."""
    x, weight, bias, residual, ln_weight, ln_bias = ctx.saved_tensors
    needs = ctx.needs_input_grad
    summed = F.linear(x, weight, bias) + residual
    grad_summed, grad_ln_weight, grad_ln_bias = layer_norm_grads(grad, summed, ln_weight, ln_bias, ctx.eps,
                                                                 (any(needs[:4]), needs[4], needs[5]))
    grad_x, grad_weight, grad_bias = linear_grads(grad_summed, x, weight, bias, needs[:3]) if any(needs[:3]) else \
        (None, None, None)
    grad_residual = grad_summed.to(residual.dtype) if needs[3] else None
    return grad_x, grad_weight, grad_bias, grad_residual, grad_ln_weight, grad_ln_bias, None


SPEC = declare(OpSpec(
    name="linear_residual_layernorm",
    cost=linear_residual_layernorm_cost,
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor residual, Tensor ln_weight, Tensor? ln_bias, float eps) "
           "-> Tensor",
    fake=_fake,
    check=_check,
    eager=linear_residual_layernorm_reference,
    reference=linear_residual_layernorm_reference,
    setup_context=_setup_context,
    backward=_backward,
))


def linear_residual_layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor | None,
    eps: float,
    *,
    backend: str | None = "auto",
) -> torch.Tensor:
    """LayerNorm(x @ weight.T + bias + residual) -> [..., N]; ``ln_bias`` None: LayerNorm without shift."""
    _check(x, weight, bias, residual, ln_weight, ln_bias, eps)
    return backends.dispatch("linear_residual_layernorm", backend, x, weight, bias, residual, ln_weight, ln_bias, eps)
