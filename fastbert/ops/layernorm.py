"""LayerNorm with fp32 statistics: the eager piece the LayerNorm-fusing ops share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics whatever x's dtype; returns x's dtype. ``bias`` None: no
    shift (ModernBERT's ``nn.LayerNorm(bias=False)``). PyTorch's own kernel already accumulates fp16/bf16 inputs in
    fp32 on CPU and CUDA, so when the weights share x's dtype they are not widened first: that copy and the narrowing
    one after it cost 1.4-2.4x the LayerNorm on the 2-core VM for the same max error against fp64 (outputs at most
    one ulp apart). Other devices and mixed dtypes widen."""
    same_dtype = weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
    if x.dtype in (torch.float16, torch.bfloat16) and not (same_dtype and x.device.type in ("cpu", "cuda")):
        shift = bias.float() if bias is not None else None
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), shift, eps).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps).to(x.dtype)  # (autocast may return fp32)
