"""The ``vendor`` backend: each GEMM-bearing op's GEMM (with its bias) through torch (cuBLAS/cuBLASLt on CUDA), then
one Triton kernel for the rest of the op (activation, residual + LayerNorm, rotary, GLU): one extra pass over the
GEMM's output instead of fastbert's own Triton GEMM (`fastbert.kernels.vendor`, `fastbert.kernels.epilogues`).
It runs where the triton backend runs (CUDA, or CPU tensors under TRITON_INTERPRET=1) and declines dropout
(the triton backend fuses it); the ops without a GEMM run the triton backend's kernels. ``auto`` tries it on
CUDA after triton.
"""

from __future__ import annotations

import torch

from fastbert import backends
from fastbert.backends import triton as triton_backend  # noqa: F401 - registers the kernels reused below
from fastbert.kernels import vendor
from fastbert.kernels.common import INTERPRETER
from fastbert.ops.spec import SPECS

for op, fn in vendor.IMPLEMENTATIONS.items():
    backends.register(op, "vendor", fn, supports=vendor.SUPPORTS[op], has_backward=SPECS[op].has_backward)

# The ops without a GEMM (attention, embedding_layernorm) run the triton backend's kernels, so that a model forced
# onto ``vendor`` runs whole; `auto` does not time them twice (the dispatcher skips a candidate whose function is
# an earlier candidate's).
for op in SPECS:
    triton_impl = backends.implementations(op).get("triton")
    if op not in vendor.IMPLEMENTATIONS and triton_impl is not None:
        backends.register(op, "vendor", triton_impl.fn, supports=triton_impl.supports,
                          has_backward=triton_impl.has_backward)


def describe() -> str:
    """This backend in words, for `fastbert.backends.describe_available`."""
    if torch.cuda.is_available():
        where = f"CUDA: {torch.cuda.get_device_name()}: GEMMs by cuBLAS, epilogues by Triton"
    elif INTERPRETER:
        where = "no GPU: GEMMs by torch on CPU, epilogues in the Triton interpreter, TRITON_INTERPRET=1"
    else:
        where = "no GPU: CPU only under TRITON_INTERPRET=1"
    return f"vendor loaded ({where})"
