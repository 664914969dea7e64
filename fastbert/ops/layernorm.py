"""LayerNorm with fp32 statistics: the eager piece the LayerNorm-fusing ops share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics whatever x's dtype; returns x's dtype. ``bias`` None: no
    shift (ModernBERT's ``nn.LayerNorm(bias=False)``)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        shift = bias.float() if bias is not None else None
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), shift, eps).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
