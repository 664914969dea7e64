"""The ``cpp`` backend: fastbert's C++ CPU kernels (the extension ``fastbert._C``), what ``auto`` picks on CPU.

Importing this module declares the torch ops ``torch.ops.fastbert.cpp_<op>`` from the ops' specs (schema and fake,
used by ``torch.compile`` and ``torch.library.opcheck``), loads ``fastbert._C`` (whose static initialisers register
their CPU kernels, and declare a few helper ops of its own), and registers the cpp implementation of each
dispatched op with `fastbert.backends`:

- embedding_layernorm: one fused gather + sum + LayerNorm kernel;
- qkv_projection: one ``addmm`` over the packed [3H, H] weight, returning strided views (attention reads them);
- qkv_rotary: the same GEMM, then the rotary embedding applied in place to q and k (vectorised, threaded);
- attention: the blocked online-softmax kernel, packed (cost follows real lengths) or padded with a key mask,
  global or in a sliding window (cost follows the window);
- linear_activation: a GEMM without bias, then bias + activation fused in place on its output;
- linear_glu: a GEMM without bias into both halves, then bias + act(input) * gate fused into the output;
- linear_residual_layernorm: a GEMM, then bias + residual + LayerNorm fused in place;
- linear_residual_prenorm: a GEMM, then bias + residual written in place and its LayerNorm beside it.

GEMMs stay with PyTorch (MKL/oneDNN). Limits: CPU tensors, float32 or bfloat16. Autograd: every op has a backward.
Attention's is a C++ kernel (``fastbert::cpp_attention_backward``, csrc/attention_backward.cpp: probabilities
recomputed per block from q and k, real lengths only, fp32), and the attention kernels take dropout (a
counter-based mask the backward regenerates, csrc/dropout_rng.h); the other ops' backward is their spec's (PyTorch
ops recomputing what they need) and they decline dropout.

When the extension is missing (``FASTBERT_SKIP_EXT=1``, or its build failed) this module still imports: it warns
once and every op's ``supports`` gives that reason, so ``auto`` runs eager. An extension built from older sources
than this module's (a source checkout updated without a rebuild) loads without some kernels: the ops that need
them give that reason too (`missing_kernel`).
"""
from __future__ import annotations

import warnings

import torch

from fastbert import backends
from fastbert.ops.dropout import register_kernel
from fastbert.ops.qkv_rotary import split_packed
from fastbert.ops.spec import SPECS

# The torch ops whose CPU kernels the extension holds: schema and fake come from each op's spec.
TORCH_OPS = ("embedding_layernorm", "linear_activation", "linear_residual_layernorm", "attention", "linear_glu",
             "linear_residual_prenorm", "qkv_rotary")


def _attention_backward(ctx, grad):
    """The attention op's autograd formula: the C++ backward kernel, or the spec's formula where the extension lacks
    it (`ATTENTION_BACKWARD_ERROR`: its forward then declines dropout). ``ctx`` as the spec's ``setup_context``
    fills it."""
    if ATTENTION_BACKWARD_ERROR is not None:
        return SPECS["attention"].backward(ctx, grad)
    q, k, v, cu_seqlens, key_padding_mask = ctx.saved_tensors
    grads = torch.ops.fastbert.cpp_attention_backward(grad, q, k, v, cu_seqlens, ctx.max_seqlen, key_padding_mask,
                                                      ctx.scale, ctx.window, ctx.dropout_p, ctx.dropout_seed)
    return (*(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad[:3], strict=True)),
            None, None, None, None, None, None, None)


# Ops whose autograd formula is this backend's own kernel rather than the spec's (same setup_context).
_OWN_BACKWARD = {"attention": _attention_backward}
for _name in TORCH_OPS:
    if _name in _OWN_BACKWARD:
        SPECS[_name].define("cpp_", setup_context=SPECS[_name].setup_context, backward=_OWN_BACKWARD[_name])
    else:
        SPECS[_name].define("cpp_")

try:
    from fastbert import _C  # importing registers the kernels (and the helper ops) in torch.ops.fastbert
except ImportError as err:
    _C = None
    EXTENSION_ERROR: str | None = (f"the C++ extension fastbert._C is not built ({err}); reinstall with "
                                   "`pip install --no-build-isolation -e .` and a C++ compiler")
    warnings.warn(f"fastbert: {EXTENSION_ERROR}; the cpp backend is unavailable, CPU ops run eager", stacklevel=2)
else:
    EXTENSION_ERROR = None


def missing_kernel(op: str, source: str, what: str) -> str | None:
    """None when the loaded extension has the CPU kernel of ``torch.ops.fastbert.<op>``; else why not, so that a
    stale build (older than ``source``, which defines it) says to rebuild instead of failing at the op's first call.
    ``what``: what the kernel gives, in words."""
    if EXTENSION_ERROR is not None:
        return EXTENSION_ERROR
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"fastbert::{op}", "CPU"):
        return None
    return (f"fastbert._C was built without {source} ({what}); rebuild it (`python setup.py build_ext --inplace` or "
            "reinstall)")


