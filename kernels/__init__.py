"""fastbert's Triton kernels (installed as `fastbert.kernels`): the `triton` backend of `fastbert.ops`.

Importing this package registers the triton implementations of the ops with `fastbert.backends`:
embedding_layernorm, qkv_projection, attention, linear_activation, linear_residual_layernorm, linear_glu,
linear_residual_prenorm, qkv_rotary. Each launches
through a torch op ``torch.ops.fastbert.triton_<op>`` declared from the op's spec (`fastbert.ops.spec`: one schema
and one fake per op), so `torch.compile(fullgraph=True)` traces through them. They run on CUDA tensors, or on CPU
tensors when TRITON_INTERPRET=1 was set before this package was imported (the Triton interpreter: for tests, far
too slow for use). Autograd: every op here is differentiable. embedding_layernorm, linear_activation,
linear_residual_layernorm and linear_residual_prenorm attach their own backward (Triton kernels, called through
torch ops of their own so that torch.compile traces them; plain matmuls by cuBLAS) and fuse dropout into their
forwards (Philox, the backward regenerating the forward's mask); attention: see its module; ops without a backward
of their own carry their spec's (PyTorch ops).
"""

from fastbert import backends
from fastbert.ops.spec import SPECS

from . import (
    attention,
    embedding_layernorm,
    linear_activation,
    linear_glu,
    linear_residual_layernorm,
    linear_residual_prenorm,
    qkv_projection,
    qkv_rotary,
)
from ._common import INTERPRETER

for _module in (embedding_layernorm, qkv_projection, attention, linear_activation, linear_residual_layernorm,
                linear_glu, linear_residual_prenorm, qkv_rotary):
    _name = _module.__name__.rpartition(".")[2]
    backends.register(_name, "triton", getattr(_module, _name), supports=_module.supports,
                      has_backward=SPECS[_name].has_backward)

__all__ = ["INTERPRETER"]
