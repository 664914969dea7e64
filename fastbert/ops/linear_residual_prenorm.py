"""Linear + bias + residual add, returning the sum and its LayerNorm (the end of a pre-LN sublayer, ModernBERT's):

    summed = dropout(x @ W^T + b) + residual        (the new residual stream)
    normed = LayerNorm(summed)             (the next sublayer's input: mlp_norm, the next attn_norm, final_norm)

``normed`` is the LayerNorm of ``summed`` as returned (after its rounding to the dtype), so the two outputs agree
exactly as an unfused model's would. LayerNorm statistics in fp32; ``ln_bias`` None: no shift (``norm_bias=False``).
Shapes: x [..., K], weight [N, K], bias [N] | None, residual [..., N], ln_weight [N], ln_bias [N] | None
-> (summed, normed), both [..., N] in x's dtype. Dropout: ``dropout_p``, mask from ``dropout_seed``
(`fastbert.ops.dropout`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.ops.backward import compute_dtype, layer_norm_grads, linear_grads
from fastbert.ops.dropout import dropout
from fastbert.ops.layernorm import layer_norm_fp32
from fastbert.ops.linear_residual_layernorm import check_linear_residual
from fastbert.ops.spec import OpCost, OpSpec, declare


def linear_residual_prenorm_reference(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0,
                                      dropout_seed=0):
    """Eager definition: Linear, dropout, + residual, then LayerNorm of that sum; returns (summed, normed)."""
    summed = dropout(F.linear(x, weight, bias), dropout_p, dropout_seed) + residual
    return summed, layer_norm_fp32(summed, ln_weight, ln_bias, eps)


def _check(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0) -> None:
    check_linear_residual("linear_residual_prenorm", x, weight, bias, residual, ln_weight, ln_bias, dropout_p,
                          dropout_seed)


def _fake(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0):
    shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


def linear_residual_prenorm_cost(tokens: int, in_features: int, out_features: int, dtype_bytes: int) -> OpCost:
    """x [T, K] @ W^T + b + residual [T, N], and its LayerNorm. Bytes: x, W, b, residual, LN weight and bias, the
    two outputs."""
    flops = 2 * tokens * in_features * out_features + 10 * tokens * out_features
    moved = (tokens * in_features + in_features * out_features + 3 * out_features
             + 3 * tokens * out_features) * dtype_bytes
    return OpCost(float(flops), float(moved))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, dropout_seed = inputs
    ctx.eps, ctx.dropout_p, ctx.dropout_seed = eps, dropout_p, dropout_seed
    ctx.residual_dtype = residual.dtype
    ctx.save_for_backward(x, weight, bias, ln_weight, ln_bias, output[0])  # summed: the LayerNorm's input


def _backward(ctx, grad_summed, grad_normed):
    """summed's gradient is its own plus the LayerNorm's (from the saved summed, fp32 statistics); it is the
    residual's upstream gradient, and through the dropout mask (regenerated from its seed) the linear layer's."""
    x, weight, bias, ln_weight, ln_bias, summed = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad_through_norm, grad_ln_weight, grad_ln_bias = layer_norm_grads(grad_normed, summed, ln_weight, ln_bias,
                                                                       ctx.eps, (any(needs[:4]), needs[4], needs[5]))
    grad_x = grad_weight = grad_bias = grad_residual = None
    if any(needs[:4]):
        compute = compute_dtype(summed.dtype)
        grad_total = grad_summed.to(compute) + grad_through_norm.to(compute)
        grad_linear = dropout(grad_total, ctx.dropout_p, ctx.dropout_seed)  # the forward's mask, regenerated
        grad_x, grad_weight, grad_bias = linear_grads(grad_linear, x, weight, bias, needs[:3])
        grad_residual = grad_total.to(ctx.residual_dtype) if needs[3] else None
    return grad_x, grad_weight, grad_bias, grad_residual, grad_ln_weight, grad_ln_bias, None, None, None


SPEC = declare(OpSpec(
    name="linear_residual_prenorm",
    cost=linear_residual_prenorm_cost,
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor residual, Tensor ln_weight, Tensor? ln_bias, float eps, "
           "float dropout_p=0.0, int dropout_seed=0) -> (Tensor, Tensor)",
    fake=_fake,
    check=_check,
    eager=linear_residual_prenorm_reference,
    reference=linear_residual_prenorm_reference,
    setup_context=_setup_context,
    backward=_backward,
))


def linear_residual_prenorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor | None,
    eps: float,
    *,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    backend: str | None = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed, normed): summed = dropout(x @ weight.T + bias) + residual, normed = LayerNorm(summed) -> two
    [..., N]."""
    _check(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, dropout_seed)
    return backends.dispatch("linear_residual_prenorm", backend, x, weight, bias, residual, ln_weight, ln_bias, eps,
                             dropout_p, dropout_seed)
