"""The ``vendor`` backend's ops: each GEMM-bearing op's GEMM and bias by torch (``F.linear``: cuBLAS/cuBLASLt on
CUDA, whose bias epilogue adds the bias in fp32 before rounding), then one Triton kernel of `epilogues` for the
rest, one extra pass over the [M, N] output:

| op | GEMM (torch) | epilogue (Triton) |
|---|---|---|
| qkv_projection | x @ W^T + b | none (the bias is cuBLASLt's) |
| linear_activation | x @ W^T + b | the activation, in place |
| linear_residual_layernorm | x @ W^T + b | + residual, LayerNorm over y (in place) |
| linear_residual_prenorm | x @ W^T + b | + residual written over y, its LayerNorm beside it |
| linear_glu | x @ W^T + b ([M, 2I]) | act(input half) * gate half -> [M, I] |
| qkv_rotary | x @ W^T + b | q and k rotated in place |

The torch ops are ``torch.ops.fastbert.vendor_<op>``, declared from the ops' specs (schema and fake once), so
``torch.compile`` traces them; their backward is the spec's formula in PyTorch ops (cuBLAS matmuls), except
linear_residual_prenorm's: the triton backend's formula (`linear_residual_prenorm.backward`: its LayerNorm backward
row kernel on the saved sum, then cuBLAS matmuls). linear_residual_layernorm under
autograd runs linear_residual_prenorm's op and returns its LayerNorm, as the triton backend does: the same output
bit for bit, and a backward that reads the saved sum instead of recomputing the GEMM.

Dropout is declined (``supports`` says so for dropout_p > 0): the spec's backward regenerates torch's keep mask
(`fastbert.ops.dropout.keep_mask`), which a Triton kernel cannot draw, and applying it in torch would add a pass;
training with dropout takes the triton backend (Philox dropout fused into its GEMM epilogue) or eager.
Where it runs: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (torch's CPU GEMM, the epilogue interpreted).
fp32 GEMMs follow torch's matmul precision (IEEE fp32 by default, ~1e-5; TF32 where a program allows it with
``torch.backends.cuda.matmul.allow_tf32`` / ``set_float32_matmul_precision``, as eager's do).
Any strides for x and the weight (torch's GEMM takes them); the residual needs a unit column stride (else copied).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert.ops.linear_activation import ACTIVATIONS
from fastbert.ops.linear_activation import SPEC as LINEAR_ACTIVATION
from fastbert.ops.linear_glu import SPEC as LINEAR_GLU
from fastbert.ops.linear_residual_layernorm import SPEC as LINEAR_RESIDUAL_LAYERNORM
from fastbert.ops.linear_residual_prenorm import SPEC as LINEAR_RESIDUAL_PRENORM
from fastbert.ops.qkv_projection import SPEC as QKV_PROJECTION
from fastbert.ops.qkv_rotary import SPEC as QKV_ROTARY
from fastbert.ops.qkv_rotary import split_packed

from . import epilogues
from . import linear_residual_prenorm as prenorm
from .common import device_reason, first_reason, float_reason
from .gemm import as_rows
from .qkv_rotary import table_reason as rotary_table_reason

__all__ = ["IMPLEMENTATIONS", "SUPPORTS"]


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias as a contiguous [rows, N] tensor: 2-D operands, so that torch runs one addmm (on CUDA the
    cuBLASLt call with the bias epilogue)."""
    return F.linear(as_rows(x), weight, bias).contiguous()


def _residual_rows(residual: torch.Tensor) -> torch.Tensor:
    rows = as_rows(residual)
    return rows if rows.shape[1] <= 1 or rows.stride(1) == 1 else rows.contiguous()


# ---------------------------------------------------------------------------------------------- implementations
def _qkv_projection(x, weight, bias):
    return _gemm(x, weight, bias).view(*x.shape[:-1], weight.shape[0])


def _linear_activation(x, weight, bias, activation):
    return epilogues.activate_rows(_gemm(x, weight, bias), activation).view(*x.shape[:-1], weight.shape[0])


def _linear_residual_layernorm(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0):
    _refuse_dropout("linear_residual_layernorm", dropout_p)
    y = _gemm(x, weight, bias)
    epilogues.residual_layernorm_rows(y, _residual_rows(residual), ln_weight, ln_bias, eps)
    return y.view(*x.shape[:-1], weight.shape[0])


def _linear_residual_prenorm(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0):
    _refuse_dropout("linear_residual_prenorm", dropout_p)
    summed = _gemm(x, weight, bias)
    normed = torch.empty_like(summed)
    epilogues.residual_layernorm_rows(summed, _residual_rows(residual), ln_weight, ln_bias, eps, out=normed)
    shape = (*x.shape[:-1], weight.shape[0])
    return summed.view(shape), normed.view(shape)


