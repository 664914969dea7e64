"""Linear + bias + residual add + LayerNorm (BERT's post-LN sublayer output): LN(dropout(x @ W^T + b) + residual).

Shapes: x [..., K], weight [N, K], bias [N] | None, residual [..., N], LayerNorm weight [N] and bias [N] | None
(None: no shift) -> [..., N]. LayerNorm statistics in fp32. Dropout (``dropout_p``, mask from ``dropout_seed``:
`fastbert.ops.dropout`) acts on the linear layer's output before the residual is added, as in BERT.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.ops.backward import layer_norm_grads, linear_grads
from fastbert.ops.dropout import check_dropout, dropout
from fastbert.ops.layernorm import layer_norm_fp32
from fastbert.ops.spec import OpCost, OpSpec, declare


def linear_residual_layernorm_reference(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0,
                                        dropout_seed=0):
    return layer_norm_fp32(dropout(F.linear(x, weight, bias), dropout_p, dropout_seed) + residual, ln_weight,
                           ln_bias, eps)


def check_linear_residual(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          residual: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
                          dropout_p: float, dropout_seed: int) -> None:
    """What linear_residual_layernorm and linear_residual_prenorm (``op``, named in the messages) both check: the
    dropout arguments, weight [N, K] for x [..., K], residual [..., N], bias and the LayerNorm vectors [N]."""
    check_dropout(op, dropout_p, dropout_seed)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight must be [N, {x.shape[-1]}], got {tuple(weight.shape)}")
    expected = (*x.shape[:-1], weight.shape[0])
    if tuple(residual.shape) != expected:
        raise ValueError(f"{op}: residual must be {expected}, got {tuple(residual.shape)}")
    width = weight.shape[0]
    for name, vector in (("bias", bias), ("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if vector is not None and tuple(vector.shape) != (width,):
            raise ValueError(f"{op}: {name} must be [{width}], got {tuple(vector.shape)}")


def _check(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0) -> None:
    check_linear_residual("linear_residual_layernorm", x, weight, bias, residual, ln_weight, ln_bias, dropout_p,
                          dropout_seed)


def _fake(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_residual_layernorm_cost(tokens: int, in_features: int, out_features: int, dtype_bytes: int) -> OpCost:
    """LayerNorm(x [T, K] @ W^T + b + residual [T, N]). Bytes: x, W, b, residual, LN weight and bias, output."""
    flops = 2 * tokens * in_features * out_features + 10 * tokens * out_features
    moved = (tokens * in_features + in_features * out_features + 3 * out_features
             + 2 * tokens * out_features) * dtype_bytes
    return OpCost(float(flops), float(moved))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, dropout_seed = inputs
    ctx.eps, ctx.dropout_p, ctx.dropout_seed = eps, dropout_p, dropout_seed
    ctx.save_for_backward(x, weight, bias, residual, ln_weight, ln_bias)


def _backward(ctx, grad):
    """The LayerNorm's input dropout(x @ W^T + b) + residual is recomputed (one GEMM; the dropout mask regenerated
    from its seed), its gradient (fp32 statistics and weight/bias sums) is the residual's upstream gradient, and
    through the same mask the linear layer's."""
    x, weight, bias, residual, ln_weight, ln_bias = ctx.saved_tensors
    needs = ctx.needs_input_grad
    linear = dropout(F.linear(x, weight, bias), ctx.dropout_p, ctx.dropout_seed)
    summed = linear + residual
    grad_summed, grad_ln_weight, grad_ln_bias = layer_norm_grads(grad, summed, ln_weight, ln_bias, ctx.eps,
                                                                 (any(needs[:4]), needs[4], needs[5]))
    grad_x = grad_weight = grad_bias = None
    if any(needs[:3]):
        grad_linear = dropout(grad_summed, ctx.dropout_p, ctx.dropout_seed)
        grad_x, grad_weight, grad_bias = linear_grads(grad_linear, x, weight, bias, needs[:3])
    grad_residual = grad_summed.to(residual.dtype) if needs[3] else None
    return grad_x, grad_weight, grad_bias, grad_residual, grad_ln_weight, grad_ln_bias, None, None, None


SPEC = declare(OpSpec(
    name="linear_residual_layernorm",
    cost=linear_residual_layernorm_cost,
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor residual, Tensor ln_weight, Tensor? ln_bias, float eps, "
           "float dropout_p=0.0, int dropout_seed=0) -> Tensor",
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
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    backend: str | None = "auto",
) -> torch.Tensor:
    """LayerNorm(dropout(x @ weight.T + bias) + residual) -> [..., N]; ``ln_bias`` None: LayerNorm without
    shift."""
    _check(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, dropout_seed)
    return backends.dispatch("linear_residual_layernorm", backend, x, weight, bias, residual, ln_weight, ln_bias, eps,
                             dropout_p, dropout_seed)
