"""Attention, flash style: softmax(q k^T * scale) v computed block by block with an online softmax in fp32.

Forms (one kernel for both):
- packed variable-length: q, k, v [T, heads, D] with int32 `cu_seqlens` [B + 1] and `max_seqlen`; a token
  attends only within its own sequence;
- padded: q, k, v [B, S, heads, D] with an optional bool `key_padding_mask` [B, S] (True = real key).
q, k, v are read through their strides (the [T, 3, heads, D] views `qkv_projection` returns need no copy).
The head dim is padded to a power-of-two block with masking: D is any multiple of 8 from 8 to 256 (32, 64, 80,
96, 128 are the BERT-family sizes). Any sequence length (keys are streamed in blocks). A query whose keys are all
masked gets zeros, never NaN (running max kept finite, zero denominator -> zero output). K and V at masked keys are
never loaded, so NaN or Inf stored there never reaches a real query's output.
Output: contiguous, shaped like q, in q's dtype. fp16, bf16, fp32 (fp32 dots in IEEE, no TF32).
Sliding window (`window`, ModernBERT's local_attention, see fastbert.ops.attention): a query at position i attends
the keys j with |i - j| <= window // 2 (positions within its sequence). A query block's key loop runs only over the
key blocks its rows' windows reach (from the first one touching m_start - window // 2 to m_end + window // 2), so a
local layer costs about S * window; inside those blocks the band is masked per element. A window reaching every key
launches the global kernel. A query whose window holds no real key gets zeros.
Packed form contract (not checked: it would cost a device sync): cu_seqlens[-1] == T and max_seqlen >= the
longest sequence; rows outside that are left unwritten. Grid: (query blocks, batch <= 65535, heads).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from fastbert.ops.attention import SPEC, attention_reference

from ._common import INTERPRETER, cast_rtne, device_reason, dot_in_fp32, dot_precision, first_reason, float_reason

__all__ = ["attention", "attention_reference", "supports"]

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


@triton.jit
def _attention_kernel(
    q_ptr, stride_qb, stride_qs, stride_qh, stride_qd,  # q [B, S, heads, D] (packed form: stride_qb unused)
    k_ptr, stride_kb, stride_ks, stride_kh, stride_kd,  # k, same layout as q
    v_ptr, stride_vb, stride_vs, stride_vh, stride_vd,  # v, same layout as q
    out_ptr, stride_ob, stride_os, stride_oh, stride_od,  # output, same layout as q
    cu_seqlens_ptr,  # int32 [B + 1] sequence starts in the packed token dim (PACKED only)
    mask_ptr, stride_mb, stride_ms,  # uint8 [B, S] key padding mask, 1 = real key (HAS_MASK only)
    seqlen,  # padded form: S
    head_dim,
    qk_scale,  # softmax scale * log2(e): scores go straight to exp2
    window_half,  # WINDOW only: a query attends keys at most this many positions away
    PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: see `_common.INTERPRETER`
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    block_m = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    if PACKED:
        start = tl.load(cu_seqlens_ptr + batch).to(tl.int64)
        length = tl.load(cu_seqlens_ptr + batch + 1).to(tl.int64) - start
        q_base = q_ptr + start * stride_qs + head * stride_qh
        k_base = k_ptr + start * stride_ks + head * stride_kh
        v_base = v_ptr + start * stride_vs + head * stride_vh
        out_base = out_ptr + start * stride_os + head * stride_oh
    else:
        length = seqlen
        q_base = q_ptr + batch * stride_qb + head * stride_qh
        k_base = k_ptr + batch * stride_kb + head * stride_kh
        v_base = v_ptr + batch * stride_vb + head * stride_vh
        out_base = out_ptr + batch * stride_ob + head * stride_oh
    if block_m * BLOCK_M >= length:  # this sequence is shorter than the longest one
        return

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_mask = (offs_m < length)[:, None] & d_mask[None, :]
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if WINDOW:  # only the key blocks some row's window reaches; the first one aligned to BLOCK_N
        key_begin = tl.maximum(block_m * BLOCK_M - window_half, 0) // BLOCK_N * BLOCK_N
        key_end = tl.minimum((block_m + 1) * BLOCK_M + window_half, length)
    else:
        key_begin = 0
        key_end = length
    for key_start in range(key_begin, key_end, BLOCK_N):
        keys = key_start + offs_n
        key_valid = keys < length
        if HAS_MASK:
            real = tl.load(mask_ptr + batch * stride_mb + keys * stride_ms, mask=key_valid, other=0)
            key_valid = key_valid & (real != 0)
        # Masked keys are not loaded (zeros instead): a zero probability times a NaN or Inf in V is still NaN.
        kv_mask = key_valid[:, None] & d_mask[None, :]
        k = tl.load(k_base + keys[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if WINDOW:
            # |query - key| from block-local int32 offsets (64-bit [BLOCK_M, BLOCK_N] indices would spill on sm_90)
            shift = (block_m * BLOCK_M - key_start).to(tl.int32)
            in_window = tl.abs(tl.arange(0, BLOCK_M)[:, None] - offs_n[None, :] + shift) <= window_half
            scores = tl.where(key_valid[None, :] & in_window, scores, float("-inf"))
        else:
            scores = tl.where(key_valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # While every key seen so far is masked the max is -inf; subtract 0 then so exp2 gives 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.math.exp2(scores - safe_max[:, None])
        correction = tl.math.exp2(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        # P is rounded to the input dtype before P @ V (tensor-core operands), then widened again if DOT_IN_FP32.
        probs_in = cast_rtne(probs, v_ptr.dtype.element_ty).to(v.dtype)
        acc = acc * correction[:, None] + tl.dot(probs_in, v, input_precision=INPUT_PRECISION)
        row_max = new_max
    out = tl.where(row_sum[:, None] > 0, acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None], 0.0)
    out_ptrs = out_base + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(out_ptrs, cast_rtne(out, out_ptr.dtype.element_ty), mask=q_mask)


def _meta(head_dim: int, max_seqlen: int, dtype: torch.dtype, window: bool = False) -> dict:
    """Block sizes: a fixed config under the interpreter, a table by head dim on a GPU (compiled for sm_90 here,
    never run). fp32 tiles take twice the shared memory: smaller blocks keep them under A100's 163 KiB too.
    fp32 runs 8 warps at every head dim and 16 keys a block above D = 64: its IEEE dots use FMA units with the
    operands in registers, and at 4 warps and 32 keys they spill on sm_90 (16 KB per thread at D >= 80, see
    benchmarks/results/sm90-resources). A sliding window halves BLOCK_M (64 in fp16/bf16, 32 in fp32): the band
    mask's registers made the full-size tiles spill on sm_90, and shorter query blocks also reach fewer keys outside
    their rows' windows (a block of BLOCK_M rows walks BLOCK_M + window keys for about window useful ones)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    fit = max(16, triton.next_power_of_2(max_seqlen))
    if INTERPRETER:
        return {"BLOCK_M": min(64, fit), "BLOCK_N": min(64, fit), "BLOCK_D": block_d}
    meta = _global_meta(block_d, fit, dtype)
    if window:
        meta["BLOCK_M"] = min(meta["BLOCK_M"], 32 if dtype == torch.float32 else 64)
    return meta


