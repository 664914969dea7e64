"""Linear + gated activation in one GEMM: act(x @ W_in^T + b_in) * (x @ W_gate^T + b_gate), ModernBERT's GeGLU.

W = [W_in; W_gate] is the [2I, K] weight as stored (ModernBERT's ``Wi``: input rows first, gate rows last). Each
program owns one [BLOCK_M, BLOCK_N] tile of the [M, I] output and accumulates two GEMM tiles over K from the same x
tile: columns offs_n of the input half (weight rows offs_n) and the matching columns of the gate half (weight rows
I + offs_n). The epilogue adds both biases, applies the activation to the input half, multiplies by the gate (all
fp32) and stores once: the [M, 2I] projection never reaches memory.
Activations: `fastbert.ops.linear_activation.ACTIVATIONS` (the shared GEMM's `activate`). Shapes: x [..., K] (any
strides for 2-D x), weight [2I, K] (any strides), bias [2I] | None -> [..., I] contiguous. fp16, bf16, fp32 (fp32
without TF32). In the kernel I is called N (the output's columns).

Meta-parameters as the shared GEMM (`gemm.py`): autotuned on a GPU over `gpu_configs(dtype)`, a fixed table by M
when FASTBERT_TRITON_AUTOTUNE=0, the interpreter's fixed config on CPU. Two fp32 accumulators per program, so the
tiles are half the shared GEMM's largest (128x64 at 8 warps; sized by tools/compile_sm90.py: no spills).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastbert.ops.linear_glu import SPEC, linear_glu_reference

from . import gemm
from .common import (
    INTERPRETER,
    cast_rtne,
    dot_in_fp32,
    dot_precision,
    next_power_of_2,
)
from .gemm import activate, grouped_tile, k_loop_pair, tile_config

# The same limits as linear_activation (float tensors on one CUDA device, a known activation, K > 0): its check.
from .linear_activation import supports

__all__ = ["linear_glu", "linear_glu_reference", "supports"]


@triton.jit
def _linear_glu_kernel(
    x_ptr,  # [M, K] input rows, strides (stride_xm, stride_xk)
    w_ptr,  # [2N, K] weight in nn.Linear layout: rows [0, N) input half, rows [N, 2N) gate half
    bias_ptr,  # [2N] (ignored unless HAS_BIAS), unit stride
    out_ptr,  # [M, N] output, strides (stride_om, stride_on)
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_om, stride_on,
    m_bucket,  # power-of-two bucket of M: only an autotune key (token counts that vary per batch share tunings)
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # `gemm.ACTIVATION_CODES`: 1 gelu (erf), 2 gelu_tanh, 3 relu, 4 silu
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: see `common.INTERPRETER`
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N output tile: the input half's and the gate half's products in one K loop
    (`gemm.k_loop_pair`, each x tile loaded once for both), then act(input + bias) * (gate + bias). One GPU program
    for both halves because their two accumulators meet only in the epilogue (split in two, each half would be
    stored and read back)."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # int64 (from pid): the gate rows N + offs_n stay exact
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # [BLOCK_K, BLOCK_N] tiles of W_in^T and W_gate^T
    w_in_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    w_gate_ptrs = w_ptr + (offs_n + N)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_in, acc_gate = k_loop_pair(zeros, zeros, x_ptrs, w_in_ptrs, w_gate_ptrs, m_mask, n_mask, offs_k, K, stride_xk,
                                   stride_wk, INPUT_PRECISION, DOT_IN_FP32, BLOCK_K)

    if HAS_BIAS:
        acc_in += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_gate += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    result = activate(acc_in, ACTIVATION) * acc_gate
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, cast_rtne(result, out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# Two accumulators per program: the shared GEMM's 128x128 tile would hold 2 x 64 fp32 registers per thread in
# accumulators alone at 8 warps, so the largest tiles here are 128x64 / 64x128. Checked for sm_90 by
# tools/compile_sm90.py under triton 3.6 (the GPU machine's) and 3.9: no spills, shared memory within 227 KB (the
# short tiles take 8 warps: at 4, 32x64x128 and 16x64x128 without bias spilled under 3.6, 32x64x64 under 3.9).
GPU_CONFIGS = [
    tile_config(128, 64, 64, 4, 8),
    tile_config(64, 128, 64, 3, 8),
    tile_config(64, 64, 64, 4, 4),
    tile_config(32, 64, 64, 4, 8),
    tile_config(16, 64, 128, 4, 8),
]
# fp32 (IEEE, FMA units, operands in registers): both weight tiles sit in registers beside the two accumulators, so
# K steps of 16-32 and 8 warps for the wider tiles (at K = 32-64 with 4 warps most configs spilled).
FP32_CONFIGS = [
    tile_config(128, 64, 16, 3, 8),
    tile_config(64, 64, 16, 3, 8),
    tile_config(32, 64, 32, 3, 8),
    tile_config(32, 64, 16, 3, 4),
    tile_config(16, 64, 32, 3, 4),
]


def gpu_configs(dtype: torch.dtype) -> list[triton.Config]:
    """The configs the autotuner times for inputs of this dtype."""
    return FP32_CONFIGS if dtype == torch.float32 else GPU_CONFIGS


def table_config(m: int, dtype: torch.dtype = torch.float16) -> triton.Config:
    """One config per M range for GPUs when autotuning is off (FASTBERT_TRITON_AUTOTUNE=0)."""
    fp32 = dtype == torch.float32
    if m <= 32:
        return tile_config(16, 64, 32, 3, 4) if fp32 else tile_config(32, 64, 64, 4, 8)
    if m <= 256:
        return tile_config(64, 64, 16, 3, 8) if fp32 else tile_config(64, 64, 64, 4, 4)
    return tile_config(128, 64, 16, 3, 8) if fp32 else tile_config(128, 64, 64, 4, 8)


def _prune_by_dtype(configs, named_args, **kwargs):
    return gemm.keep_configs(configs, gpu_configs(named_args["x_ptr"].dtype))


_ALL_CONFIGS = gemm.unique_configs(GPU_CONFIGS + FP32_CONFIGS)
_autotuned = None if INTERPRETER else triton.autotune(
    configs=_ALL_CONFIGS, key=["m_bucket", "N", "K", "HAS_BIAS", "ACTIVATION"],
    prune_configs_by={"early_config_prune": _prune_by_dtype})(_linear_glu_kernel)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    rows = gemm.as_rows(x)
    m, k = rows.shape
    inner = weight.shape[0] // 2
    out = torch.empty((m, inner), dtype=x.dtype, device=x.device)
    if m == 0 or inner == 0:
        return out.view(*x.shape[:-1], inner)
    if k == 0:  # supports() refuses it (the result would come from the biases alone); guard direct callers
        raise ValueError("linear_glu: K = 0 is not supported by the triton backend")
    bias = bias.contiguous() if bias is not None else None  # the epilogue reads it with unit stride
    args = (rows, weight, bias if bias is not None else out, out, m, inner, k,
            rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            next_power_of_2(m))
    flags = {"HAS_BIAS": bias is not None, "ACTIVATION": gemm.ACTIVATION_CODES[activation],
             "INPUT_PRECISION": dot_precision(x.dtype), "DOT_IN_FP32": dot_in_fp32(x.dtype)}
    gemm.launch_tiled(_linear_glu_kernel, _autotuned, m, inner, args, flags,
                      lambda: gemm.interpreter_config(m) if INTERPRETER else gemm.launch_meta(table_config(m, x.dtype)))
    return out.view(*x.shape[:-1], inner)


# torch.ops.fastbert.triton_linear_glu: schema and fake from the op's spec.
_op = SPEC.define("triton_", _launch)


def linear_glu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(x @ W_in.T + b_in) * (x @ W_gate.T + b_gate) -> [..., I] (the triton backend of
    `fastbert.ops.linear_glu`)."""
    return torch.ops.fastbert.triton_linear_glu(x, weight, bias, activation)
