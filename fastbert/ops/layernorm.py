"""LayerNorm with fp32 statistics: the eager piece the LayerNorm-fusing ops share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics whatever x's dtype; returns x's dtype."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
