"""QKV projection: one GEMM over the packed [3H, H] weight, bias in the epilogue.

The GEMM writes one [..., 3H] buffer, which is [..., 3, heads, D] in memory; q, k, v are returned as views of it
(strided, not contiguous), exactly the layout the triton attention kernel reads through strides, so no transpose
or copy happens between the two. The softmax scale is not folded into q (q keeps the op's meaning), attention
applies it to the fp32 scores instead, which costs one multiply per score.
Shapes: x [..., H], weight [3 * heads * D, H], bias [3 * heads * D] | None -> 3 x [..., heads, D].
"""

from __future__ import annotations

import torch

from fastbert.ops.qkv_projection import SPEC, qkv_projection_reference

from . import gemm
from .common import device_reason, first_reason, float_reason

__all__ = ["qkv_projection", "qkv_projection_reference", "supports"]


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gemm.linear(x, weight, bias)


# torch.ops.fastbert.triton_qkv_projection (into the packed [..., 3H] buffer): schema and fake from the op's spec.
_op = SPEC.define("triton_", _launch)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int) -> str | None:
    tensors = [x, weight, bias]
    return first_reason(device_reason(tensors), float_reason(tensors),
                        "K = 0 (empty reduction)" if weight.shape[1] == 0 else None)


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v), each a [..., heads, D] view of one [..., 3, heads, D] buffer (the triton backend's
    `fastbert.ops.qkv_projection`)."""
    packed = torch.ops.fastbert.triton_qkv_projection(x, weight, bias)
    head_dim = weight.shape[0] // (3 * num_heads)
    q, k, v = packed.view(*x.shape[:-1], 3, num_heads, head_dim).unbind(-3)
    return q, k, v
