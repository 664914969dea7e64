"""Attention, flash style: softmax(q k^T * scale) v computed block by block with an online softmax in fp32, its
backward in the same style, and dropout on the probabilities inside both.

Forms (one kernel for both, in each direction):
- packed variable-length: q, k, v [T, heads, D] with int32 `cu_seqlens` [B + 1] and `max_seqlen`; a token
  attends only within its own sequence;
- padded: q, k, v [B, S, heads, D] with an optional bool `key_padding_mask` [B, S] (True = real key).
q, k, v are read through their strides (the [T, 3, heads, D] views `qkv_projection` returns need no copy).
The head dim is padded to a power-of-two block with masking: D is any multiple of 8 from 8 to 256 (32, 64, 80,
96, 128 are the BERT-family sizes). Any sequence length (keys are streamed in blocks). A query whose keys are all
masked gets zeros, never NaN (running max kept finite, zero denominator -> zero output). K and V at masked keys are
never loaded, so NaN or Inf stored there never reaches a real query's output nor any gradient.
Output: contiguous, shaped like q, in q's dtype. fp16, bf16, fp32 (fp32 dots in IEEE, no TF32).
Sliding window (`window`, ModernBERT's local_attention, see fastbert.ops.attention): a query at position i attends
the keys j with |i - j| <= window // 2 (positions within its sequence). A query block's key loop runs only over the
key blocks its rows' windows reach (from the first one touching m_start - window // 2 to m_end + window // 2), so a
local layer costs about S * window; inside those blocks the band is masked per element. A window reaching every key
launches the global kernel. A query whose window holds no real key gets zeros.
Packed form contract (not checked: it would cost a device sync): cu_seqlens[-1] == T and max_seqlen >= the
longest sequence; rows outside that are left unwritten. Grid: (query or key blocks, batch <= 65535, heads).

Dropout (`dropout_p` > 0): each probability is kept with probability 1 - p and kept ones are scaled by 1 / (1 - p)
(the softmax's normaliser sums the undropped probabilities, as `torch.nn.functional.dropout` after softmax does).
The keep decision of the pair (query i, key j) of sequence b and head h is a 16-bit draw >= p * 2^16 (`_kept`): one
Philox4x32-10 call (`tl.philox`, keyed by `dropout_seed`) on the counter (j // 8, i, b * heads + h, 0) gives the
draws of 8 neighbouring keys (FlashAttention's CUDA kernels split their words into 8-bit draws; 16 bits keep p's
rounding below 2^-17, while an RNG call per element would cost several times the tile's matrix products in integer
instructions). A unique counter per (sequence, head, query, key group) of the padded layout: the mask is a pure
function of those and of the seed, so the backward kernels, which walk the pairs in other tiles and orders,
regenerate exactly the forward's mask, and the packed and padded forms of the same batch draw the same one. (32-bit
counter words rather than one 64-bit offset: no 64-bit [BLOCK, BLOCK] index tiles, no limit on S * S.) The mask is
not eager's `keep_mask` (another RNG): equal in law, not in value.

Backward (the torch op's autograd formula, `_backward`, itself the torch op `triton_attention_backward` so
`torch.compile` traces it): FlashAttention-2's, in two kernels, nothing [S, S] stored.
- LSE: the forward does not hand its log-sum-exp over (its torch op returns only the output, whose schema is the
  spec's), so the first backward kernel recomputes it: per query block, one pass over the keys for the row max and
  sum (q k^T only, no P v), then the dq pass. That is one extra q k^T per tile, about 1/8 of the backward's
  matrix products, against a second output and a changed schema for every caller of the forward.
- kernel 1 (per query block): delta = rowsum(dO * O) (the forward's output, saved; with dropout still equal to
  rowsum(P * dP), so no extra pass), LSE, then dq = sum_j dS k_j * scale with dS = P * (dP - delta),
  dP = (dO v^T) * keep / (1 - p); it writes LSE (log2 domain) and delta, fp32 [B, heads, max_seqlen], for
- kernel 2 (per key block): dv = sum_i (P * keep / (1 - p))^T dO and dk = sum_i dS^T q * scale, over the query
  blocks whose windows reach the key block, tiles computed transposed ([keys, queries]) so no tile is transposed.
dq, dk, dv accumulate in fp32; P and dS are rounded to the input dtype before their products (tensor-core
operands), as in the forward. A row without any key has LSE = +inf, so P = 0 and it sends nothing; masked keys get
dk = dv = 0 stored whatever the query rows held. Padded query rows (padded form) are computed as the forward
computes them: as with the eager op's gradient, a NaN stored in q at a padded position reaches the real keys' dk
and dv (what the model stores there is finite: padding tokens' hidden states).

Block sizes (GPU; the interpreter runs the same kernels with 64-blocks capped at the sequence length): `_meta`
(forward) and `_backward_meta`. sm_90 gives a block up to 227 KB of shared memory and 255 registers per thread. A
backward program keeps `resident` rows (inputs plus fp32 [rows, D] accumulators: one for dq, two for dk/dv) and
streams tiles of the other side, double-buffered; at D = 128 fp16 that is ~66 KB of shared memory, far under the
limit, so registers decide: 64 resident x 32 streamed rows in fp16/bf16 (64 x 64 spilled at D >= 80), 8 warps
above D = 64 or with a window or dropout (the band mask and the Philox words of the score tile), and with those
dk/dv streams 16 queries at D = 128 and keeps 16 keys at D = 256; fp32 32 x 16 (IEEE dots keep operands in
registers); D = 256 halves the resident rows. Dropout also moves the fp16/bf16 forward to 64 queries on 8 warps.
tools/compile_sm90.py compiles every one of these configs for sm_90 (no GPU needed) and fails on a spill or
on shared memory over the limit. On a GPU (an H200, benchmarks/results/h200-gpu-check) the forward's checks have run,
packed and padded, without a window or dropout; the backward, windows and dropout are checked in the interpreter only.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fastbert.ops.attention import SPEC, attention_reference
from fastbert.ops.dropout import keep_scale

from .common import (
    INTERPRETER,
    cast_rtne,
    cdiv,
    define_kernel_op,
    device_reason,
    dot_in_fp32,
    dot_precision,
    first_reason,
    float_reason,
    launch,
    next_power_of_2,
    sm_count,
)

__all__ = ["attention", "attention_reference", "supports"]

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
DRAW_RANGE = 1 << 16  # dropout draws are 16-bit: p acts rounded to a multiple of 2^-16


# ------------------------------------------------------------------------------------------- shared pieces
@triton.jit
def _sequence(cu_seqlens_ptr, batch, seqlen, PACKED: tl.constexpr):
    """(first row, index along the batch stride, length) of sequence ``batch``: packed tensors are [1, T, h, D] views
    whose sequence starts at cu_seqlens[batch]; padded ones hold it at [batch] with S rows."""
    if PACKED:
        start = tl.load(cu_seqlens_ptr + batch).to(tl.int64)
        length = tl.load(cu_seqlens_ptr + batch + 1).to(tl.int64) - start
        return start, batch * 0, length
    return batch * 0, batch, seqlen + batch * 0


@triton.jit
def _real_keys(keys, length, mask_ptr, batch, stride_mb, stride_ms, HAS_MASK: tl.constexpr):
    """Which of ``keys`` (positions in the sequence) exist and are not padding."""
    valid = keys < length
    if HAS_MASK:
        real = tl.load(mask_ptr + batch * stride_mb + keys * stride_ms, mask=valid, other=0)
        valid = valid & (real != 0)
    return valid


@triton.jit
def _band(row_start, col_start, window_half, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS]: |(row_start + r) - (col_start + c)| <= window_half, from block-local int32 offsets (64-bit
    [ROWS, COLS] indices would spill on sm_90). Symmetric: rows may be queries or keys."""
    shift = (row_start - col_start).to(tl.int32)
    return tl.abs(tl.arange(0, ROWS)[:, None] - tl.arange(0, COLS)[None, :] + shift) <= window_half