QKV_ROTARY_ERROR = missing_kernel("cpp_qkv_rotary", "csrc/rotary.cpp", "qkv_rotary")
# Without it attention trains through the spec's formula, and its forward declines dropout.
ATTENTION_BACKWARD_ERROR = missing_kernel("cpp_attention_backward", "csrc/attention_backward.cpp",
                                          "attention's backward and dropout")

DROPOUT_ERROR = missing_kernel("cpp_dropout", "csrc/dropout.cpp", "one-pass dropout")

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def compiled_capability() -> str | None:
    """The vector ISA the kernels were compiled for (``AVX512``, ``AVX2`` or ``DEFAULT``), None without them."""
    return None if _C is None else _C.compiled_capability()


_KERNEL_WORDS = {"amx": "AMX", "avx512_bf16": "AVX512-BF16"}


def bf16_attention_kernel(head_dim: int, window: bool = False) -> str:
    """Which kernel computes the two products of bfloat16 attention of this head dim here (`csrc/attention.cpp`),
    without dropout, in a sliding window narrower than the sequence if ``window``: ``"amx"`` (oneDNN's brgemm through
    ATen, on a CPU with AMX-BF16, without a window), ``"avx512_bf16"`` (register tiles of vdpbf16ps, on a CPU with
    AVX512-BF16 and no AMX), or ``"vector"`` (products in fp32: an odd head dim or one over 256, another CPU or a build
    below AVX-512, no extension, or a window on AMX)."""
    kernel = "vector" if _C is None else _C.bf16_attention_kernel(head_dim)
    return "vector" if window and kernel == "amx" else kernel


def describe() -> str:
    """This backend in words, for `fastbert.backends.describe_available`. The module imports without its extension
    (so that `auto` can say why it skips cpp), so being loaded is not being usable."""
    if EXTENSION_ERROR:
        return f"cpp not usable ({EXTENSION_ERROR})"
    kernel = bf16_attention_kernel(64)
    bf16 = "" if kernel == "vector" else f", bf16 attention on {_KERNEL_WORDS[kernel]}"
    return f"cpp loaded ({compiled_capability()}{bf16})"


