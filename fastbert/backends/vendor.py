"""The ``vendor`` backend: each GEMM-bearing op's GEMM through torch (cuBLAS/cuBLASLt on CUDA), then one Triton
kernel for the rest of the op (bias + activation, bias + residual + LayerNorm, rotary, GLU). It runs where the
triton backend runs (CUDA, or CPU tensors under TRITON_INTERPRET=1). Implementations are registered per op below."""

from __future__ import annotations

import torch

from fastbert.kernels.common import INTERPRETER


def describe() -> str:
    """This backend in words, for `fastbert.backends.describe_available`."""
    if torch.cuda.is_available():
        where = f"CUDA: {torch.cuda.get_device_name()}: GEMMs by cuBLAS, epilogues by Triton"
    elif INTERPRETER:
        where = "no GPU: GEMMs by torch on CPU, epilogues in the Triton interpreter, TRITON_INTERPRET=1"
    else:
        where = "no GPU: CPU only under TRITON_INTERPRET=1"
    return f"vendor loaded ({where})"
