"""LayerNorm with fp32 statistics: the eager piece the LayerNorm-fusing ops share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics whatever x's dtype; returns x's dtype. ``bias`` None: no
    shift (ModernBERT's ``nn.LayerNorm(bias=False)``). Without autograd, fp16/bf16 inputs whose weights share their
    dtype go straight into PyTorch's kernel on CPU and CUDA, whose forward accumulates in fp32 already: the widening
    copy and the narrowing one after it made the LayerNorm 1.25-1.55x slower (`benchmarks/eager_cpu.py`), for the
    same max error against fp64. Under autograd they are widened: PyTorch's CPU backward sums the weight and bias
    gradients of fp16/bf16 inputs with a far larger error (bf16, 4096 rows: 8 % vs 0.3 % relative)."""
    direct = (weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype) and x.device.type in ("cpu", "cuda")
              and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))))
    if x.dtype in (torch.float16, torch.bfloat16) and not direct:
        shift = bias.float() if bias is not None else None
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), shift, eps).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps).to(x.dtype)  # (autocast may return fp32)