# ----------------------------------------------------------------------------------------------------- fakes
# Of the helper ops only this extension has (the fused ops' fakes are their specs').
if _C is not None:

    @torch.library.register_fake("fastbert::cpp_bias_activation")
    def _(x, bias, activation):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("fastbert::cpp_bias_residual_layernorm")
    def _(x, bias, residual, ln_weight, ln_bias, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("fastbert::cpp_unpad")
    def _(x, indices):
        return x.new_empty((indices.shape[0], *x.shape[2:]))

    @torch.library.register_fake("fastbert::cpp_pad")
    def _(x, indices, batch, seqlen):
        return x.new_empty((batch, seqlen, *x.shape[1:]))

if DROPOUT_ERROR is None:

    @torch.library.register_fake("fastbert::cpp_dropout")
    def _(x, p, seed):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

if ATTENTION_BACKWARD_ERROR is None:

    @torch.library.register_fake("fastbert::cpp_attention_backward")
    def _(grad, q, k, v, cu_seqlens, max_seqlen, key_padding_mask, scale, window=None, dropout_p=0.0,
          dropout_seed=0):
        return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


# ----------------------------------------------------------------------------------------------------- supports
def _why_not(*tensors: torch.Tensor | None) -> str | None:
    """None when the cpp kernels can take these float tensors (one CPU device, one supported dtype)."""
    return EXTENSION_ERROR or backends.cpu_float_reason("cpp", tensors, SUPPORTED_DTYPES)


def _ids_on_cpu(*ids: torch.Tensor | None) -> str | None:
    for t in ids:
        if t is not None and t.device.type != "cpu":
            return f"the cpp backend runs on CPU tensors only, got ids on {t.device}"
    return None


def _no_dropout(dropout_p: float) -> str | None:
    return "the cpp kernels have no dropout (dropout_p > 0)" if dropout_p > 0 else None


def _embedding_supports(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                        token_type_embeddings, weight, bias, eps, dropout_p=0.0, dropout_seed=0):
    return (_no_dropout(dropout_p) or _ids_on_cpu(input_ids, position_ids, token_type_ids)
            or _why_not(word_embeddings, position_embeddings, token_type_embeddings, weight, bias))


def _qkv_rotary_supports(x, weight, bias, num_heads, positions, cos, sin):
    return (QKV_ROTARY_ERROR or _why_not(x, weight, bias) or _ids_on_cpu(positions)
            or _why_not(cos, sin))  # the tables are float32 whatever x's dtype: a check of their own


def _attention_supports(q, k, v, cu_seqlens=None, max_seqlen=None, key_padding_mask=None, scale=None, window=None,
                        dropout_p=0.0, dropout_seed=0):
    no_dropout = dropout_p > 0 and ATTENTION_BACKWARD_ERROR
    return no_dropout or _why_not(q, k, v) or _ids_on_cpu(cu_seqlens, key_padding_mask)


def _linear_supports(x, weight, bias, option):
    """qkv_projection (``option``: num_heads), linear_activation and linear_glu (``option``: the activation, which
    the spec's check has validated): a PyTorch GEMM and a kernel that take any float tensors the others do."""
    return _why_not(x, weight, bias)


def _linear_residual_layernorm_supports(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0,
                                        dropout_seed=0):
    return _no_dropout(dropout_p) or _why_not(x, weight, bias, residual, ln_weight, ln_bias)


# ----------------------------------------------------------------------------------------------------- impls
def _embedding_layernorm(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                         token_type_embeddings, weight, bias, eps, dropout_p=0.0, dropout_seed=0):
    return torch.ops.fastbert.cpp_embedding_layernorm(input_ids, position_ids, token_type_ids, word_embeddings,
                                                      position_embeddings, token_type_embeddings, weight, bias, eps,
                                                      dropout_p, dropout_seed)


def _qkv_projection(x, weight, bias, num_heads):
    """One GEMM into a [..., 3, heads, D] buffer; q, k, v are strided views that the attention kernel reads."""
    flat = x.reshape(-1, x.shape[-1])
    packed = torch.addmm(bias, flat, weight.t()) if bias is not None else torch.mm(flat, weight.t())
    return split_packed(packed.view(*x.shape[:-1], packed.shape[-1]), num_heads)


def _qkv_rotary(x, weight, bias, num_heads, positions, cos, sin):
    """One GEMM into the packed [..., 3, heads, D] buffer, q and k rotated in place; q, k, v are strided views."""
    return split_packed(torch.ops.fastbert.cpp_qkv_rotary(x, weight, bias, positions, cos, sin, num_heads), num_heads)


def _attention(q, k, v, cu_seqlens=None, max_seqlen=None, key_padding_mask=None, scale=None, window=None,
               dropout_p=0.0, dropout_seed=0):
    return torch.ops.fastbert.cpp_attention(q, k, v, cu_seqlens, max_seqlen, key_padding_mask, scale, window,
                                            dropout_p, dropout_seed)


def _linear_activation(x, weight, bias, activation):
    return torch.ops.fastbert.cpp_linear_activation(x, weight, bias, activation)


def _linear_residual_layernorm(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0):
    return torch.ops.fastbert.cpp_linear_residual_layernorm(x, weight, bias, residual, ln_weight, ln_bias, eps,
                                                            dropout_p, dropout_seed)


def _linear_glu(x, weight, bias, activation):
    return torch.ops.fastbert.cpp_linear_glu(x, weight, bias, activation)


def _linear_residual_prenorm(x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p=0.0, dropout_seed=0):
    return torch.ops.fastbert.cpp_linear_residual_prenorm(x, weight, bias, residual, ln_weight, ln_bias, eps,
                                                          dropout_p, dropout_seed)


def unpad(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows of x [B, S, ...] at int64 flat indices (b * S + s) -> [T, ...] (the C++ kernel)."""
    return torch.ops.fastbert.cpp_unpad(x, indices)


def pad(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """x [T, ...] scattered to [batch, seqlen, ...] at int64 flat indices, zeros elsewhere (the C++ kernel)."""
    return torch.ops.fastbert.cpp_pad(x, indices, batch, seqlen)


def dropout(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """x (float32 or bfloat16) with each element kept with probability 1 - p and scaled by 1 / (1 - p), zero
    elsewhere, contiguous; the mask a pure function of (p, seed, flat index) (the C++ kernel, csrc/dropout.cpp)."""
    return torch.ops.fastbert.cpp_dropout(x, p, seed)


def bias_activation(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(x + bias) -> like x, contiguous; activation "gelu" | "gelu_tanh" | "relu" | "silu" (the C++ kernel)."""
    return torch.ops.fastbert.cpp_bias_activation(x, bias, activation)


def bias_residual_layernorm(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                            ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm(x + bias + residual) over the last dim -> like x, contiguous (the C++ kernel)."""
    return torch.ops.fastbert.cpp_bias_residual_layernorm(x, bias, residual, ln_weight, ln_bias, eps)


# Differentiable: the torch ops carry their spec's backward (`OpSpec.define`), qkv_projection is PyTorch's addmm.
for _op, _impl, _supports in (
    ("embedding_layernorm", _embedding_layernorm, _embedding_supports),
    ("qkv_projection", _qkv_projection, _linear_supports),
    ("qkv_rotary", _qkv_rotary, _qkv_rotary_supports),
    ("attention", _attention, _attention_supports),
    ("linear_activation", _linear_activation, _linear_supports),
    ("linear_residual_layernorm", _linear_residual_layernorm, _linear_residual_layernorm_supports),
    ("linear_glu", _linear_glu, _linear_supports),
    ("linear_residual_prenorm", _linear_residual_prenorm, _linear_residual_layernorm_supports),
):
    backends.register(_op, "cpp", _impl, _supports, has_backward=_op not in TORCH_OPS or SPECS[_op].has_backward)

if DROPOUT_ERROR is None:
    register_kernel("cpu", dropout)

__all__ = ["DROPOUT_ERROR", "EXTENSION_ERROR", "bf16_attention_kernel", "bias_activation", "bias_residual_layernorm",
           "compiled_capability", "dropout", "pad", "unpad"]
