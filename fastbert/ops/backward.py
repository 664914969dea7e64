"""Pieces of the ops' backward formulas (`OpSpec.backward`), in PyTorch ops: the gradients of a linear layer, of a
LayerNorm with fp32 statistics and of the activations, from what the formulas recompute or saved.

Accumulations run in fp32 (fp64 for fp64 inputs): bias and LayerNorm weight/bias sums and embedding-row sums; the
GEMMs take operands in the inputs' dtype (their accumulators are fp32 in every PyTorch kernel).
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype elementwise backward math and reductions run in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def linear_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 needs: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                           torch.Tensor | None]:
    """Gradients (x, weight, bias) of y = x @ weight.T + bias given dL/dy ``grad`` [..., N]; x [..., K], weight
    [N, K]. ``needs``: which of the three are wanted (the others come back None, as does bias's when it is None)."""
    rows = grad.reshape(-1, grad.shape[-1])
    operand = rows.to(x.dtype)
    grad_x = grad_weight = grad_bias = None
    if needs[0]:
        grad_x = (operand @ weight).view(*x.shape)
    if needs[1]:
        grad_weight = operand.t() @ x.reshape(-1, x.shape[-1])
    if needs[2] and bias is not None:
        grad_bias = rows.to(compute_dtype(bias.dtype)).sum(0).to(bias.dtype)
    return grad_x, grad_weight, grad_bias


def layer_norm_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     eps: float, needs: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                                         torch.Tensor | None]:
    """Gradients (x, weight, bias) of LayerNorm over the last dim with statistics in fp32 (`layer_norm_fp32`),
    given dL/dout ``grad`` [..., N]; x [..., N] as the forward normalised it. The statistics are recomputed from
    x; everything runs in fp32 (fp64 for fp64 x). x's gradient stays in that compute dtype (callers add to it or
    cast it), weight's and bias's come back in their dtypes."""
    compute = compute_dtype(x.dtype)
    width = x.shape[-1]
    rows = x.reshape(-1, width).to(compute)
    var, mean = torch.var_mean(rows, dim=-1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    grad_rows = grad.reshape(-1, width).to(compute)
    grad_x, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
        grad_rows, rows, [width], mean, rstd, weight.to(compute), None if bias is None else bias.to(compute),
        [needs[0], needs[1], needs[2] and bias is not None])
    return (None if grad_x is None else grad_x.view(x.shape),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype))


def activation_grad(grad: torch.Tensor, pre_activation: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/d(pre-activation) for one of `fastbert.ops.linear_activation.ACTIVATIONS`, in the dtype of the
    arguments (callers pass fp32)."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, pre_activation)
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, pre_activation, approximate="tanh")
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, pre_activation, 0)
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, pre_activation)
    raise ValueError(f"unknown activation {activation!r}")
