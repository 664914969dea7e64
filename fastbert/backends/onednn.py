"""The ``onednn`` backend (CPU inference): each GEMM-bearing op's GEMM through oneDNN on a weight packed once into
the blocked layout its kernels read (VNNI pairs for AMX bf16), as torch.compile's CPU freezing does, then the rest
of the op fused:

- qkv_projection: the GEMM with its bias, q, k, v strided views of the output (as the cpp backend returns them);
- linear_activation: bias and activation as oneDNN post-ops of the GEMM (exact or tanh GELU, ReLU, SiLU);
- linear_residual_layernorm: the GEMM with its bias, then residual + LayerNorm by the cpp kernel, in place.

Why: `torch.addmm` (the cpp backend's GEMM) hands oneDNN or MKL the weight as it is stored, and the library reorders
it on every call; packed once, the call reads the layout it wants. On the 2-core AVX-512 VM (no AMX) it came out
level with the cpp ops, per op and in whole MiniLM forwards (`benchmarks/results/cpu-2core-ops-onednn/`). On AMX,
where bf16 needs VNNI-packed weights, the reorder it saves is larger: on CPUs with AMX-BF16 `auto` runs bfloat16
inference GEMMs on it without timing the others (`fastbert.backends.PACKED_BF16`: timed alone, a GEMM on weights as
stored can look faster, and the forward is slower for it). Elsewhere `auto` times it beside cpp and eager per shape
class on every CPU, float32 and bfloat16 (`fastbert.backends.cpu_auto_order`; with AVX-512 BF16 bf16 forwards ran
1.07-1.09x faster on it), and per whole forward (`fastbert.backends.decide_model`), so it runs where it wins; a
packed copy made only to be timed is dropped when it loses (`release`).

Limits: CPU tensors, float32 or bfloat16 (bf16 where oneDNN has it), no autograd (a packed copy does not follow the
parameter's gradient), no dropout; a call torch.compile traces runs the cpp backend's op. Weights must be
``nn.Parameter``: each is packed on its first call and kept beside it while it lives (one extra copy of the GEMM
weights), repacked when it is changed in place or given other storage; writes through ``.data`` bypass version
counters and are not seen. A temporary weight (a parameter cast for an autocast call) would be packed on every
call, and an inference-mode weight has no version counter: both declined. The ops without a GEMM of this kind
(attention, embedding_layernorm, and ModernBERT's qkv_rotary, linear_glu and linear_residual_prenorm, whose cpp
kernels run their GEMM inside) run the cpp backend's kernels, so that a model forced onto ``onednn`` runs whole;
`auto` does not time them twice.
"""

from __future__ import annotations

import torch
import torch.utils.weak

from fastbert import backends
from fastbert.backends import cpp
from fastbert.ops.qkv_rotary import split_packed
from fastbert.ops.spec import SPECS

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# fastbert's activation -> oneDNN's post-op and its algorithm (torch.ops.mkldnn._linear_pointwise's arguments)
POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", ""), "silu": ("swish", "")}


def _unavailable() -> str | None:
    """Why this torch cannot run the backend at all, or None."""
    if not torch.backends.mkldnn.is_available():
        return "the onednn backend needs torch built with oneDNN (torch.backends.mkldnn.is_available() is False)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "the onednn backend needs torch.ops.mkldnn._linear_pointwise and _reorder_linear_weight (torch >= 2.1)"
    return None


UNAVAILABLE = _unavailable()
# weight -> (its `weight_stamp`, packed copy): entries die with their weight
_PACKED = torch.utils.weak.WeakIdKeyDictionary()


