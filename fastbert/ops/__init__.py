"""Functional entries of fastbert's fused ops, one per op, each dispatched over the backends (`fastbert.backends`).

Every op file declares its op once (`fastbert.ops.spec.OpSpec`: schema and fake of its torch op, argument
checks, the eager implementation, the fp32 reference the other backends are checked against, its cost formula)
and holds the functional entry that dispatches (see `fastbert.backends`). ``SPECS`` lists the ops.
"""

from fastbert.ops.attention import attention, attention_reference
from fastbert.ops.embedding_layernorm import embedding_layernorm, embedding_layernorm_reference
from fastbert.ops.linear_activation import (
    ACTIVATIONS,
    activation_from_hf,
    apply_activation,
    linear_activation,
    linear_activation_reference,
)
from fastbert.ops.linear_glu import linear_glu, linear_glu_reference
from fastbert.ops.linear_residual_layernorm import linear_residual_layernorm, linear_residual_layernorm_reference
from fastbert.ops.linear_residual_prenorm import linear_residual_prenorm, linear_residual_prenorm_reference
from fastbert.ops.padding import VarlenBatch, pad_tokens, unpad_tokens, varlen_from_mask
from fastbert.ops.qkv_projection import qkv_projection, qkv_projection_reference
from fastbert.ops.qkv_rotary import qkv_rotary, qkv_rotary_reference, rotary_tables
from fastbert.ops.spec import SPECS, OpSpec

__all__ = [
    "ACTIVATIONS",
    "OpSpec",
    "SPECS",
    "VarlenBatch",
    "activation_from_hf",
    "apply_activation",
    "attention",
    "attention_reference",
    "embedding_layernorm",
    "embedding_layernorm_reference",
    "linear_activation",
    "linear_activation_reference",
    "linear_glu",
    "linear_glu_reference",
    "linear_residual_layernorm",
    "linear_residual_layernorm_reference",
    "linear_residual_prenorm",
    "linear_residual_prenorm_reference",
    "pad_tokens",
    "qkv_projection",
    "qkv_projection_reference",
    "qkv_rotary",
    "qkv_rotary_reference",
    "rotary_tables",
    "unpad_tokens",
    "varlen_from_mask",
]