@triton.jit
def _window_reach(start, window_half, length, SIZE: tl.constexpr, STEP: tl.constexpr):
    """[begin, end) of the positions the windows of rows start .. start + SIZE - 1 reach (within ``length``), begin
    rounded down to a multiple of STEP, the block size of the side being walked. Symmetric: the rows may be queries
    (walking keys) or keys (walking queries)."""
    return tl.maximum(start - window_half, 0) // STEP * STEP, tl.minimum(start + SIZE + window_half, length)


@triton.jit
def _kept(seed, slab, m_start, n_start, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Bool [BLOCK_M, BLOCK_N]: the dropout keep decisions of queries m_start + i and keys n_start + j (n_start a
    multiple of 8) of sequence-and-head ``slab`` (b * heads + h): a 16-bit draw >= ``threshold`` (p * 2^16). One
    Philox4x32-10 call on the counter (key // 8, query, slab, 0) gives the eight 16-bit draws of keys 8g .. 8g + 7
    (draw v: half v % 2 of word v // 2): the same pair gets the same draw in every kernel and tile."""
    queries = (m_start + tl.arange(0, BLOCK_M)).to(tl.uint32)
    groups = (n_start // 8 + tl.arange(0, BLOCK_N // 8)).to(tl.uint32)
    zero = tl.zeros((BLOCK_M, BLOCK_N // 8), dtype=tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, zero + groups[None, :], zero + queries[:, None], zero + slab.to(tl.uint32), zero)
    # Joined innermost-first by the draw's bit of weight 4, then 2, then 1: the row-major reshape then puts draw v of
    # group g at key 8 g + v.
    by_4 = tl.join(tl.join(w0 & 0xFFFF, w2 & 0xFFFF), tl.join(w1 & 0xFFFF, w3 & 0xFFFF))  # draws 0 4 2 6 -> [., 2, 2]
    odd = tl.join(tl.join(w0 >> 16, w2 >> 16), tl.join(w1 >> 16, w3 >> 16))  # draws 1 5 3 7
    draws = tl.reshape(tl.join(by_4, odd), (BLOCK_M, BLOCK_N))
    return draws.to(tl.int32) >= threshold


# ------------------------------------------------------------------------------------------------- forward
@triton.jit
def _attention_kernel(
    q_ptr, stride_qb, stride_qs, stride_qh, stride_qd,  # q [B, S, heads, D] (packed form: [1, T, heads, D])
    k_ptr, stride_kb, stride_ks, stride_kh, stride_kd,  # k, same layout as q
    v_ptr, stride_vb, stride_vs, stride_vh, stride_vd,  # v, same layout as q
    out_ptr, stride_ob, stride_os, stride_oh, stride_od,  # output, same layout as q
    cu_seqlens_ptr,  # int32 [B + 1] sequence starts in the packed token dim (PACKED only)
    mask_ptr, stride_mb, stride_ms,  # uint8 [B, S] key padding mask, 1 = real key (HAS_MASK only)
    seqlen,  # padded form: S
    head_dim,
    qk_scale,  # softmax scale * log2(e): scores go straight to exp2
    window_half,  # WINDOW only: a query attends keys at most this many positions away
    dropout_threshold, dropout_scale, dropout_seed,  # DROPOUT only: p * 2^16 (`_kept`), 1 / (1 - p), Philox key
    PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: see `common.INTERPRETER`
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (query block, sequence, head): the online-softmax attention of BLOCK_M query rows over the keys they may
    see (their sequence's real keys, inside the window when WINDOW), dropout on the probabilities when DROPOUT.
    Long on purpose: one GPU program whose state (running max and sum, the output accumulator) stays in registers
    across the key loop; helpers would only move the pointer arithmetic into argument lists."""
    block_m = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    # (Written out rather than with `_sequence`: the padded form's int32 length keeps the key loop in 32 bits, which
    # the fp16 D = 64 and fp32 configs need to stay clear of spills on sm_90.)
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
    slab = batch * tl.num_programs(2) + head  # dropout counter: (sequence, head)

    m_start = block_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
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
    key_begin, key_end = 0, length
    if WINDOW:  # only the key blocks some row's window reaches
        key_begin, key_end = _window_reach(m_start, window_half, length, BLOCK_M, BLOCK_N)
    for key_start in range(key_begin, key_end, BLOCK_N):
        keys = key_start + offs_n
        key_valid = _real_keys(keys, length, mask_ptr, batch, stride_mb, stride_ms, HAS_MASK)
        # Masked keys are not loaded (zeros instead): a zero probability times a NaN or Inf in V is still NaN.
        kv_mask = key_valid[:, None] & d_mask[None, :]
        k = tl.load(k_base + keys[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        allowed = key_valid[None, :]
        if WINDOW:
            allowed = allowed & _band(m_start, key_start, window_half, BLOCK_M, BLOCK_N)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # While every key seen so far is masked the max is -inf; subtract 0 then so exp2 gives 0, not NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.math.exp2(scores - safe_max[:, None])
        correction = tl.math.exp2(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)  # the normaliser counts dropped probabilities too
        if DROPOUT:
            probs = tl.where(_kept(dropout_seed, slab, m_start, key_start, dropout_threshold, BLOCK_M, BLOCK_N),
                             probs, 0.0)
        # P is rounded to the input dtype before P @ V (tensor-core operands), then widened again if DOT_IN_FP32.
        probs_in = cast_rtne(probs, v_ptr.dtype.element_ty).to(v.dtype)
        acc = acc * correction[:, None] + tl.dot(probs_in, v, input_precision=INPUT_PRECISION)
        row_max = new_max
    if DROPOUT:
        acc = acc * dropout_scale
    out = tl.where(row_sum[:, None] > 0, acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None], 0.0)
    out_ptrs = out_base + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(out_ptrs, cast_rtne(out, out_ptr.dtype.element_ty), mask=q_mask)


# ------------------------------------------------------------------------------------------------ backward
@triton.jit
def _attention_backward_dq_kernel(
    q_ptr, stride_qb, stride_qs, stride_qh, stride_qd,  # q [B, S, heads, D] (packed form: [1, T, heads, D])
    k_ptr, stride_kb, stride_ks, stride_kh, stride_kd,  # k, same layout as q
    v_ptr, stride_vb, stride_vs, stride_vh, stride_vd,  # v, same layout as q
    out_ptr, stride_ob, stride_os, stride_oh, stride_od,  # the forward's output O, same layout as q
    do_ptr, stride_gb, stride_gs, stride_gh, stride_gd,  # dL/dO, same layout as q (any strides, even 0)
    dq_ptr, stride_dqb, stride_dqs, stride_dqh, stride_dqd,  # dL/dq (written), same layout as q
    lse_ptr, delta_ptr,  # fp32 [B, heads, rows] contiguous (written): log2-sum-exp2 of each row, rowsum(dO * O)
    cu_seqlens_ptr,  # int32 [B + 1] (PACKED only)
    mask_ptr, stride_mb, stride_ms,  # uint8 [B, S] key padding mask (HAS_MASK only)
    seqlen,  # padded form: S
    rows,  # the LSE / delta row count: S, or max_seqlen
    head_dim,
    qk_scale,  # softmax scale * log2(e)
    scale,  # softmax scale (dS -> dq)
    window_half,  # WINDOW only
    dropout_threshold, dropout_scale, dropout_seed,  # DROPOUT only: as the forward's
    PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (query block, sequence, head) of the backward: delta = rowsum(dO * O), the rows' LSE (pass 1 over the
    keys), then dq accumulated over the key blocks from the recomputed probabilities (pass 2); LSE and delta are
    stored for the dk/dv kernel. Long on purpose, as the forward: one GPU program whose row state and accumulator
    stay in registers across both key loops."""
    block_m = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    first, batch_index, length = _sequence(cu_seqlens_ptr, batch, seqlen, PACKED)
    if block_m * BLOCK_M >= length:
        return
    q_base = q_ptr + batch_index * stride_qb + first * stride_qs + head * stride_qh
    k_base = k_ptr + batch_index * stride_kb + first * stride_ks + head * stride_kh
    v_base = v_ptr + batch_index * stride_vb + first * stride_vs + head * stride_vh
    slab = batch * tl.num_programs(2) + head

    m_start = block_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    row_valid = offs_m < length
    q_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    d_out = tl.load(do_ptr + batch_index * stride_gb + first * stride_gs + head * stride_gh
                    + offs_m[:, None] * stride_gs + offs_d[None, :] * stride_gd, mask=q_mask, other=0.0)
    out = tl.load(out_ptr + batch_index * stride_ob + first * stride_os + head * stride_oh
                  + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od, mask=q_mask, other=0.0)
    delta = tl.sum(d_out.to(tl.float32) * out.to(tl.float32), axis=1)  # = rowsum(P * dP), dropout or not
    if DOT_IN_FP32:
        q = q.to(tl.float32)
        d_out = d_out.to(tl.float32)
    key_begin, key_end = 0, length
    if WINDOW:
        key_begin, key_end = _window_reach(m_start, window_half, length, BLOCK_M, BLOCK_N)

    # Pass 1: the row max and sum of exp2, as the forward's online softmax (scores only).
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for key_start in range(key_begin, key_end, BLOCK_N):
        keys = key_start + offs_n
        key_valid = _real_keys(keys, length, mask_ptr, batch, stride_mb, stride_ms, HAS_MASK)
        k = tl.load(k_base + keys[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                    mask=key_valid[:, None] & d_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        allowed = key_valid[None, :]
        if WINDOW:
            allowed = allowed & _band(m_start, key_start, window_half, BLOCK_M, BLOCK_N)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.math.exp2(row_max - safe_max) + tl.sum(tl.math.exp2(scores - safe_max[:, None]), 1)
        row_max = new_max
    # A row without any key: +inf, so that exp2(score - lse) is 0 for every key in both kernels.
    lse = tl.where(row_sum > 0, row_max + tl.math.log2(tl.where(row_sum > 0, row_sum, 1.0)), float("inf"))

    # Pass 2: dq = sum over keys of dS k, dS = P * (dP - delta).
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for key_start in range(key_begin, key_end, BLOCK_N):
        keys = key_start + offs_n
        key_valid = _real_keys(keys, length, mask_ptr, batch, stride_mb, stride_ms, HAS_MASK)
        kv_mask = key_valid[:, None] & d_mask[None, :]
        k = tl.load(k_base + keys[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        allowed = key_valid[None, :]
        if WINDOW:
            allowed = allowed & _band(m_start, key_start, window_half, BLOCK_M, BLOCK_N)
        probs = tl.where(allowed, tl.math.exp2(scores - lse[:, None]), 0.0)
        grad_probs = tl.dot(d_out, tl.trans(v), input_precision=INPUT_PRECISION)
        if DROPOUT:
            kept = _kept(dropout_seed, slab, m_start, key_start, dropout_threshold, BLOCK_M, BLOCK_N)
            grad_probs = tl.where(kept, grad_probs * dropout_scale, 0.0)
        # A probability of exactly 1 (a row's only key, or one that takes all the mass in fp32) has a zero softmax
        # gradient (p (1 - p) = 0, the others' share is below fp32's resolution); computing it as such makes a
        # one-key row's gradient exactly 0, as the eager op's, instead of the rounding noise of dP - delta.
        grad_scores = tl.where(probs == 1.0, 0.0, probs * (grad_probs - delta[:, None]))
        grad_scores_in = cast_rtne(grad_scores, k_ptr.dtype.element_ty).to(k.dtype)
        dq += tl.dot(grad_scores_in, k, input_precision=INPUT_PRECISION)
    dq = dq * scale
    tl.store(dq_ptr + batch_index * stride_dqb + first * stride_dqs + head * stride_dqh
             + offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd,
             cast_rtne(dq, dq_ptr.dtype.element_ty), mask=q_mask)
    stats = slab * rows + offs_m
    tl.store(lse_ptr + stats, lse, mask=row_valid)
    tl.store(delta_ptr + stats, delta, mask=row_valid)


@triton.jit
def _attention_backward_dkdv_kernel(
    q_ptr, stride_qb, stride_qs, stride_qh, stride_qd,  # q [B, S, heads, D] (packed form: [1, T, heads, D])
    k_ptr, stride_kb, stride_ks, stride_kh, stride_kd,  # k, same layout as q
    v_ptr, stride_vb, stride_vs, stride_vh, stride_vd,  # v, same layout as q
    do_ptr, stride_gb, stride_gs, stride_gh, stride_gd,  # dL/dO, same layout as q
    dk_ptr, stride_dkb, stride_dks, stride_dkh, stride_dkd,  # dL/dk (written), same layout as q
    dv_ptr, stride_dvb, stride_dvs, stride_dvh, stride_dvd,  # dL/dv (written), same layout as q
    lse_ptr, delta_ptr,  # fp32 [B, heads, rows]: what the dq kernel wrote
    cu_seqlens_ptr,  # int32 [B + 1] (PACKED only)
    mask_ptr, stride_mb, stride_ms,  # uint8 [B, S] key padding mask (HAS_MASK only)
    seqlen, rows, head_dim, qk_scale, scale, window_half,  # as the dq kernel's
    dropout_threshold, dropout_scale, dropout_seed,
    PACKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    WINDOW: tl.constexpr,
    DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per step of the loop
    BLOCK_N: tl.constexpr,  # keys of this program
    BLOCK_D: tl.constexpr,
):
    """One (key block, sequence, head) of the backward: streams the query blocks that may see these keys,
    recomputes their probabilities from the stored LSE and delta, and accumulates dk and dv. Long on purpose, as the
    forward: one GPU program whose two accumulators stay in registers across the query loop."""
    block_n = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    first, batch_index, length = _sequence(cu_seqlens_ptr, batch, seqlen, PACKED)
    if block_n * BLOCK_N >= length:
        return
    q_base = q_ptr + batch_index * stride_qb + first * stride_qs + head * stride_qh
    do_base = do_ptr + batch_index * stride_gb + first * stride_gs + head * stride_gh
    slab = batch * tl.num_programs(2) + head

    n_start = block_n * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    key_valid = _real_keys(offs_n, length, mask_ptr, batch, stride_mb, stride_ms, HAS_MASK)
    kv_mask = key_valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + batch_index * stride_kb + first * stride_ks + head * stride_kh
                + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + batch_index * stride_vb + first * stride_vs + head * stride_vh
                + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    query_begin, query_end = 0, length
    if WINDOW:  # only the query blocks whose windows reach these keys
        query_begin, query_end = _window_reach(n_start, window_half, length, BLOCK_N, BLOCK_M)

    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for query_start in range(query_begin, query_end, BLOCK_M):
        queries = query_start + offs_m
        query_valid = queries < length
        q_mask = query_valid[:, None] & d_mask[None, :]
        q = tl.load(q_base + queries[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
        d_out = tl.load(do_base + queries[:, None] * stride_gs + offs_d[None, :] * stride_gd, mask=q_mask,
                        other=0.0)
        lse = tl.load(lse_ptr + slab * rows + queries, mask=query_valid, other=float("inf"))
        delta = tl.load(delta_ptr + slab * rows + queries, mask=query_valid, other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)
            d_out = d_out.to(tl.float32)
        # Transposed tiles [keys, queries]: P^T and dS^T feed dv and dk without a transpose.
        scores_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale
        allowed = key_valid[:, None] & query_valid[None, :]
        if WINDOW:
            allowed = allowed & _band(n_start, query_start, window_half, BLOCK_N, BLOCK_M)
        probs_t = tl.where(allowed, tl.math.exp2(scores_t - lse[None, :]), 0.0)
        grad_probs_t = tl.dot(v, tl.trans(d_out), input_precision=INPUT_PRECISION)
        if DROPOUT:
            kept_t = tl.trans(_kept(dropout_seed, slab, query_start, n_start, dropout_threshold, BLOCK_M, BLOCK_N))
            dropped_t = tl.where(kept_t, probs_t * dropout_scale, 0.0)
            grad_probs_t = tl.where(kept_t, grad_probs_t * dropout_scale, 0.0)
        else:
            dropped_t = probs_t
        dropped_in = cast_rtne(dropped_t, v_ptr.dtype.element_ty).to(d_out.dtype)
        dv += tl.dot(dropped_in, d_out, input_precision=INPUT_PRECISION)
        grad_scores_t = tl.where(probs_t == 1.0, 0.0, probs_t * (grad_probs_t - delta[None, :]))  # (as in dq's)
        grad_scores_in = cast_rtne(grad_scores_t, q_ptr.dtype.element_ty).to(q.dtype)
        dk += tl.dot(grad_scores_in, q, input_precision=INPUT_PRECISION)
    # Masked keys: zero gradients whatever the query rows held (their K and V were never loaded).
    dk = tl.where(key_valid[:, None], dk * scale, 0.0)
    dv = tl.where(key_valid[:, None], dv, 0.0)
    rows_mask = (offs_n < length)[:, None] & d_mask[None, :]
    tl.store(dk_ptr + batch_index * stride_dkb + first * stride_dks + head * stride_dkh
             + offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd,
             cast_rtne(dk, dk_ptr.dtype.element_ty), mask=rows_mask)
    tl.store(dv_ptr + batch_index * stride_dvb + first * stride_dvs + head * stride_dvh
             + offs_n[:, None] * stride_dvs + offs_d[None, :] * stride_dvd,
             cast_rtne(dv, dv_ptr.dtype.element_ty), mask=rows_mask)


# ------------------------------------------------------------------------------------------------ launchers
def _meta(head_dim: int, max_seqlen: int, dtype: torch.dtype, window: bool = False, dropout: bool = False) -> dict:
    """Forward block sizes: a fixed config under the interpreter, a table by head dim on a GPU (compiled for sm_90
    here, never run). fp32 tiles take twice the shared memory: smaller blocks keep them under A100's 163 KiB too.
    fp32 runs 8 warps at every head dim and 16 keys a block above D = 64: its IEEE dots use FMA units with the
    operands in registers, and at 4 warps and 32 keys they spill on sm_90 (16 KB per thread at D >= 80, see
    benchmarks/results/sm90-resources). A sliding window halves BLOCK_M (64 in fp16/bf16, 32 in fp32): the band
    mask's registers made the full-size tiles spill on sm_90, and shorter query blocks also reach fewer keys outside
    their rows' windows (a block of BLOCK_M rows walks BLOCK_M + window keys for about window useful ones).
    Dropout's Philox state (four uint32 words per element of the [BLOCK_M, BLOCK_N] tile) made fp16/bf16 spill at
    BLOCK_M = 128 or 4 warps: with dropout they run 64 queries on 8 warps."""
    block_d = max(16, next_power_of_2(head_dim))
    fit = max(16, next_power_of_2(max_seqlen))
    if INTERPRETER:
        return {"BLOCK_M": min(64, fit), "BLOCK_N": min(64, fit), "BLOCK_D": block_d}
    meta = _global_meta(block_d, fit, dtype)
    if window:
        meta["BLOCK_M"] = min(meta["BLOCK_M"], 32 if dtype == torch.float32 else 64)
    if dropout and dtype != torch.float32:
        meta.update(BLOCK_M=min(meta["BLOCK_M"], 64), num_warps=8)
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


def _backward_meta(head_dim: int, max_seqlen: int, dtype: torch.dtype, heavy: bool = False) -> tuple[dict, dict]:
    """Backward block sizes: (dq kernel's, dk/dv kernel's). Each program keeps a block of `resident` rows (the dq
    kernel's queries, the dk/dv kernel's keys: their inputs and fp32 [resident, D] accumulators, two of them for
    dk/dv) and streams `streamed` rows of the other side (2 stages: one tile pair loads while the other is used).
    Registers decide (shared memory stays under ~110 KB of the 227 KB): fp16/bf16 64 resident x 32 streamed,
    4 warps up to D = 64 and 8 above or with a window or dropout (``heavy``: the band mask and the Philox words of
    the score tile), which spilled at 64 x 64 (with those, dk/dv streams 16 queries at D = 128 and keeps 16 keys
    at D = 256); fp32 32 x 16 (IEEE dots with operands in registers), and D = 256 halves the resident rows."""
    block_d = max(16, next_power_of_2(head_dim))
    fit = max(16, next_power_of_2(max_seqlen))
    if INTERPRETER:
        resident, streamed, extra = min(64, fit), min(64, fit), {}
    elif dtype == torch.float32:
        resident, streamed = min(16 if block_d > 128 else 32, fit), min(16, fit)
        extra = {"num_warps": 8 if block_d > 32 else 4, "num_stages": 2}
    else:
        resident, streamed = min(32 if block_d > 128 else 64, fit), min(32, fit)
        extra = {"num_warps": 8 if heavy or block_d > 64 else 4, "num_stages": 2}
    dkdv_resident, dkdv_streamed = resident, streamed
    if heavy and block_d >= 128 and dtype != torch.float32 and not INTERPRETER:
        # dk/dv holds twice dq's accumulators; with the band and Philox tiles these spilled on sm_90 otherwise
        dkdv_resident, dkdv_streamed = (min(16, fit), streamed) if block_d > 128 else (resident, min(16, fit))
    return ({"BLOCK_M": resident, "BLOCK_N": streamed, "BLOCK_D": block_d, **extra},
            {"BLOCK_M": dkdv_streamed, "BLOCK_N": dkdv_resident, "BLOCK_D": block_d, **extra})


MAX_GRID_BATCH = 65535


def _limit_reason(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> str | None:
    """Why the kernels cannot take this head width or batch; None when they can."""
    head_dim = q.shape[-1]
    batch = cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]
    if head_dim % 8 != 0 or not 8 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} not supported (multiples of 8 up to {MAX_HEAD_DIM})"
    if batch > MAX_GRID_BATCH:  # the batch is grid axis 1, which CUDA caps at 65535 programs
        return f"batch {batch} exceeds {MAX_GRID_BATCH} sequences per call"
    return None


def _as_4d(packed: bool, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Packed [T, h, D] tensors viewed as [1, T, h, D] (the kernels never use their batch stride); padded as is."""
    return [t.unsqueeze(0) for t in tensors] if packed else list(tensors)


def _common_args(q, cu_seqlens, max_seqlen, key_padding_mask, scale, window):
    """What both directions derive from the arguments: (packed, batch, longest, mask, mask strides, window half
    width or None for global, softmax scale)."""
    if window is not None and window < 0:
        raise ValueError(f"fastbert triton attention: window must be >= 0 (the total width), got {window}")
    limit = _limit_reason(q, cu_seqlens)
    if limit is not None:
        raise ValueError(f"fastbert triton attention: {limit}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    packed = cu_seqlens is not None
    if packed:
        batch, longest = cu_seqlens.numel() - 1, 0 if max_seqlen is None else max_seqlen
    else:
        batch, longest = q.shape[0], q.shape[1]
    mask = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else None
    mask_strides = key_padding_mask.stride() if key_padding_mask is not None else (0, 0)
    # A window reaching every key of the longest sequence is global attention: the kernel without the band.
    window_half = window // 2 if window is not None and window // 2 < longest - 1 else None
    return packed, batch, longest, mask, mask_strides, window_half, scale


def _check_dropout(dropout_p: float) -> None:
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"fastbert triton attention: dropout_p must be in [0, 1], got {dropout_p}")


def _threshold(dropout_p: float) -> int:
    """The 16-bit draw below which `_kept` drops: p * 2^16 rounded (2^16 for p = 1: nothing kept)."""
    return round(dropout_p * DRAW_RANGE)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
            max_seqlen: int | None, key_padding_mask: torch.Tensor | None, scale: float | None,
            window: int | None = None, dropout_p: float = 0.0, dropout_seed: int = 0) -> torch.Tensor:
    _check_dropout(dropout_p)
    packed, batch, longest, mask, mask_strides, window_half, scale = _common_args(
        q, cu_seqlens, max_seqlen, key_padding_mask, scale, window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.numel() == 0:
        return out
    if longest == 0 or batch == 0:
        return out.zero_()
    q4, k4, v4, o4 = _as_4d(packed, q, k, v, out)
    heads, head_dim = q.shape[-2], q.shape[-1]
    meta = _meta(head_dim, longest, q.dtype, window=window_half is not None, dropout=dropout_p > 0)
    if not INTERPRETER and meta["BLOCK_M"] == 128 and cdiv(longest, 128) * batch * heads < sm_count(q.device):
        meta["BLOCK_M"] = 64  # small batches: more, shorter programs to occupy the SMs
    grid = (cdiv(longest, meta["BLOCK_M"]), batch, heads)
    launch(_attention_kernel, grid,
        q4, *q4.stride(), k4, *k4.stride(), v4, *v4.stride(), o4, *o4.stride(),
        cu_seqlens.contiguous() if packed else q4, q4 if mask is None else mask, *mask_strides,  # q4: unread
        q4.shape[1], head_dim, scale * LOG2E, 0 if window_half is None else window_half,
        _threshold(dropout_p), keep_scale(dropout_p), dropout_seed,
        PACKED=packed, HAS_MASK=mask is not None, WINDOW=window_half is not None, DROPOUT=dropout_p > 0,
        INPUT_PRECISION=dot_precision(q.dtype), DOT_IN_FP32=dot_in_fp32(q.dtype), **meta)
    return out


def _launch_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     cu_seqlens: torch.Tensor | None, max_seqlen: int | None, key_padding_mask: torch.Tensor | None,
                     scale: float | None, window: int | None, dropout_p: float,
                     dropout_seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), each shaped like q and in its dtype, of the forward `_launch` with the same arguments and output
    ``out``, given dL/dout ``grad``. Rows the forward leaves unwritten (packed tokens past cu_seqlens[-1]) get zeros."""
    _check_dropout(dropout_p)
    packed, batch, longest, mask, mask_strides, window_half, scale = _common_args(
        q, cu_seqlens, max_seqlen, key_padding_mask, scale, window)
    dq, dk, dv = (torch.zeros(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    if q.numel() == 0 or longest == 0 or batch == 0:
        return dq, dk, dv
    q4, k4, v4, o4, g4, dq4, dk4, dv4 = _as_4d(packed, q, k, v, out, grad, dq, dk, dv)
    heads, head_dim = q.shape[-2], q.shape[-1]
    lse = torch.empty((batch, heads, longest), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse)
    dq_meta, dkdv_meta = _backward_meta(head_dim, longest, q.dtype, window_half is not None or dropout_p > 0)
    shared = dict(
        cu_seqlens_ptr=cu_seqlens.contiguous() if packed else q4, mask_ptr=q4 if mask is None else mask,
        stride_mb=mask_strides[0], stride_ms=mask_strides[1], seqlen=q4.shape[1], rows=longest, head_dim=head_dim,
        qk_scale=scale * LOG2E, scale=scale, window_half=0 if window_half is None else window_half,
        dropout_threshold=_threshold(dropout_p), dropout_scale=keep_scale(dropout_p), dropout_seed=dropout_seed,
        PACKED=packed, HAS_MASK=mask is not None, WINDOW=window_half is not None, DROPOUT=dropout_p > 0,
        INPUT_PRECISION=dot_precision(q.dtype), DOT_IN_FP32=dot_in_fp32(q.dtype))
    launch(_attention_backward_dq_kernel, (cdiv(longest, dq_meta["BLOCK_M"]), batch, heads),
        q4, *q4.stride(), k4, *k4.stride(), v4, *v4.stride(), o4, *o4.stride(), g4, *g4.stride(),
        dq4, *dq4.stride(), lse, delta, **shared, **dq_meta)
    launch(_attention_backward_dkdv_kernel, (cdiv(longest, dkdv_meta["BLOCK_N"]), batch, heads),
        q4, *q4.stride(), k4, *k4.stride(), v4, *v4.stride(), g4, *g4.stride(),
        dk4, *dk4.stride(), dv4, *dv4.stride(), lse, delta, **shared, **dkdv_meta)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------- registration
# torch.ops.fastbert.triton_attention_backward: the backward kernels as one torch op (with a fake), so that
# torch.compile and AOTAutograd trace the backward instead of running kernels on fake tensors.
def _backward_fake(grad, q, k, v, out, cu_seqlens, max_seqlen, key_padding_mask, scale, window, dropout_p,
                   dropout_seed):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


_backward_op = define_kernel_op(
    "triton_attention_backward",
    "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor? cu_seqlens, int? max_seqlen, "
    "Tensor? key_padding_mask, float? scale, int? window, float dropout_p, int dropout_seed) "
    "-> (Tensor, Tensor, Tensor)",
    _launch_backward, _backward_fake)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, key_padding_mask, scale, window, dropout_p, dropout_seed = inputs
    ctx.args = (max_seqlen, scale, window, dropout_p, dropout_seed)
    ctx.save_for_backward(q, k, v, output, cu_seqlens, key_padding_mask)


def _backward(ctx, grad):
    """Gradients of q, k, v from the Triton backward kernels (module docstring); None for the other arguments."""
    q, k, v, out, cu_seqlens, key_padding_mask = ctx.saved_tensors
    max_seqlen, scale, window, dropout_p, dropout_seed = ctx.args
    dq, dk, dv = _backward_op(grad, q, k, v, out, cu_seqlens, max_seqlen, key_padding_mask, scale, window,
                              dropout_p, dropout_seed)
    return dq, dk, dv, None, None, None, None, None, None, None


# torch.ops.fastbert.triton_attention: schema and fake from the op's spec, the Triton backward as its gradient.
_op = SPEC.define("triton_", _launch, setup_context=_setup_context, backward=_backward)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
             max_seqlen: int | None = None, key_padding_mask: torch.Tensor | None = None, scale: float | None = None,
             window: int | None = None, dropout_p: float = 0.0, dropout_seed: int = 0) -> str | None:
    return first_reason(
        device_reason([q, k, v, cu_seqlens, key_padding_mask]),
        float_reason([q, k, v]),
        _limit_reason(q, cu_seqlens),
    )


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
              max_seqlen: int | None = None, key_padding_mask: torch.Tensor | None = None,
              scale: float | None = None, window: int | None = None, dropout_p: float = 0.0,
              dropout_seed: int = 0) -> torch.Tensor:
    """The triton backend of `fastbert.ops.attention` (forms, dropout and limits in the module docstring);
    differentiable through the Triton backward kernels."""
    # Defaults are the launcher's (the schema takes None); Python numbers are normalised for the op's int/float.
    scale = None if scale is None else float(scale)
    longest = None if max_seqlen is None else int(max_seqlen)
    window = None if window is None else int(window)
    return torch.ops.fastbert.triton_attention(q, k, v, cu_seqlens, longest, key_padding_mask, scale, window,
                                               float(dropout_p), int(dropout_seed))
