"""Linear + bias + activation in one GEMM: act(x @ W^T + b), the activation applied in the GEMM's epilogue.

Activations: "gelu" (exact erf), "gelu_tanh", "relu", "silu". Shapes: x [..., K] (any strides for 2-D x), weight [N, K]
(any strides), bias [N] | None -> [..., N] contiguous. fp16, bf16, fp32 (fp32 without TF32). The kernel is the
shared GEMM in `_gemm.py`; this file holds the op's checks, registration and fake.
"""

from __future__ import annotations

import torch

from fastbert.ops.linear_activation import ACTIVATIONS, SPEC, linear_activation_reference

from . import _gemm
from ._common import device_reason, first_reason, float_reason

__all__ = ["linear_activation", "linear_activation_reference", "supports"]


def supports(x, weight, bias, activation) -> str | None:
    tensors = [x, weight, bias]
    return first_reason(
        device_reason(tensors),
        float_reason(tensors),
        None if activation in ACTIVATIONS else f"activation {activation!r} not in {ACTIVATIONS}",
        "K = 0 (empty reduction)" if weight.shape[1] == 0 else None,
    )


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    return _gemm.linear(x, weight, bias, activation=activation)


# torch.ops.fastbert.triton_linear_activation: schema and fake from the op's spec.
_op = SPEC.define("triton_", _launch)


def linear_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      activation: str) -> torch.Tensor:
    """act(x @ weight.T + bias) -> [..., N] (the triton backend of `fastbert.ops.linear_activation`)."""
    return torch.ops.fastbert.triton_linear_activation(x, weight, bias, activation)
