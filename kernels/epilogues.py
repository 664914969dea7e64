"""Epilogue kernels of the ``vendor`` backend: everything a GEMM-bearing op does after its GEMM, in one pass over the
GEMM's output, when the GEMM itself (with its bias) ran in torch (cuBLAS/cuBLASLt on CUDA, whose bias epilogue
adds the bias to the fp32 accumulator before the one rounding).

- `activate_rows`: act(y) in place ("gelu" exact erf, "gelu_tanh", "relu", "silu": `gemm.activate`, the triton
  GEMM's epilogue function);
- `residual_layernorm_rows`: s = y + residual (fp32, rounded to the dtype as PyTorch rounds the sum), then
  LayerNorm(s) with fp32 statistics (`common.layernorm_tile`, the triton row kernels' function); s is either
  dropped (LayerNorm written over y: linear_residual_layernorm) or written over y with the LayerNorm beside it
  (linear_residual_prenorm: LN is that of s as stored);
- `glu_rows`: act(p[:, :I]) * p[:, I:] of the [M, 2I] projection in fp32, one rounding -> [M, I];
- `rotary_rows`: q and k of the packed [M, 3 * heads * D] projection rotated in place at each row's position (the
  rotate_half form, in fp32 with the fp32 cos/sin tables; v untouched; positions outside the tables rotate by 0,
  as in the triton qkv_rotary kernel: the functional entry refuses them before dispatching).

Limits: the GEMM output (y, p, packed) is a contiguous [M, N] buffer (torch's result); the residual may have any
row stride with unit column stride; rows must fit one block for the LayerNorm (N <= 65536). fp16, bf16, fp32.
Offsets are int64 (pid cast before arithmetic). Launched on torch's current stream through `common.launch` (the
cached launcher every kernel of the package uses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRETER,
    MAX_WIDTH,
    cast_rtne,
    cdiv,
    launch,
    layernorm_tile,
    row_block,
    row_tile,
    row_warps,
    rows_per_program,
    tile_offsets,
)
from .gemm import ACTIVATION_CODES, activate

__all__ = ["MAX_WIDTH", "activate_rows", "glu_rows", "residual_layernorm_rows", "rotary_rows"]


@triton.jit
def _activation_kernel(
    y_ptr,  # [numel] contiguous GEMM output, activated in place
    numel,
    ACTIVATION: tl.constexpr,  # `gemm.ACTIVATION_CODES`: 1 gelu (erf), 2 gelu_tanh, 3 relu, 4 silu
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, cast_rtne(activate(y, ACTIVATION), y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _residual_layernorm_kernel(
    y_ptr,  # [rows, N] contiguous GEMM output (x @ W^T + b); receives the sum when STORE_SUM
    residual_ptr,  # [rows, N] added to y, row stride stride_r (unit column stride)
    out_ptr,  # [rows, N] contiguous: LayerNorm(y + residual); may be y_ptr (in place) unless STORE_SUM
    weight_ptr,  # [N] LayerNorm scale
    bias_ptr,  # [N] LayerNorm shift (ignored unless HAS_BIAS)
    rows, N, stride_r,
    eps,
    HAS_BIAS: tl.constexpr,
    STORE_SUM: tl.constexpr,  # write the rounded sum over y (prenorm's summed output)
    ROWS: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # power of two >= N: one block holds a whole row
):
    offs_r, offs_n, col_mask, mask = row_tile(rows, N, ROWS, BLOCK_N)
    y = tl.load(y_ptr + offs_r[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + offs_r[:, None] * stride_r + offs_n[None, :], mask=mask, other=0.0)
    # rounded to the dtype before the LayerNorm, as PyTorch's sum is: the LayerNorm is that of the stored sum
    summed = cast_rtne(y + residual.to(tl.float32), y_ptr.dtype.element_ty)
    if STORE_SUM:
        tl.store(y_ptr + offs_r[:, None] * N + offs_n[None, :], summed, mask=mask)
    normed = layernorm_tile(summed.to(tl.float32), mask, offs_n, col_mask, weight_ptr, bias_ptr, N, eps, HAS_BIAS)
    tl.store(out_ptr + offs_r[:, None] * N + offs_n[None, :], cast_rtne(normed, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_kernel(
    p_ptr,  # [rows, 2N] contiguous projection: columns [0, N) the input half, [N, 2N) the gate half
    out_ptr,  # [rows, N] contiguous
    rows, N,
    ACTIVATION: tl.constexpr,  # `gemm.ACTIVATION_CODES`
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m, offs_n, _, mask = tile_offsets(rows, N, BLOCK_M, BLOCK_N)
    first = p_ptr + offs_m[:, None] * (2 * N) + offs_n[None, :]
    projected = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(first + N, mask=mask, other=0.0).to(tl.float32)
    result = activate(projected, ACTIVATION) * gate
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], cast_rtne(result, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    packed_ptr,  # [rows, 3 * heads * 2 * HALF] contiguous projection (q | k | v), q and k rotated in place
    positions_ptr,  # [rows] int32/int64 contiguous: each row's position in its own sequence
    cos_ptr,  # [P, HALF] float32, rows stride_tp apart, unit column stride
    sin_ptr,  # [P, HALF] float32, same strides as cos
    rows, N,  # N: the packed row's width, 3 * heads * 2 * HALF
    pairs,  # heads * 2 * HALF: pairs (d, d + HALF) of q and k per row
    max_positions,  # P, the tables' rows
    stride_tp,
    HALF: tl.constexpr,  # head_dim / 2
    ROWS: tl.constexpr,  # rows per program
    BLOCK_P: tl.constexpr,  # pairs per program (a power of two)
):
    pid_r = tl.program_id(0).to(tl.int64)
    pid_p = tl.program_id(1).to(tl.int64)
    offs_r = pid_r * ROWS + tl.arange(0, ROWS)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    r_mask = offs_r < rows
    p_mask = offs_p < pairs
    freq = offs_p % HALF  # the pair's column of the tables
    col_first = (offs_p // HALF) * (2 * HALF) + freq  # its first-half column; the partner is HALF later
    positions = tl.load(positions_ptr + offs_r, mask=r_mask, other=0).to(tl.int64)
    row_ok = r_mask & (positions >= 0) & (positions < max_positions)
    table = positions[:, None] * stride_tp + freq[None, :]
    table_mask = row_ok[:, None] & p_mask[None, :]
    cos = tl.load(cos_ptr + table, mask=table_mask, other=1.0)
    sin = tl.load(sin_ptr + table, mask=table_mask, other=0.0)
    mask = r_mask[:, None] & p_mask[None, :]
    first_ptrs = packed_ptr + offs_r[:, None] * N + col_first[None, :]
    u1 = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    u2 = tl.load(first_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = packed_ptr.dtype.element_ty
    tl.store(first_ptrs, cast_rtne(u1 * cos - u2 * sin, dtype), mask=mask)
    tl.store(first_ptrs + HALF, cast_rtne(u2 * cos + u1 * sin, dtype), mask=mask)


# ------------------------------------------------------------------------------------------------------ launchers
def _require_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: the GEMM output must be contiguous, got strides {t.stride()}")


def elementwise_block() -> int:
    """Elements per program of the activation kernel: large under the interpreter (its cost is per program)."""
    return 1 << 14 if INTERPRETER else 1024


def glu_blocks() -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the GLU kernel (4 warps): 16 values per thread and tensor on a GPU."""
    return (64, 256) if INTERPRETER else (16, 128)