def _global_meta(block_d: int, fit: int, dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return {"BLOCK_M": min(64, fit), "BLOCK_N": min(32 if block_d <= 64 else 16, fit), "BLOCK_D": block_d,
                "num_warps": 8, "num_stages": 2}
    if block_d <= 64:
        return {"BLOCK_M": min(128, fit), "BLOCK_N": min(64, fit), "BLOCK_D": block_d, "num_warps": 4,
                "num_stages": 3}
    if block_d <= 128:
        return {"BLOCK_M": min(128, fit), "BLOCK_N": min(64, fit), "BLOCK_D": block_d, "num_warps": 8,
                "num_stages": 2}
    return {"BLOCK_M": min(64, fit), "BLOCK_N": min(32, fit), "BLOCK_D": block_d, "num_warps": 8, "num_stages": 2}


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


MAX_GRID_BATCH = 65535


def supports(q, k, v, cu_seqlens=None, max_seqlen=None, key_padding_mask=None, scale=None,
             window=None, dropout_p=0.0, dropout_seed=0) -> str | None:
    head_dim = q.shape[-1]
    batch = cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]
    return first_reason(
        device_reason([q, k, v, cu_seqlens, key_padding_mask]),
        float_reason([q, k, v]),
        None if head_dim % 8 == 0 and 8 <= head_dim <= MAX_HEAD_DIM else
        f"head_dim {head_dim} not supported (multiples of 8 up to {MAX_HEAD_DIM})",
        # the batch is grid axis 1, which CUDA caps at 65535 programs
        f"batch {batch} exceeds {MAX_GRID_BATCH} sequences per call" if batch > MAX_GRID_BATCH else None,
        "dropout_p > 0: this kernel has no dropout yet" if dropout_p > 0 else None,
    )


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
            max_seqlen: int | None, key_padding_mask: torch.Tensor | None, scale: float | None,
            window: int | None = None, dropout_p: float = 0.0, dropout_seed: int = 0) -> torch.Tensor:
    if dropout_p > 0:
        raise ValueError("fastbert triton attention: no dropout in this kernel yet (dropout_p > 0)")
    if window is not None and window < 0:
        raise ValueError(f"fastbert triton attention: window must be >= 0 (the total width), got {window}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    max_seqlen = 0 if max_seqlen is None else max_seqlen
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.numel() == 0:
        return out
    packed = cu_seqlens is not None
    if packed:  # view packed [T, h, D] as [1, T, h, D]: the batch stride is never used
        q4, k4, v4, o4 = (t.unsqueeze(0) for t in (q, k, v, out))
        batch, longest = cu_seqlens.numel() - 1, max_seqlen
    else:
        q4, k4, v4, o4 = q, k, v, out
        batch, longest = q.shape[0], q.shape[1]
    heads, head_dim = q.shape[-2], q.shape[-1]
    if longest == 0 or batch == 0:
        return out.zero_()
    mask = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else q4  # q4: an unread placeholder
    mask_strides = key_padding_mask.stride() if key_padding_mask is not None else (0, 0)
    # A window reaching every key of the longest sequence is global attention: the kernel without the band.
    window_half = window // 2 if window is not None and window // 2 < longest - 1 else None
    meta = _meta(head_dim, longest, q.dtype, window=window_half is not None)
    if not INTERPRETER and meta["BLOCK_M"] == 128 and triton.cdiv(longest, 128) * batch * heads < _sm_count(q.device):
        meta["BLOCK_M"] = 64  # small batches: more, shorter programs to occupy the SMs
    grid = (triton.cdiv(longest, meta["BLOCK_M"]), batch, heads)
    _attention_kernel[grid](
        q4, *q4.stride(), k4, *k4.stride(), v4, *v4.stride(), o4, *o4.stride(),
        cu_seqlens.contiguous() if packed else q4, mask, *mask_strides,
        q4.shape[1], head_dim, scale * LOG2E, 0 if window_half is None else window_half,
        PACKED=packed, HAS_MASK=key_padding_mask is not None, WINDOW=window_half is not None,
        INPUT_PRECISION=dot_precision(q.dtype),
        DOT_IN_FP32=dot_in_fp32(q.dtype), **meta)
    return out


# torch.ops.fastbert.triton_attention: schema and fake from the op's spec.
_op = SPEC.define("triton_", _launch)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
              max_seqlen: int | None = None, key_padding_mask: torch.Tensor | None = None,
              scale: float | None = None, window: int | None = None, dropout_p: float = 0.0,
              dropout_seed: int = 0) -> torch.Tensor:
    """The triton backend of `fastbert.ops.attention` (forms and limits in the module docstring)."""
    # Defaults are the launcher's (the schema takes None); Python numbers are normalised for the op's int/float.
    scale = None if scale is None else float(scale)
    longest = None if max_seqlen is None else int(max_seqlen)
    window = None if window is None else int(window)
    return torch.ops.fastbert.triton_attention(q, k, v, cu_seqlens, longest, key_padding_mask, scale, window,
                                               float(dropout_p), int(dropout_seed))
