"""Linear + gated activation (ModernBERT's MLP input half): act(x @ W_in^T + b_in) * (x @ W_gate^T + b_gate).

``weight`` is ModernBERT's ``Wi`` as stored, [2I, K]: its first I rows project the input half, its last I rows the
gate half (what ``Wi(x).chunk(2, dim=-1)`` splits); ``bias`` [2I] likewise, or None (``mlp_bias=False``).
Activations: `fastbert.ops.linear_activation.ACTIVATIONS` ("gelu" exact erf, "gelu_tanh", "relu", "silu"; GeGLU
with ModernBERT's default "gelu", SwiGLU with "silu").
Shapes: x [..., K], weight [2I, K], bias [2I] | None -> [..., I] in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.ops.backward import activation_grad, compute_dtype, linear_grads
from fastbert.ops.linear_activation import ACTIVATIONS, apply_activation
from fastbert.ops.spec import OpCost, OpSpec, declare


def linear_glu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str) -> torch.Tensor:
    """Eager definition (what ModernBertMLP does before its Wo): one Linear, split in halves, act(input) * gate."""
    projected_input, gate = F.linear(x, weight, bias).chunk(2, dim=-1)
    return apply_activation(projected_input, activation) * gate


def _check(x, weight, bias, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear_glu: unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    if x.dim() < 1:
        raise ValueError("linear_glu: x must be [..., K], got a scalar")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] % 2:
        raise ValueError(f"linear_glu: weight must be [2I, {x.shape[-1]}] (input rows, then gate rows), got "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear_glu: bias must be [{weight.shape[0]}] like weight's rows, got {tuple(bias.shape)}")


def _fake(x, weight, bias, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def linear_glu_cost(tokens: int, in_features: int, out_features: int, dtype_bytes: int) -> OpCost:
    """act(x [T, K] @ W_in^T + b_in) * (x @ W_gate^T + b_gate), ``out_features`` = I (the weight is [2I, K]).
    Bytes: x, W, b, the [T, I] output. FLOPs: the GEMM plus the product."""
    flops = 2 * tokens * in_features * 2 * out_features + tokens * out_features
    moved = (tokens * in_features + 2 * in_features * out_features + 2 * out_features
             + tokens * out_features) * dtype_bytes
    return OpCost(float(flops), float(moved))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx, grad):
    """The projection x @ W^T + b is recomputed (one GEMM); the gradients of its input and gate halves (fp32)
    are the linear layer's upstream gradient."""
    x, weight, bias = ctx.saved_tensors
    compute = compute_dtype(x.dtype)
    grad_projected = glu_grad(grad.to(compute), F.linear(x, weight, bias).to(compute), ctx.activation)
    return (*linear_grads(grad_projected, x, weight, bias, ctx.needs_input_grad[:3]), None)


def glu_grad(grad: torch.Tensor, projected: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/d(projection) [..., 2I] of act(input) * gate, [input | gate] = ``projected``, given dL/d(output) ``grad``
    [..., I] (pass both in fp32)."""
    projected_input, gate = projected.chunk(2, dim=-1)
    grad_input = activation_grad(grad * gate, projected_input, activation)
    grad_gate = grad * apply_activation(projected_input, activation)
    return torch.cat((grad_input, grad_gate), dim=-1)


SPEC = declare(OpSpec(
    name="linear_glu",
    cost=linear_glu_cost,
    schema="(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor",
    fake=_fake,
    check=_check,
    eager=linear_glu_reference,
    reference=linear_glu_reference,
    setup_context=_setup_context,
    backward=_backward,
))


def linear_glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, *,
               backend: str | None = "auto") -> torch.Tensor:
    """act(x @ W_in.T + b_in) * (x @ W_gate.T + b_gate) -> [..., I], with weight [2I, K] = [W_in; W_gate] and
    bias [2I] = [b_in; b_gate] or None (ModernBERT's ``Wi``, see the module docstring)."""
    _check(x, weight, bias, activation)
    return backends.dispatch("linear_glu", backend, x, weight, bias, activation)