def rotary_blocks(pairs: int) -> tuple[int, int]:
    """(ROWS, BLOCK_P) of the rotary kernel (4 warps) for rows of ``pairs`` column pairs of q and k."""
    return (16, min(row_block(pairs), 1024)) if INTERPRETER else (4, min(row_block(pairs), 256))


def activate_rows(y: torch.Tensor, activation: str) -> torch.Tensor:
    """act(y) in place over a contiguous tensor; returns y."""
    _require_contiguous("activate_rows", y)
    if activation is None or activation not in ACTIVATION_CODES:
        raise ValueError(f"activate_rows: unknown activation {activation!r}")
    numel = y.numel()
    if numel:
        block = elementwise_block()
        launch(_activation_kernel, (cdiv(numel, block),), y, numel, ACTIVATION=ACTIVATION_CODES[activation],
               BLOCK=block, num_warps=4)
    return y


def residual_layernorm_rows(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(y + residual) of [rows, N] tensors, the sum rounded to y's dtype first. ``out`` None: written over
    y (y + residual is not kept); else into ``out`` (contiguous, y's shape and dtype) with the sum written over y.
    Returns the LayerNorm."""
    _require_contiguous("residual_layernorm_rows", y)
    rows, width = y.shape
    if width > MAX_WIDTH:
        raise ValueError(f"residual_layernorm_rows: width {width} exceeds {MAX_WIDTH} (a row must fit one block)")
    if width > 1 and residual.stride(1) != 1:
        raise ValueError(f"residual_layernorm_rows: residual needs a unit column stride, got {residual.stride()}")
    target = y if out is None else out
    if out is not None:
        _require_contiguous("residual_layernorm_rows (out)", out)
    if rows == 0:
        return target
    weight = weight.contiguous()
    has_bias = bias is not None
    bias = bias.contiguous() if has_bias else weight  # a placeholder the kernel never reads without HAS_BIAS
    per_program = rows_per_program(width)
    launch(_residual_layernorm_kernel, (cdiv(rows, per_program),), y, residual, target, weight, bias, rows,
           width, residual.stride(0), eps, HAS_BIAS=has_bias, STORE_SUM=out is not None, ROWS=per_program,
           BLOCK_N=row_block(width), num_warps=row_warps(width, per_program))
    return target


def glu_rows(projected: torch.Tensor, activation: str) -> torch.Tensor:
    """act(projected[:, :I]) * projected[:, I:] of a contiguous [rows, 2I] projection -> [rows, I]."""
    _require_contiguous("glu_rows", projected)
    rows, width = projected.shape
    inner = width // 2
    out = torch.empty((rows, inner), dtype=projected.dtype, device=projected.device)
    if rows and inner:
        block_m, block_n = glu_blocks()
        launch(_glu_kernel, (cdiv(rows, block_m), cdiv(inner, block_n)), projected, out, rows, inner,
               ACTIVATION=ACTIVATION_CODES[activation], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return out


def rotary_rows(packed: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                num_heads: int) -> torch.Tensor:
    """q and k of a contiguous [rows, 3 * heads * D] projection rotated in place at ``positions`` [rows] (int32/64)
    with the float32 [P, D/2] tables (unit column stride, one row stride); returns packed."""
    _require_contiguous("rotary_rows", packed)
    rows, width = packed.shape
    half = width // (3 * num_heads) // 2
    if half == 0 or 3 * num_heads * 2 * half != width or tuple(cos.shape[1:]) != (half,) or cos.shape != sin.shape:
        raise ValueError(f"rotary_rows: needs a [rows, 3 * {num_heads} * even D] projection and cos/sin [P, D/2]; "
                         f"got {tuple(packed.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("rotary_rows: cos/sin need unit column strides and one row stride")
    pairs = num_heads * 2 * half
    if rows:
        per_program, block_p = rotary_blocks(pairs)
        launch(_rotary_kernel, (cdiv(rows, per_program), cdiv(pairs, block_p)), packed,
               positions.reshape(-1).contiguous(), cos, sin, rows, width, pairs, cos.shape[0], cos.stride(0),
               HALF=half, ROWS=per_program, BLOCK_P=block_p, num_warps=4)
    return packed
