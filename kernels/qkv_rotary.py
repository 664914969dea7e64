"""QKV projection with the rotary position embedding of q and k in the GEMM's epilogue (ModernBERT's attention input).

out = x @ Wqkv^T (+ bias), then each head vector of q and k (the first 2 * heads * D columns) rotated at its token's
position: out[:D/2] = u1 * cos - u2 * sin, out[D/2:] = u2 * cos + u1 * sin (transformers' rotate_half form), v left
as it is. A rotation pairs column j of a head with column j + D/2, so each program computes its tile as two
accumulators: BLOCK_C "pairs" (a pair p is column (p // (D/2)) * D + p % (D/2) and the column D/2 after it), the
first halves in one accumulator and the second halves in the other, from two loads of weight rows per K step. The
epilogue then has both partners of every pair in registers: bias, the rotation in fp32 with the fp32 cos/sin of each
row's position, one rounding at the store. The tile is as large as the shared GEMM's (`gemm.py`: BLOCK_C = BLOCK_N
/ 2, the same autotuning and tables), and any head_dim that is even works (no power-of-two constraint on D).

The output is one [..., 3 * heads * D] buffer; q, k, v are returned as its [..., heads, D] views, the layout the
triton attention kernel reads (as `qkv_projection`'s). Positions outside [0, P) are not read from the tables (the
rows they would touch get cos = 1, sin = 0): the functional entry `fastbert.ops.qkv_rotary` raises on them before
dispatching; the launcher does not check, which would synchronise with the GPU.
Shapes: x [..., H] (any strides when 2-D), weight [3 * heads * D, H] (any strides), bias [3 * heads * D] | None,
positions int32/int64 [...] (x's leading shape), cos/sin float32 [P, D/2] (unit column stride) -> 3 x [..., heads, D].
fp16, bf16, fp32 (fp32 without TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastbert.ops.qkv_rotary import SPEC, qkv_rotary_reference, split_packed

from . import gemm
from .common import (
    INTERPRETER,
    cast_rtne,
    device_reason,
    dot_in_fp32,
    dot_precision,
    first_reason,
    float_reason,
    next_power_of_2,
)

__all__ = ["qkv_rotary", "qkv_rotary_reference", "supports"]


@triton.jit
def _qkv_rotary_kernel(
    x_ptr,  # [M, K] input rows, strides (stride_xm, stride_xk)
    w_ptr,  # [N, K] Wqkv in nn.Linear layout (rows q | k | v, heads of D rows inside each), strides (stride_wn, _wk)
    bias_ptr,  # [N] (ignored unless HAS_BIAS)
    positions_ptr,  # [M] int32/int64, contiguous: each row's position within its own sequence
    cos_ptr,  # [P, HALF] float32, rows stride_tp apart, unit column stride
    sin_ptr,  # [P, HALF] float32, same strides as cos
    out_ptr,  # [M, N] output, strides (stride_om, stride_on)
    M, N, K,
    rotated_cols,  # 2 * heads * D: columns below it (q and k) are rotated, the rest (v) only projected
    max_positions,  # P, the tables' rows
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_tp,
    stride_om, stride_on,
    m_bucket,  # power-of-two bucket of M: only an autotune key (token counts that vary per batch share tunings)
    HALF: tl.constexpr,  # head_dim / 2: the distance between the two columns of a pair
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: see `common.INTERPRETER`
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,  # pairs of columns per tile: the tile covers 2 * BLOCK_C output columns
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One BLOCK_M x (2 BLOCK_C) output tile of the packed QKV projection, as BLOCK_C column pairs (d, d + D/2) of
    one head: both halves' products in one K loop (`gemm.k_loop_pair`), then bias and, for q and k, the rotation by
    each token's position. One GPU program for both halves because their two accumulators meet only in the
    rotation before the store."""
    pairs = N // 2
    pid_m, pid_c = gemm.grouped_tile(M, pairs, BLOCK_M, BLOCK_C, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)  # pair indices
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    p_mask = offs_p < pairs
    freq = offs_p % HALF  # the pair's index within its head half: its column of the cos/sin tables
    col_first = (offs_p // HALF) * (2 * HALF) + freq  # first-half column; its partner is HALF columns later
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_first = w_ptr + col_first[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_C] of W^T
    w_second = w_first + HALF * stride_wn
    zeros = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    acc_first, acc_second = gemm.k_loop_pair(zeros, zeros, x_ptrs, w_first, w_second, m_mask, p_mask, offs_k, K,
                                             stride_xk, stride_wk, INPUT_PRECISION, DOT_IN_FP32, BLOCK_K)

    if HAS_BIAS:
        acc_first += tl.load(bias_ptr + col_first, mask=p_mask, other=0.0).to(tl.float32)[None, :]
        acc_second += tl.load(bias_ptr + col_first + HALF, mask=p_mask, other=0.0).to(tl.float32)[None, :]

    # Rotation: v's columns (and rows whose position is outside the tables) load cos = 1, sin = 0.
    positions = tl.load(positions_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    row_ok = m_mask & (positions >= 0) & (positions < max_positions)
    table_mask = row_ok[:, None] & (p_mask & (col_first < rotated_cols))[None, :]
    table_offs = positions[:, None] * stride_tp + freq[None, :]
    cos = tl.load(cos_ptr + table_offs, mask=table_mask, other=1.0)
    sin = tl.load(sin_ptr + table_offs, mask=table_mask, other=0.0)
    out_first = acc_first * cos - acc_second * sin
    out_second = acc_second * cos + acc_first * sin

    out_mask = m_mask[:, None] & p_mask[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + col_first[None, :] * stride_on
    tl.store(out_ptrs, cast_rtne(out_first, out_ptr.dtype.element_ty), mask=out_mask)
    tl.store(out_ptrs + HALF * stride_on, cast_rtne(out_second, out_ptr.dtype.element_ty), mask=out_mask)


def pair_config(config: triton.Config) -> triton.Config:
    """A shared-GEMM config (`gemm.py`) for this kernel: the same BLOCK_M x BLOCK_N output tile, as BLOCK_N / 2
    pairs of columns."""
    meta = dict(config.kwargs)
    meta["BLOCK_C"] = meta.pop("BLOCK_N") // 2
    return triton.Config(meta, num_warps=config.num_warps, num_stages=config.num_stages)


def gpu_configs(dtype: torch.dtype) -> list[triton.Config]:
    """The configs the autotuner times for inputs of this dtype (the shared GEMM's, as pairs)."""
    return [pair_config(c) for c in gemm.gpu_configs(dtype)]


def _prune_by_dtype(configs, named_args, **kwargs):
    return gemm.keep_configs(configs, gpu_configs(named_args["x_ptr"].dtype))


_ALL_CONFIGS = gemm.unique_configs(gpu_configs(torch.float16) + gpu_configs(torch.float32))
_autotuned = None if INTERPRETER else triton.autotune(
    configs=_ALL_CONFIGS, key=["m_bucket", "N", "K", "HALF", "HAS_BIAS"],
    prune_configs_by={"early_config_prune": _prune_by_dtype})(_qkv_rotary_kernel)


def table_meta(m: int, dtype: torch.dtype) -> dict:
    """`gemm.table_config(m, dtype)` as pairs, as launch keywords (FASTBERT_TRITON_AUTOTUNE=0)."""
    return gemm.launch_meta(pair_config(gemm.table_config(m, dtype)))


def interpreter_meta(m: int) -> dict:
    meta = dict(gemm.interpreter_config(m))
    meta["BLOCK_C"] = meta.pop("BLOCK_N") // 2
    return meta


def table_reason(cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the rotary kernels cannot read these cos/sin tables (float32, unit column strides, one row stride), or
    None: the check of this op's and the vendor backend's `supports`."""
    return first_reason(
        None if cos.dtype == sin.dtype == torch.float32 else f"cos/sin tables must be float32, got {cos.dtype}",
        None if cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
        else "cos/sin tables need unit column strides and one row stride",
    )


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = gemm.as_rows(x)
    n, k = weight.shape
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    head_dim = n // (3 * num_heads)
    if k == 0 or head_dim * 3 * num_heads != n or head_dim % 2 or cos.shape[-1] != head_dim // 2:
        raise ValueError(f"qkv_rotary (triton): needs K > 0, weight [3 * {num_heads} * even D, K] and cos/sin "
                         f"[P, D/2]; got weight {tuple(weight.shape)}, cos {tuple(cos.shape)}")
    positions = positions.reshape(-1).contiguous()
    bias = bias.contiguous() if bias is not None else None  # the epilogue reads it with unit stride
    args = (rows, weight, bias if bias is not None else out, positions, cos, sin, out, m, n, k,
            2 * num_heads * head_dim, cos.shape[0], rows.stride(0), rows.stride(1), weight.stride(0),
            weight.stride(1), cos.stride(0), out.stride(0), out.stride(1), next_power_of_2(m))
    flags = {"HALF": head_dim // 2, "HAS_BIAS": bias is not None, "INPUT_PRECISION": dot_precision(x.dtype),
             "DOT_IN_FP32": dot_in_fp32(x.dtype)}
    gemm.launch_tiled(_qkv_rotary_kernel, _autotuned, m, n // 2, args, flags,
                      lambda: interpreter_meta(m) if INTERPRETER else table_meta(m, x.dtype), column_block="BLOCK_C")
    return out.view(*x.shape[:-1], n)


# torch.ops.fastbert.triton_qkv_rotary (into the packed [..., 3H] buffer): schema and fake from the op's spec.
_op = SPEC.define("triton_", _launch)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
             positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    tensors = [x, weight, bias]
    return first_reason(
        device_reason([*tensors, positions, cos, sin]),
        float_reason(tensors),
        table_reason(cos, sin),
        "K = 0 (empty reduction)" if weight.shape[1] == 0 else None,
    )


def qkv_rotary(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
               positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v), q and k rotated, each a [..., heads, D] view of one [..., 3, heads, D] buffer (the triton backend
    of `fastbert.ops.qkv_rotary`)."""
    return split_packed(torch.ops.fastbert.triton_qkv_rotary(x, weight, bias, positions, cos, sin, num_heads),
                        num_heads)
