"""The ``triton`` backend: fastbert's Triton kernels (the repository's ``kernels/``, installed as
``fastbert.kernels``), what ``auto`` picks on CUDA.

Importing this module imports the kernel modules, which declare the torch ops ``torch.ops.fastbert.triton_<op>``
from the ops' specs (one schema and one fake per op, so ``torch.compile(fullgraph=True)`` traces through them), and
registers each op's triton implementation with `fastbert.backends`. The kernels run on CUDA tensors, or on CPU
tensors when ``TRITON_INTERPRET=1`` was set before they were imported (the Triton interpreter: for tests, far too
slow for use).

Autograd: every op is differentiable. embedding_layernorm, linear_activation, linear_residual_layernorm and
linear_residual_prenorm have backward kernels of their own (called through torch ops of their own so that
``torch.compile`` traces them; plain matmuls by cuBLAS) and fuse dropout into their forwards (Philox, the backward
regenerating the forward's mask); attention has a flash-style backward; the other ops carry their spec's backward
(PyTorch ops).
"""

from __future__ import annotations

import torch

from fastbert import backends
from fastbert.kernels import (
    attention,
    embedding_layernorm,
    linear_activation,
    linear_glu,
    linear_residual_layernorm,
    linear_residual_prenorm,
    qkv_projection,
    qkv_rotary,
)
from fastbert.kernels.common import INTERPRETER
from fastbert.ops.spec import SPECS

KERNEL_MODULES = (embedding_layernorm, qkv_projection, attention, linear_activation, linear_residual_layernorm,
                  linear_glu, linear_residual_prenorm, qkv_rotary)

for module in KERNEL_MODULES:
    op = module.__name__.rpartition(".")[2]
    backends.register(op, "triton", getattr(module, op), supports=module.supports,
                      has_backward=SPECS[op].has_backward)


def describe() -> str:
    """This backend in words, for `fastbert.backends.describe_available`: where the kernels run here."""
    if torch.cuda.is_available():
        where = f"CUDA: {torch.cuda.get_device_name()}" + (", TRITON_INTERPRET=1" if INTERPRETER else "")
    elif INTERPRETER:
        where = "no GPU: running on CPU in the Triton interpreter, TRITON_INTERPRET=1"
    else:
        where = "no GPU: CPU only under TRITON_INTERPRET=1"
    return f"triton loaded ({where})"
