"""The GEMM every linear op of the triton backend runs: out = epilogue(x @ W^T), W in PyTorch's [N, K] layout.

Epilogue (all in fp32, one rounding at the store): + bias, dropout, + residual, then one activation ("gelu" = exact
erf, "gelu_tanh", "relu", "silu"; `activate`, which linear_glu's kernel shares). Used by qkv_projection (bias),
linear_activation (bias + activation), linear_residual_layernorm and linear_residual_prenorm (bias + dropout +
residual; their LayerNorm runs in a row kernel after this one).
Dropout (before the residual, as BERT's sublayer outputs): the element at (row, column) is kept when Philox's draw
for (seed, row * N + column) is >= p (`common.dropout_keep`), so a backward regenerates the mask anywhere.
Backward epilogue (GRAD_ACTIVATION, linear_activation's backward): the GEMM recomputes the pre-activation
x @ W^T + b and, instead of activating it, multiplies the incoming gradient by the activation's derivative there
(`activation_grad`), storing dL/d(pre-activation) and per-tile fp32 column sums of it (the bias gradient's first
stage). Recomputing costs one GEMM; storing the pre-activation would cost a [M, N] buffer alive from forward to
backward (N = 4H in a BERT FFN: its largest activation).
x, W, residual and out may have any strides (W is read transposed through its strides, never copied).

Meta-parameters: on a GPU, `triton.autotune` over a small config list keyed by (power-of-two bucket of M, N, K,
epilogue), the configs that suit the bucket's M (`fits_m`: narrow 16-64 x 32 tiles for few tokens), or a fixed
table by M when FASTBERT_TRITON_AUTOTUNE=0; under the interpreter (where autotuning would take minutes) one fixed
config with real block sizes. Where even the narrowest tiles leave most SMs idle (M <= 16 at N = 768), the forward
runs split along K (`split_k`: slices into an fp32 workspace, then one kernel for their sum and the epilogue).
fp32 inputs are multiplied in IEEE fp32 (no TF32), so the fp32 path matches PyTorch to ~1e-5.
The tile order and K loops (`grouped_tile`, `k_loop`, and `k_loop_pair` for two weight tiles against one x tile)
serve linear_glu's and qkv_rotary's kernels too; triton inlines them into each kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime import Autotuner, KernelInterface

from .common import (
    INTERPRETER,
    cast_rtne,
    cdiv,
    column_sum,
    dot_in_fp32,
    dot_precision,
    dropout_args,
    dropout_keep,
    env_flag,
    launch,
    next_power_of_2,
    sm_count,
    tile_offsets,
)

ACTIVATION_CODES = {None: 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4}


@triton.jit
def _tanh(x):
    # tanh(u) = 1 - 2 / (1 + e^{2u}): saturates cleanly to +-1 when e^{2u} over/underflows.
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * x))


@triton.jit
def activate(acc, ACTIVATION: tl.constexpr):
    """The activation of code ACTIVATION (`ACTIVATION_CODES`) on an fp32 tile; 0 returns it unchanged."""
    if ACTIVATION == 1:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    elif ACTIVATION == 2:
        acc = 0.5 * acc * (1.0 + _tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)))
    elif ACTIVATION == 3:
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == 4:  # x * sigmoid(x); exp overflows to inf for x < -88, giving -0 as it should
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def activation_grad(pre, grad, ACTIVATION: tl.constexpr):
    """grad * act'(pre) on fp32 tiles for the activation of code ACTIVATION (`ACTIVATION_CODES`; 0: grad)."""
    if ACTIVATION == 1:  # Phi(x) + x phi(x)
        cdf = 0.5 * (1.0 + tl.math.erf(pre * 0.7071067811865476))
        grad = grad * (cdf + pre * 0.3989422804014327 * tl.exp(-0.5 * pre * pre))
    elif ACTIVATION == 2:  # 0.5 (1 + t) + 0.5 x (1 - t^2) u'(x), t = tanh(u(x)), u = k (x + 0.044715 x^3)
        t = _tanh(0.7978845608028654 * (pre + 0.044715 * pre * pre * pre))
        slope = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * pre * pre)
        grad = grad * (0.5 * (1.0 + t) + 0.5 * pre * (1.0 - t * t) * slope)
    elif ACTIVATION == 3:  # 0 at x = 0, as torch's threshold_backward
        grad = tl.where(pre > 0.0, grad, 0.0)
    elif ACTIVATION == 4:  # s (1 + x (1 - s)), s = sigmoid(x)
        sig = 1.0 / (1.0 + tl.exp(-pre))
        grad = grad * (sig * (1.0 + pre * (1.0 - sig)))
    return grad


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n), int64, of this program's tile of an [M, N] output on a 1-D grid in grouped order: GROUP_M row
    blocks walk the column blocks together, so weight tiles are reused from L2."""
    pid = tl.program_id(0).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    group_size = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // group_size) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % group_rows, (pid % group_size) // group_rows


@triton.jit
def k_loop(acc, x_ptrs, w_ptrs, m_mask, n_mask, offs_k, K, stride_xk, stride_wk, INPUT_PRECISION: tl.constexpr,
           DOT_IN_FP32: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + x @ W^T over K: ``x_ptrs`` the [BLOCK_M, BLOCK_K] tile of x at the first K step, ``w_ptrs`` the
    [BLOCK_K, BLOCK_N] tile of W^T; rows outside ``m_mask``, columns outside ``n_mask`` and steps past K read 0."""
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def k_loop_pair(acc_1, acc_2, x_ptrs, w_ptrs_1, w_ptrs_2, m_mask, n_mask, offs_k, K, stride_xk, stride_wk,
                INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, BLOCK_K: tl.constexpr):
    """`k_loop` for two weight tiles of the same shape (two sets of W rows) against one x tile: each x tile is loaded
    once for both products (linear_glu's input and gate halves, qkv_rotary's pair halves)."""
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        w_mask = k_mask[:, None] & n_mask[None, :]
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b_1 = tl.load(w_ptrs_1, mask=w_mask, other=0.0)
        b_2 = tl.load(w_ptrs_2, mask=w_mask, other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b_1 = b_1.to(tl.float32)
            b_2 = b_2.to(tl.float32)
        acc_1 = tl.dot(a, b_1, acc_1, input_precision=INPUT_PRECISION)
        acc_2 = tl.dot(a, b_2, acc_2, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs_1 += BLOCK_K * stride_wk
        w_ptrs_2 += BLOCK_K * stride_wk
    return acc_1, acc_2


@triton.jit
def _bias_dropout_residual(acc, offs_m, offs_n, n_mask, mask, N, bias_ptr, residual_ptr, stride_rm, stride_rn, seed,
                           dropout_p, keep_scale, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                           HAS_RESIDUAL: tl.constexpr):
    """The forward epilogue before the activation, on the fp32 tile acc [offs_m, offs_n] of the [M, N] output
    (``mask``: its real elements): + bias, dropout at the flat indices row * N + column, + residual."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if DROPOUT:
        acc = tl.where(dropout_keep(seed, offs_m[:, None] * N + offs_n[None, :], dropout_p), acc * keep_scale, 0.0)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn, mask=mask,
                       other=0.0).to(tl.float32)
    return acc


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K] input rows, strides (stride_xm, stride_xk)
    w_ptr,  # [N, K] weight in nn.Linear layout, strides (stride_wn, stride_wk)
    bias_ptr,  # [N] (ignored unless HAS_BIAS)
    residual_ptr,  # [M, N] added after the bias (ignored unless HAS_RESIDUAL), strides (stride_rm, stride_rn)
    out_ptr,  # [M, N] output, strides (stride_om, stride_on)
    grad_ptr,  # [M, N] dL/d(activation output) (ignored unless GRAD_ACTIVATION), strides (stride_gm, stride_gn)
    partial_ptr,  # [cdiv(M, PARTIAL_BLOCK_M), N] fp32, contiguous: the tile of rows pid_m * BLOCK_M... owns rows
    #               pid_m * BLOCK_M / PARTIAL_BLOCK_M... of it and stores its column sums of the stored gradient in
    #               the first, zeros in the others, so every config fills it whole (ignored unless GRAD_ACTIVATION)
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_rm, stride_rn,
    stride_om, stride_on,
    stride_gm, stride_gn,
    seed,  # dropout: the Philox seed (ignored unless DROPOUT)
    dropout_p,  # dropout: the probability of dropping (ignored unless DROPOUT)
    keep_scale,  # dropout: 1 / (1 - dropout_p), what kept elements are multiplied by (ignored unless DROPOUT)
    m_bucket,  # power-of-two bucket of M: only an autotune key, so token counts that vary per batch share tunings
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 none, 1 gelu (erf), 2 gelu_tanh, 3 relu, 4 silu
    DROPOUT: tl.constexpr,  # dropout on x @ W^T + b, before the residual
    GRAD_ACTIVATION: tl.constexpr,  # backward epilogue: store grad * act'(x @ W^T + b) instead of the activation
    PARTIAL_BLOCK_M: tl.constexpr,  # rows of the GEMM per row of partial_ptr: the smallest BLOCK_M of any config
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: see `common.INTERPRETER`
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N output tile: the K loop of x @ W^T (`k_loop`), then the epilogue the flags select
    (module docstring): one GPU program, the fp32 accumulator in registers from the K loop to the single store."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N] = W^T tile
    acc = k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_ptrs, w_ptrs, m_mask, n_mask, offs_k, K,
                 stride_xk, stride_wk, INPUT_PRECISION, DOT_IN_FP32, BLOCK_K)

    out_mask = m_mask[:, None] & n_mask[None, :]
    acc = _bias_dropout_residual(acc, offs_m, offs_n, n_mask, out_mask, N, bias_ptr, residual_ptr, stride_rm,
                                 stride_rn, seed, dropout_p, keep_scale, HAS_BIAS, DROPOUT, HAS_RESIDUAL)
    if GRAD_ACTIVATION:
        grad = tl.load(grad_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn, mask=out_mask,
                       other=0.0).to(tl.float32)
        acc = tl.where(out_mask, activation_grad(acc, grad, ACTIVATION), 0.0)
        slots = tl.arange(0, BLOCK_M // PARTIAL_BLOCK_M)
        partial_rows = pid_m * (BLOCK_M // PARTIAL_BLOCK_M) + slots
        sums = tl.where(slots[:, None] == 0, tl.sum(acc, axis=0)[None, :], 0.0)
        tl.store(partial_ptr + partial_rows[:, None] * N + offs_n[None, :], sums,
                 mask=(partial_rows < tl.cdiv(M, PARTIAL_BLOCK_M))[:, None] & n_mask[None, :])
    else:
        acc = activate(acc, ACTIVATION)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, cast_rtne(acc, out_ptr.dtype.element_ty), mask=out_mask)


def tile_config(block_m: int, block_n: int, block_k: int, stages: int, warps: int) -> triton.Config:
    """A GEMM tile config: BLOCK_M x BLOCK_N output tiles, BLOCK_K steps, GROUP_M row blocks per group."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8},
                         num_stages=stages, num_warps=warps)


# Hopper/Ampere-sized tiles from large to small; small-M configs for batch-1 latency. Not yet timed on a GPU (the
# H200 run, benchmarks/results/h200-gpu-check, used the fixed `table_config`): the autotuner times them all once per
# key, so a poor entry costs tuning time, never correctness. Sized by compiling them for sm_90 with the launch's
# specialisation (tools/compile_sm90.py, table in benchmarks/results/sm90-resources): none spills in fp16/bf16 with
# any epilogue. 128x128 tiles need 8 warps (at 4 the fp32 accumulator + epilogue exceed 255 registers); 128x256 and
# 256x128 tiles spill even at 8 or 16 warps.
GPU_CONFIGS = [
    tile_config(128, 128, 64, 4, 8),
    tile_config(128, 128, 32, 4, 8),
    tile_config(128, 64, 64, 4, 4),
    tile_config(64, 128, 64, 4, 4),
    tile_config(64, 64, 64, 4, 4),
    tile_config(32, 64, 128, 4, 4),
    tile_config(16, 64, 128, 4, 4),
    # small M (1..8 sequences of 128 tokens): narrow tiles multiply the programs, so that N = 768 fills the GPU's
    # SMs (at 128 x 128, M = 128 gives 6 programs for 132 SMs; at 32 x 32, 96)
    tile_config(64, 32, 128, 4, 4),
    tile_config(32, 32, 128, 4, 4),
    tile_config(16, 32, 256, 3, 4),
]
# fp32 (IEEE, no tensor cores): the dot runs on FMA units with its operands in registers, so the tiles take short
# K steps (at BLOCK_K = 64 the 128-wide tiles spill kilobytes). Checked under both the GPU machine's triton 3.6 and
# triton 3.9: 3.6 keeps more registers live (with GELU, 128x128x32, 64x64x64 at 4 warps and 32x64x128 spilled
# 4-740 B there, and qkv_rotary's 64x128x32 at 4 warps 12 B).
FP32_CONFIGS = [
    tile_config(128, 128, 16, 4, 8),
    tile_config(128, 64, 32, 4, 4),
    tile_config(64, 128, 32, 4, 8),
    tile_config(64, 64, 64, 4, 8),
    tile_config(32, 64, 64, 4, 4),
    tile_config(16, 64, 128, 4, 4),
    tile_config(32, 32, 64, 4, 4),
]


# The dropout epilogue (Philox) and the backward epilogue (the derivative, a second [M, N] tile) keep more registers
# live: the subsets of the lists above that do not spill with them on sm_90 (128x64 and 64x128 tiles at 4 warps
# spill in fp16/bf16, the 128-wide fp32 tiles and fp32 64x64x64 too; tools/compile_sm90.py).
GPU_HEAVY_CONFIGS = [
    tile_config(128, 128, 64, 4, 8),
    tile_config(128, 128, 32, 4, 8),
    tile_config(64, 64, 64, 4, 4),
    tile_config(32, 64, 128, 4, 4),
    tile_config(16, 64, 128, 4, 4),
]
FP32_HEAVY_CONFIGS = [
    tile_config(64, 64, 32, 4, 4),
    tile_config(32, 64, 64, 4, 4),
    tile_config(16, 64, 128, 4, 4),
]


def gpu_configs(dtype: torch.dtype, heavy: bool = False) -> list[triton.Config]:
    """The configs the autotuner times for inputs of this dtype; ``heavy``: for the dropout or backward epilogue."""
    if heavy:
        return FP32_HEAVY_CONFIGS if dtype == torch.float32 else GPU_HEAVY_CONFIGS
    return FP32_CONFIGS if dtype == torch.float32 else GPU_CONFIGS


def config_key(config: triton.Config) -> tuple:
    """What makes two configs the same launch (triton.Config has no equality of its own)."""
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages


def unique_configs(configs: list[triton.Config]) -> list[triton.Config]:
    """``configs`` without repeats (`config_key`), in order: the list handed to `triton.autotune`."""
    return list({config_key(c): c for c in configs}.values())


def keep_configs(configs: list[triton.Config], wanted: list[triton.Config]) -> list[triton.Config]:
    """The autotuner's ``configs`` that are among ``wanted``: an `early_config_prune` keeps a dtype's list."""
    keys = {config_key(c) for c in wanted}
    return [c for c in configs if config_key(c) in keys]


def launch_meta(config: triton.Config) -> dict:
    """A config as launch keywords: meta-parameters plus num_warps and num_stages."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def fits_m(config: triton.Config, m_bucket: int) -> bool:
    """Whether the autotuner times ``config`` for token counts of this power-of-two bucket: no tile taller than M
    (its rows would be padding), and none thinner than M / 64 (their programs would reread the weight dozens of
    times where a taller tile already fills the GPU)."""
    block_m = config.kwargs["BLOCK_M"]
    return block_m <= max(16, m_bucket) and block_m * 64 >= m_bucket


def _prune_by_dtype(configs, named_args, **kwargs):
    heavy = bool(kwargs.get("DROPOUT") or kwargs.get("GRAD_ACTIVATION"))
    kept = keep_configs(configs, gpu_configs(named_args["x_ptr"].dtype, heavy))
    by_m = [c for c in kept if fits_m(c, named_args["m_bucket"])]
    return by_m or kept


_ALL_CONFIGS = unique_configs(GPU_CONFIGS + FP32_CONFIGS + GPU_HEAVY_CONFIGS + FP32_HEAVY_CONFIGS)
_autotuned = None if INTERPRETER else triton.autotune(
    configs=_ALL_CONFIGS,
    key=["m_bucket", "N", "K", "HAS_BIAS", "HAS_RESIDUAL", "ACTIVATION", "DROPOUT", "GRAD_ACTIVATION"],
    prune_configs_by={"early_config_prune": _prune_by_dtype})(_linear_kernel)


def table_config(m: int, dtype: torch.dtype = torch.float16, heavy: bool = False) -> triton.Config:
    """One config per M range, for GPUs when autotuning is switched off (FASTBERT_TRITON_AUTOTUNE=0: tests and
    correctness checks, where tuning every shape would cost minutes of compiles); ``heavy``: for the dropout or
    backward epilogue (`gpu_configs`)."""
    # Sized so that the narrowest BERT GEMM (N = 768) has about a wave of programs on a 132-SM GPU: M = 128 at
    # 32 x 64 tiles gives 48, M = 512 at 64 x 64 gives 96, M = 2048 at 128 x 64 gives 192.
    fp32 = dtype == torch.float32
    if m <= 32:
        return tile_config(16, 64, 128, 4, 4)
    if m <= 128:
        return tile_config(32, 64, 64, 4, 4) if fp32 else tile_config(32, 64, 128, 4, 4)
    if heavy and fp32:
        return tile_config(64, 64, 32, 4, 4)
    if m <= 512 or (heavy and m <= 2048):
        return tile_config(64, 64, 64, 4, 8) if fp32 else tile_config(64, 64, 64, 4, 4)
    if m <= 2048 and not heavy:
        return tile_config(128, 64, 32, 4, 4) if fp32 else tile_config(128, 64, 64, 4, 4)
    return tile_config(128, 128, 16, 4, 8) if fp32 else tile_config(128, 128, 64, 4, 8)


def table_meta(m: int, dtype: torch.dtype = torch.float16, heavy: bool = False) -> dict:
    """`table_config(m, dtype, heavy)` as launch keywords (`launch_meta`)."""
    return launch_meta(table_config(m, dtype, heavy))


def autotune_enabled() -> bool:
    """FASTBERT_TRITON_AUTOTUNE: unset or 1 autotunes the GEMM tiles; 0 (false, no, off) takes `table_config`."""
    return env_flag("FASTBERT_TRITON_AUTOTUNE")


def interpreter_config(m: int) -> dict:
    """Fixed meta-parameters for the interpreter. Its cost is per interpreted operation, so large tiles run several
    times faster than GPU-sized ones (a 130x768x768 GEMM: 2.6 s at 32x64x64, 0.7 s at 64x256x256)."""
    return {"BLOCK_M": 16 if m <= 16 else 32 if m <= 32 else 64, "BLOCK_N": 256, "BLOCK_K": 256, "GROUP_M": 8}


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [rows, C], a view whenever possible (2-D inputs keep their strides, whatever they are)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def launch_tiled(kernel: KernelInterface, autotuned: Autotuner | None, m: int, n: int, args: tuple, flags: dict,
                 fixed_meta: Callable[[], dict], column_block: str = "BLOCK_N") -> None:
    """Launch a GEMM-style kernel over the grouped 1-D grid of its [m, n] output (n counted in blocks of the
    ``column_block`` meta-parameter: BLOCK_N columns, or qkv_rotary's BLOCK_C column pairs): with one fixed config,
    ``fixed_meta()`` (the interpreter's, or the M table's when FASTBERT_TRITON_AUTOTUNE=0), or through its autotuner
    ``autotuned`` (None under the interpreter, which never autotunes)."""

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta[column_block]),)

    if INTERPRETER or not autotune_enabled():
        meta = fixed_meta()
        launch(kernel, grid(meta), *args, **flags, **meta)
    else:
        launch(autotuned, grid, *args, **flags)


MIN_BLOCK_M = 16  # the smallest BLOCK_M of every config above and of `interpreter_config`: the backward epilogue's
# partial sums have one row per MIN_BLOCK_M rows, so they do not depend on the config the autotuner picks


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
            activation: str | None, dropout_p: float, dropout_seed: int, grad: torch.Tensor | None,
            partial: torch.Tensor | None) -> torch.Tensor:
    """Run the kernel: epilogue(x @ weight.T) -> [rows, N] in x's dtype; with ``grad`` ([rows, N]) the backward
    epilogue, whose column sums go to ``partial`` ([cdiv(rows, MIN_BLOCK_M), N] fp32, filled by the kernel)."""
    rows = as_rows(x)
    n, k = weight.shape
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # the ops' supports() refuse K = 0 (the result would be the bias alone); guard direct callers
        raise ValueError("linear: K = 0 is not supported by the triton backend")
    res = as_rows(residual) if residual is not None else None
    bias = bias.contiguous() if bias is not None else None  # the epilogue reads it with unit stride
    dropout = dropout_p > 0
    args = (rows, weight, bias if bias is not None else out, res if res is not None else out, out,
            grad if grad is not None else out, partial if partial is not None else out, m, n, k,
            rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1),
            res.stride(0) if res is not None else 0, res.stride(1) if res is not None else 0,
            out.stride(0), out.stride(1), grad.stride(0) if grad is not None else 0,
            grad.stride(1) if grad is not None else 0,
            *dropout_args(dropout_p, dropout_seed),
            next_power_of_2(m))
    flags = {"HAS_BIAS": bias is not None, "HAS_RESIDUAL": residual is not None,
             "ACTIVATION": ACTIVATION_CODES[activation], "DROPOUT": dropout, "GRAD_ACTIVATION": grad is not None,
             "PARTIAL_BLOCK_M": MIN_BLOCK_M,
             "INPUT_PRECISION": dot_precision(x.dtype), "DOT_IN_FP32": dot_in_fp32(x.dtype)}
    heavy = dropout or grad is not None
    launch_tiled(_linear_kernel, _autotuned, m, n, args, flags,
                 lambda: interpreter_config(m) if INTERPRETER else table_meta(m, x.dtype, heavy))
    return out


# ------------------------------------------------------------------------------------------------------- split-K
# Few tokens and a narrow N leave most SMs idle even with the narrowest tiles (M = 16, N = 768 at 16 x 32: 24
# programs for 132 SMs). Then the forward GEMM is split along K: each of `split_k(...)` programs per output tile
# multiplies one slice of K and stores its fp32 product in a [splits, M, N] workspace; a second kernel adds the
# slices in a fixed order (deterministic: no atomics) and applies the whole forward epilogue (bias, dropout at the
# same flat indices as the unsplit kernel, residual, activation), one rounding. The LayerNorm of
# linear_residual_layernorm / _prenorm runs in its own row kernel after either, so every forward epilogue allows
# the split; the backward epilogue (GRAD_ACTIVATION) is never split.
SPLIT_K_MIN_SLICE = 256  # K elements per slice at least: thinner slices cost more workspace traffic than they gain
SPLIT_K_MAX = 8
SPLIT_K_OVERRIDE: int | None = int(os.environ["FASTBERT_TRITON_SPLIT_K"]) \
    if os.environ.get("FASTBERT_TRITON_SPLIT_K") else None
"""FASTBERT_TRITON_SPLIT_K=N forces N slices wherever K allows (1: never split); read at import. Tests set it."""


@triton.jit
def _linear_split_k_kernel(
    x_ptr,  # [M, K] input rows, strides (stride_xm, stride_xk)
    w_ptr,  # [N, K] weight in nn.Linear layout, strides (stride_wn, stride_wk)
    partial_ptr,  # [splits, M, N] fp32 contiguous: program (m, n, s) stores slice s's product of its tile
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    k_per_split,  # K elements per slice, a multiple of BLOCK_K: slice s is [s * k_per_split, (s + 1) * k_per_split)
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: see `common.INTERPRETER`
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    pid_k = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_begin = pid_k * k_per_split
    k_left = tl.minimum(K - k_begin, k_per_split)  # this slice's depth (the last one may be shorter)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_begin + offs_k)[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k_begin + offs_k)[:, None] * stride_wk
    acc = k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_ptrs, w_ptrs, m_mask, n_mask, offs_k, k_left,
                 stride_xk, stride_wk, INPUT_PRECISION, DOT_IN_FP32, BLOCK_K)
    tl.store(partial_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _split_k_epilogue_kernel(
    partial_ptr,  # [splits, M, N] fp32 contiguous: the slices' products
    bias_ptr,  # [N] (ignored unless HAS_BIAS)
    residual_ptr,  # [M, N] added after the bias (ignored unless HAS_RESIDUAL), strides (stride_rm, stride_rn)
    out_ptr,  # [M, N] output, strides (stride_om, stride_on)
    M, N, splits,
    stride_rm, stride_rn,
    stride_om, stride_on,
    seed, dropout_p, keep_scale,  # dropout (ignored unless DROPOUT): Philox seed, probability, 1 / (1 - p)
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,  # `ACTIVATION_CODES`
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m, offs_n, n_mask, mask = tile_offsets(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    slice_ptrs = partial_ptr + offs_m[:, None] * N + offs_n[None, :]
    for _ in range(0, splits):  # in slice order: the same sum whatever the tiling
        acc += tl.load(slice_ptrs, mask=mask, other=0.0)
        slice_ptrs += M * N
    # the forward epilogue of `_linear_kernel`, in the same order
    acc = _bias_dropout_residual(acc, offs_m, offs_n, n_mask, mask, N, bias_ptr, residual_ptr, stride_rm, stride_rn,
                                 seed, dropout_p, keep_scale, HAS_BIAS, DROPOUT, HAS_RESIDUAL)
    acc = activate(acc, ACTIVATION)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             cast_rtne(acc, out_ptr.dtype.element_ty), mask=mask)


def split_k_meta(m: int) -> dict:
    """The split GEMM's tile (fixed, not autotuned: the split is chosen where every config underfills the GPU):
    16 or 32 rows x 32 columns, K steps of 128 (the interpreter: wider, its cost is per program)."""
    if INTERPRETER:
        return {"BLOCK_M": 16 if m <= 16 else 32, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M": 16 if m <= 16 else 32, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def split_k_epilogue_blocks() -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the split's reduction + epilogue kernel (4 warps): 16 fp32 values per thread."""
    return (32, 256) if INTERPRETER else (16, 128)


def split_k(m: int, n: int, k: int, device: torch.device) -> int:
    """Slices of K for the forward GEMM of [m, k] x [k, n] on ``device``: 1 (unsplit) unless even 16 x 32 tiles
    give fewer programs than a quarter of the GPU's SMs; then about one program per SM, each slice at least
    SPLIT_K_MIN_SLICE deep, at most SPLIT_K_MAX (FASTBERT_TRITON_SPLIT_K overrides). Never on CPU (the
    interpreter) unless forced."""
    block_k = split_k_meta(m)["BLOCK_K"]
    if SPLIT_K_MAX * m * n >= 1 << 31:  # the workspace's offsets are int32 in the epilogue kernel
        return 1
    if SPLIT_K_OVERRIDE is not None:
        return _slices_run(k, max(1, min(SPLIT_K_OVERRIDE, cdiv(k, block_k))), block_k)
    if INTERPRETER or device.type != "cuda":
        return 1
    tiles = cdiv(m, 16) * cdiv(n, 32)
    if 4 * tiles >= sm_count(device):
        return 1
    wanted = max(1, min(SPLIT_K_MAX, cdiv(sm_count(device), tiles), k // SPLIT_K_MIN_SLICE))
    return _slices_run(k, wanted, block_k)


def _slices_run(k: int, wanted: int, block_k: int) -> int:
    """The slices that run when ``wanted`` slices of K are rounded up to whole BLOCK_K steps (may be fewer)."""
    return cdiv(k, cdiv(cdiv(k, wanted), block_k) * block_k)


def _launch_split_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor | None, activation: str | None, dropout_p: float, dropout_seed: int,
                    splits: int) -> torch.Tensor:
    """The forward GEMM and its epilogue (as `_launch` without ``grad``) in ``splits`` slices of K -> [rows, N]."""
    rows = as_rows(x)
    n, k = weight.shape
    m = rows.shape[0]
    meta = split_k_meta(m)
    k_per_split = cdiv(cdiv(k, splits), meta["BLOCK_K"]) * meta["BLOCK_K"]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    tiles = (cdiv(m, meta["BLOCK_M"]), cdiv(n, meta["BLOCK_N"]))
    launch(_linear_split_k_kernel, (*tiles, splits), rows, weight, partial, m, n, k, rows.stride(0), rows.stride(1),
           weight.stride(0), weight.stride(1), k_per_split, INPUT_PRECISION=dot_precision(x.dtype),
           DOT_IN_FP32=dot_in_fp32(x.dtype), **meta)
    res = as_rows(residual) if residual is not None else None
    bias = bias.contiguous() if bias is not None else None
    block_m, block_n = split_k_epilogue_blocks()
    launch(_split_k_epilogue_kernel, (cdiv(m, block_m), cdiv(n, block_n)), partial,
           bias if bias is not None else out, res if res is not None else out, out, m, n, splits,
           res.stride(0) if res is not None else 0, res.stride(1) if res is not None else 0, out.stride(0),
           out.stride(1), *dropout_args(dropout_p, dropout_seed), HAS_BIAS=bias is not None,
           HAS_RESIDUAL=residual is not None, ACTIVATION=ACTIVATION_CODES[activation], DROPOUT=dropout_p > 0,
           BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None,
           activation: str | None = None, dropout_p: float = 0.0, dropout_seed: int = 0) -> torch.Tensor:
    """epilogue(x @ weight.T) -> [..., N] in x's dtype (see the module docstring); dropout (``dropout_p`` > 0) on
    x @ weight.T + bias before the residual. Inputs are checked by callers (dropout: `dropout_reason`). Split
    along K where few tokens would leave the GPU idle (`split_k`); the same shapes always take the same path, so a
    backward's recomputation reproduces its forward."""
    m, (n, k) = x.shape[:-1].numel(), weight.shape
    splits = split_k(m, n, k, x.device) if m and n and k else 1
    if splits > 1:
        out = _launch_split_k(x, weight, bias, residual, activation, dropout_p, dropout_seed, splits)
    else:
        out = _launch(x, weight, bias, residual, activation, dropout_p, dropout_seed, None, None)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_activation_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad: torch.Tensor,
                           activation: str, bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of act(x @ weight.T + bias) up to the pre-activation: (dL/d(pre-activation) [rows, N] in x's dtype,
    the bias gradient [N] in the bias's dtype summed in fp32 from the unrounded values, or None unless
    ``bias_grad``), given ``grad`` = dL/d(output) [..., N] of any strides. Recomputes the GEMM (module
    docstring)."""
    n = weight.shape[0]
    m = as_rows(x).shape[0]
    # always allocated: the backward epilogue stores its column sums whether or not they are wanted
    partial = torch.empty((cdiv(m, MIN_BLOCK_M), n), dtype=torch.float32, device=x.device)
    grad_pre = _launch(x, weight, bias, None, activation, 0.0, 0, as_rows(grad), partial)
    return grad_pre, column_sum(partial, bias.dtype) if bias_grad else None
