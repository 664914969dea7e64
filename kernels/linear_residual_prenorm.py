"""Linear + bias + residual add, and the LayerNorm of that sum: (summed, LN(summed)), a pre-LN sublayer's end.

Two kernels, as linear_residual_layernorm: the shared GEMM (`_gemm.py`) adds bias and residual in its epilogue and
stores the sum (fp32, one rounding to the output dtype: the new residual stream), then the shared row kernel
(`linear_residual_layernorm.layernorm_rows`) reads that stored sum and writes its LayerNorm (fp32 statistics) to a
second buffer, so normed is exactly LN(summed) as returned.
Shapes: x [..., K], weight [N, K], bias [N] | None, residual [..., N], ln_weight [N], ln_bias [N] | None (no
shift) -> (summed, normed), both [..., N] contiguous. Any strides for 2-D x and residual. fp16, bf16, fp32.
N up to 65536 (a row must fit one block).
"""

from __future__ import annotations

import torch

from fastbert.ops.linear_residual_prenorm import SPEC, linear_residual_prenorm_reference

from . import _gemm
from ._common import device_reason, first_reason, float_reason
from .linear_residual_layernorm import MAX_WIDTH, layernorm_rows

__all__ = ["linear_residual_prenorm", "linear_residual_prenorm_reference", "supports"]


def supports(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0) -> str | None:
    tensors = [x, weight, bias, residual, ln_weight, ln_bias]
    return first_reason(
        device_reason(tensors),
        float_reason(tensors),
        "K = 0 (empty reduction)" if weight.shape[1] == 0 else None,
        f"width {weight.shape[0]} exceeds {MAX_WIDTH}" if weight.shape[0] > MAX_WIDTH else None,
        "dropout_p > 0: this kernel has no dropout yet" if dropout_p > 0 else None,
    )


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
            ln_weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
            dropout_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    if dropout_p > 0:
        raise ValueError("fastbert triton linear_residual_prenorm: no dropout in this kernel yet (dropout_p > 0)")
    summed = _gemm.linear(x, weight, bias, residual=residual)
    normed = torch.empty_like(summed)
    width = weight.shape[0]
    layernorm_rows(summed.view(-1, width), normed.view(-1, width), ln_weight, ln_bias, eps)
    return summed, normed


# torch.ops.fastbert.triton_linear_residual_prenorm: schema and fake from the op's spec.
_op = SPEC.define("triton_", _launch)


def linear_residual_prenorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                            eps: float, dropout_p: float = 0.0,
                            dropout_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ weight.T + bias + residual, its LayerNorm), each [..., N] (the triton backend's
    `fastbert.ops.linear_residual_prenorm`)."""
    return torch.ops.fastbert.triton_linear_residual_prenorm(x, weight, bias, residual, ln_weight, ln_bias,
                                                             float(eps), float(dropout_p), int(dropout_seed))
