"""Linear + bias + activation (the BERT FFN's first half): act(x @ W^T + b).

Activations: "gelu" (exact erf, BERT's), "gelu_tanh" (the tanh approximation), "relu", "silu" (x * sigmoid(x));
`activation_from_hf` maps transformers' ``hidden_act`` / ``hidden_activation`` names onto them.
Shapes: x [..., K], weight [N, K], bias [N] -> [..., N].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.ops.backward import activation_grad, compute_dtype, linear_grads
from fastbert.ops.spec import OpCost, OpSpec, declare

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")

# transformers' activation names (keys of transformers.activations.ACT2FN) -> fastbert's: those computing the same
# function. Others ("gelu_10", "quick_gelu", "gelu_accurate", ...) compute something else and are refused.
HF_ACTIVATIONS: dict[str, str] = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def activation_from_hf(name: str) -> str:
    """fastbert's activation name (one of `ACTIVATIONS`) for a transformers activation name (a config's
    ``hidden_act``, ModernBERT's ``hidden_activation``); ValueError for one fastbert does not compute."""
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[name]


def apply_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """One of `ACTIVATIONS` applied elementwise (the eager definition every backend is checked against)."""
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "relu":
        return F.relu(x)
    if activation == "silu":
        return F.silu(x)
    raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def linear_activation_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                activation: str) -> torch.Tensor:
    return apply_activation(F.linear(x, weight, bias), activation)


def _check(x, weight, bias, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear_activation: unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear_activation: weight must be [N, {x.shape[-1]}], got {tuple(weight.shape)}")


def _fake(x, weight, bias, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_activation_cost(tokens: int, in_features: int, out_features: int, dtype_bytes: int) -> OpCost:
    """act(x [T, K] @ W^T [K, N] + b). Bytes: x, W, b, the output."""
    flops = 2 * tokens * in_features * out_features
    moved = (tokens * in_features + in_features * out_features + out_features + tokens * out_features) * dtype_bytes
    return OpCost(float(flops), float(moved))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    ctx.activation = activation
    # relu's derivative reads from the output (y > 0 iff relu(y) > 0): no GEMM to recompute
    ctx.save_for_backward(x, weight, bias, output if activation == "relu" else None)


def _backward(ctx, grad):
    """The pre-activation x @ W^T + b is recomputed (one GEMM; relu reads its output instead), the activation's
    derivative taken in fp32, then the linear layer's gradients."""
    x, weight, bias, output = ctx.saved_tensors
    compute = compute_dtype(x.dtype)
    pre_activation = output if output is not None else F.linear(x, weight, bias)
    grad_pre = activation_grad(grad.to(compute), pre_activation.to(compute), ctx.activation)
    return (*linear_grads(grad_pre, x, weight, bias, ctx.needs_input_grad[:3]), None)


SPEC = declare(OpSpec(
    name="linear_activation",
    cost=linear_activation_cost,
    schema="(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor",
    fake=_fake,
    check=_check,
    eager=linear_activation_reference,
    reference=linear_activation_reference,
    setup_context=_setup_context,
    backward=_backward,
))


def linear_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, *,
                      backend: str | None = "auto") -> torch.Tensor:
    """act(x @ weight.T + bias) -> [..., N]."""
    _check(x, weight, bias, activation)
    return backends.dispatch("linear_activation", backend, x, weight, bias, activation)