def _linear_glu(x, weight, bias, activation):
    return epilogues.glu_rows(_gemm(x, weight, bias), activation).view(*x.shape[:-1], weight.shape[0] // 2)


def _qkv_rotary(x, weight, bias, positions, cos, sin, num_heads):
    packed = epilogues.rotary_rows(_gemm(x, weight, bias), positions, cos, sin, num_heads)
    return packed.view(*x.shape[:-1], weight.shape[0])


def _refuse_dropout(op: str, dropout_p: float) -> None:
    if dropout_p > 0:
        raise ValueError(f"fastbert vendor {op}: dropout is not fused by this backend (dropout_p = {dropout_p})")


# torch.ops.fastbert.vendor_<op>: schema and fake from each op's spec; the backward the spec's formula (PyTorch
# ops), prenorm's the triton backend's (the Triton LayerNorm backward on the saved sum, then the matmuls).
_OPS = {spec.name: spec.define("vendor_", impl) for spec, impl in (
    (QKV_PROJECTION, _qkv_projection),
    (LINEAR_ACTIVATION, _linear_activation),
    (LINEAR_RESIDUAL_LAYERNORM, _linear_residual_layernorm),
    (LINEAR_GLU, _linear_glu),
    (QKV_ROTARY, _qkv_rotary),
)}
_OPS["linear_residual_prenorm"] = LINEAR_RESIDUAL_PRENORM.define(
    "vendor_", _linear_residual_prenorm, setup_context=prenorm.setup_context, backward=prenorm.backward)


# ---------------------------------------------------------------------------------------------- backend functions
def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v), each a [..., heads, D] view of one [..., 3, heads, D] buffer."""
    return split_packed(_OPS["qkv_projection"](x, weight, bias), num_heads)


def linear_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      activation: str) -> torch.Tensor:
    """act(x @ weight.T + bias) -> [..., N]."""
    return _OPS["linear_activation"](x, weight, bias, activation)


def linear_residual_layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                              eps: float, dropout_p: float = 0.0, dropout_seed: int = 0) -> torch.Tensor:
    """LayerNorm(x @ weight.T + bias + residual) -> [..., N]; under autograd through linear_residual_prenorm's op
    (module docstring)."""
    args = (x, weight, bias, residual, ln_weight, ln_bias, float(eps), float(dropout_p), int(dropout_seed))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args[:6]):
        return _OPS["linear_residual_prenorm"](*args)[1]
    return _OPS["linear_residual_layernorm"](*args)


def linear_residual_prenorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                            eps: float, dropout_p: float = 0.0,
                            dropout_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ weight.T + bias + residual, its LayerNorm), each [..., N]."""
    return _OPS["linear_residual_prenorm"](x, weight, bias, residual, ln_weight, ln_bias, float(eps),
                                           float(dropout_p), int(dropout_seed))


def linear_glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(x @ W_in.T + b_in) * (x @ W_gate.T + b_gate) -> [..., I]."""
    return _OPS["linear_glu"](x, weight, bias, activation)


def qkv_rotary(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
               positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v), q and k rotated, each a [..., heads, D] view of one buffer."""
    return split_packed(_OPS["qkv_rotary"](x, weight, bias, positions, cos, sin, num_heads), num_heads)


# -------------------------------------------------------------------------------------------------------- supports
def _tensor_reason(tensors: list[torch.Tensor | None]) -> str | None:
    return first_reason(device_reason(tensors), float_reason(tensors))


def _dropout_reason(dropout_p: float) -> str | None:
    if dropout_p > 0:
        return ("dropout_p > 0: the vendor backend does not fuse dropout (the spec's backward regenerates torch's "
                "keep mask, which its Triton epilogue cannot draw); the triton backend fuses it")
    return None


def _width_reason(width: int) -> str | None:
    return f"width {width} exceeds {epilogues.MAX_WIDTH} (a LayerNorm row must fit one block)" \
        if width > epilogues.MAX_WIDTH else None


def _activation_reason(activation: str) -> str | None:
    return None if activation in ACTIVATIONS else f"activation {activation!r} not in {ACTIVATIONS}"


def supports_qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            num_heads: int) -> str | None:
    return _tensor_reason([x, weight, bias])


def supports_linear_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               activation: str) -> str | None:
    return first_reason(_tensor_reason([x, weight, bias]), _activation_reason(activation))


def supports_linear_residual_layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                       residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
                                       eps: float, dropout_p: float = 0.0, dropout_seed: int = 0) -> str | None:
    return first_reason(_tensor_reason([x, weight, bias, residual, ln_weight, ln_bias]),
                        _width_reason(weight.shape[0]), _dropout_reason(dropout_p))


def supports_linear_glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        activation: str) -> str | None:
    return first_reason(_tensor_reason([x, weight, bias]), _activation_reason(activation))


def supports_qkv_rotary(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                        positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    return first_reason(
        device_reason([x, weight, bias, positions, cos, sin]),
        float_reason([x, weight, bias]),
        rotary_table_reason(cos, sin),
    )


IMPLEMENTATIONS = {"qkv_projection": qkv_projection, "linear_activation": linear_activation,
                   "linear_residual_layernorm": linear_residual_layernorm,
                   "linear_residual_prenorm": linear_residual_prenorm, "linear_glu": linear_glu,
                   "qkv_rotary": qkv_rotary}
SUPPORTS = {"qkv_projection": supports_qkv_projection, "linear_activation": supports_linear_activation,
            "linear_residual_layernorm": supports_linear_residual_layernorm,
            "linear_residual_prenorm": supports_linear_residual_layernorm, "linear_glu": supports_linear_glu,
            "qkv_rotary": supports_qkv_rotary}
