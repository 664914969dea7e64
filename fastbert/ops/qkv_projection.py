"""QKV projection: one GEMM over the packed [3H, H] weight and [3H] bias.

Shapes: x [..., H] -> (q, k, v), each [..., heads, head_dim]. Backends may return views into one buffer (the
eager one does) or write straight into the layout their attention reads; callers must not assume contiguity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.ops.backward import linear_grads
from fastbert.ops.spec import OpCost, OpSpec, declare


def qkv_projection_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int):
    """Eager reference: one linear, then views of its output split into q, k, v and heads."""
    packed = F.linear(x, weight, bias)
    head_dim = weight.shape[0] // (3 * num_heads)
    q, k, v = packed.view(*x.shape[:-1], 3, num_heads, head_dim).unbind(-3)
    return q, k, v


def _check(x, weight, bias, num_heads) -> None:
    hidden = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != hidden or weight.shape[0] % (3 * num_heads):
        raise ValueError(f"qkv_projection: weight must be [3*heads*head_dim, {hidden}] with heads={num_heads}, "
                         f"got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"qkv_projection: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def _fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# The torch op (for backends whose kernel is one) is the projection into the packed [..., 3H] buffer; the
# functional entry splits it into q, k, v views, which no schema can return without copies.
def qkv_projection_cost(tokens: int, hidden: int, dtype_bytes: int) -> OpCost:
    """x [T, H] @ W^T [H, 3H] + bias. Bytes: x, W, bias, q/k/v outputs."""
    flops = 2 * tokens * hidden * 3 * hidden
    moved = (tokens * hidden + 3 * hidden * hidden + 3 * hidden + 3 * tokens * hidden) * dtype_bytes
    return OpCost(float(flops), float(moved))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # x, weight, bias


def _backward(ctx, grad):
    """The linear layer's gradients from the packed [..., 3H] output's."""
    x, weight, bias = ctx.saved_tensors
    return linear_grads(grad, x, weight, bias, ctx.needs_input_grad)


SPEC = declare(OpSpec(
    name="qkv_projection",
    cost=qkv_projection_cost,
    schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    fake=_fake,
    check=_check,
    eager=qkv_projection_reference,
    reference=qkv_projection_reference,
    setup_context=_setup_context,
    backward=_backward,
))


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int, *,
                   backend: str | None = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x @ weight.T + bias split into q, k, v of shape [..., num_heads, head_dim]; weight is [3H, H]."""
    _check(x, weight, bias, num_heads)
    return backends.dispatch("qkv_projection", backend, x, weight, bias, num_heads)