def packed_count() -> int:
    """How many packed weight copies are kept (one per live weight this backend has run)."""
    return len(_PACKED)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in oneDNN's blocked layout (an opaque mkldnn tensor), packed on first use and again after
    it changed in place or was given other storage (`fastbert.backends.weight_stamp`)."""
    stamp = backends.weight_stamp(weight)
    entry = _PACKED.get(weight)
    if entry is None or entry[0] != stamp:
        with torch.no_grad():
            entry = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        _PACKED[weight] = entry
    return entry[1]


def release(tensors) -> None:
    """Drop the packed copies of ``tensors`` (`fastbert.backends.release`: `auto` timed onednn on them and chose
    another backend); a later onednn call packs again."""
    for tensor in tensors:
        _PACKED.pop(tensor, None)


backends.register_release("onednn", release)


# ----------------------------------------------------------------------------------------------------- supports
def _why_not(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> str | None:
    """None when oneDNN can run this GEMM-bearing op: CPU, one supported dtype, a parameter as weight."""
    reason = UNAVAILABLE or backends.cpu_float_reason("onednn", (x, weight, *others), SUPPORTED_DTYPES)
    if reason:
        return reason
    if x.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bfloat16 on this CPU"
    if not isinstance(weight, torch.nn.Parameter):
        return ("the onednn backend packs each weight once and keeps the copy: it takes nn.Parameter weights (a "
                "temporary weight would be packed on every call)")
    if weight.is_inference():
        return ("the onednn backend keeps a packed copy of each weight and needs its version counter to see it "
                "change: an inference-mode weight (a model built under torch.inference_mode) has none")
    return None


def _linear_supports(x, weight, bias, option):
    """qkv_projection (``option``: num_heads) and linear_activation (``option``: the activation)."""
    return _why_not(x, weight, bias)


def _linear_residual_layernorm_supports(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0,
                                        dropout_seed=0):
    if dropout_p > 0:
        return "the onednn backend has no dropout (dropout_p > 0)"
    return cpp.EXTENSION_ERROR or _why_not(x, weight, bias, residual, ln_weight, ln_bias)


# ----------------------------------------------------------------------------------------------------- impls
def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post_op: str = "none",
          algorithm: str = "") -> torch.Tensor:
    """post_op(x @ weight^T + bias) [..., N] through oneDNN on the packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), bias, post_op, [], algorithm)


def _qkv_projection(x, weight, bias, num_heads):
    """One GEMM into a [..., 3, heads, D] buffer; q, k, v are strided views that the attention kernels read."""
    return split_packed(_gemm(x, weight, bias), num_heads)


def _linear_activation(x, weight, bias, activation):
    return _gemm(x, weight, bias, *POST_OPS[activation])


def _linear_residual_layernorm(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0):
    summed = _gemm(x, weight, bias)
    if ln_bias is None:  # (the cpp kernel takes a LayerNorm bias)
        ln_bias = ln_weight.new_zeros(ln_weight.shape)
    return cpp.bias_residual_layernorm(summed, None, residual.reshape(summed.shape), ln_weight, ln_bias, eps)


def _cpp_when_traced(op: str, impl, supports) -> tuple:
    """(implementation, supports) of ``op`` that hand a call torch.compile traces to the cpp backend's: a packed copy
    kept outside the graph cannot be traced, and torch.compile's CPU freezing packs the weights of a graph itself."""
    cpp_impl = backends.implementations(op)["cpp"]

    def run(*args, **kwargs):
        return (cpp_impl.fn if torch.compiler.is_compiling() else impl)(*args, **kwargs)

    def check(*args, **kwargs):
        return (cpp_impl.supports if torch.compiler.is_compiling() else supports)(*args, **kwargs)

    return run, check


for _op, _impl, _supports in (
    ("qkv_projection", _qkv_projection, _linear_supports),
    ("linear_activation", _linear_activation, _linear_supports),
    ("linear_residual_layernorm", _linear_residual_layernorm, _linear_residual_layernorm_supports),
):
    backends.register(_op, "onednn", *_cpp_when_traced(_op, _impl, _supports))

# The other ops run the cpp backend's kernels (a model forced onto onednn runs whole); the dispatcher skips a
# candidate whose function is an earlier candidate's.
def _borrowed(supports):
    """The cpp backend's ``supports`` for an op onednn runs with cpp's kernel, its reasons saying so."""

    def check(*args, **kwargs) -> str | None:
        reason = supports(*args, **kwargs)
        return None if reason is None else f"onednn runs the cpp backend's kernel for this op, and {reason}"

    return check


for _op in SPECS:
    _cpp_impl = backends.implementations(_op).get("cpp")
    if "onednn" not in backends.implementations(_op) and _cpp_impl is not None:
        backends.register(_op, "onednn", _cpp_impl.fn, supports=_borrowed(_cpp_impl.supports),
                          has_backward=_cpp_impl.has_backward)


def describe() -> str:
    """This backend in words, for `fastbert.backends.describe_available`."""
    if UNAVAILABLE:
        return f"onednn not usable ({UNAVAILABLE})"
    bf16 = "fp32 and bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32 (no oneDNN bf16 on this CPU)"
    if cpp.EXTENSION_ERROR:
        return (f"onednn loaded for qkv_projection and linear_activation only (CPU inference, {bf16}; the other ops "
                "need the cpp backend, which is not usable)")
    return f"onednn loaded (CPU inference, packed GEMM weights, {bf16})"
