"""Compile every triton kernel config of fastbert for sm_90 (H100/H200) as a real launch compiles it, without a GPU,
and report its resources: registers, spills, shared memory, estimated occupancy.

A launch specialises its arguments (triton 3.9 `JITFunction.run`): an int equal to 1 becomes a constexpr, ints and
pointers divisible by 16 get `tt.divisibility = 16`, ints are i32 when they fit. That decides vectorised loads and the
pipelined (cp.async / TMA + wgmma) path, so it decides shared memory and registers. Here the launch's own binder
(`create_function_from_signature` + `JITFunction._pack_args`) is run on realistic BERT arguments (contiguous inner
strides, other strides and sizes multiples of 16, 16-byte aligned pointers via `MockTensor`) and the result is handed
to `triton.compile` for `GPUTarget("cuda", 90, 32)`; Triton's bundled ptxas builds the cubin and its `-v` log gives
registers and spills (`compiled.n_regs` / `n_spills` are only filled when a driver loads the cubin, which needs a GPU).

Cases: every GEMM config the autotuner or the M table can pick for the dtype (qkv_rotary's GEMM with its rotary
epilogue too, at ModernBERT-base sizes, the same tiles as pairs of columns; --quick: without bias only)
(`gemm.gpu_configs(dtype)` and `gemm.table_config`) with the epilogues the ops use, the same for linear_glu's
two-accumulator GEMM (`linear_glu.gpu_configs`/`table_config`, ModernBERT-base sizes), the attention meta for head dims
32/64/80/96/128 (packed and padded forms, plus the BLOCK_M = 64 small-batch variant and the packed dropout variant),
the attention backward's two kernels (dq with its LSE pass, dk/dv; `attention._backward_meta`) for head dims 32 to
256, plain and with a window and dropout (--quick: D = 128 only), the GEMM's split-K kernels (its slices and
its reduction with the forward epilogues), the vendor backend's epilogue kernels
(`epilogues`: activation, residual + LayerNorm, GLU, rotary), and the row kernels at BERT
widths (with and without positions / LayerNorm bias, with dropout; the LayerNorm backward kernels, the relu
gradient and the column sums of the backward's reductions); in fp16, bf16 and fp32. The GEMM's dropout and backward
epilogues take their own config lists (`gpu_configs(dtype, heavy=True)`). Shorter sequences only shrink the
attention blocks, so they are not compiled.
Fails (exit 1) on a compile error, a register spill in any kernel (fp32 included: its configs were sized not to
spill), or shared memory over the 227 KB an sm_90 block may use.

    python tools/compile_sm90.py [--out DIR] [--quick] [--jobs N]

--out (or FASTBERT_SM90_OUT) writes resources.md and resources.json there (benchmarks/results/sm90-resources holds
the committed table). --quick (the test's run) compiles the GEMM with the heaviest epilogues only (gelu, residual,
and training's residual dropout and gelu backward; not qkv, gelu_tanh), linear_glu with gelu and no bias only, and
leaves out the attention small-batch variant: the same configs, fewer variants.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launch default in triton 3.9; silences its warning

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import MockTensor, create_function_from_signature

from fastbert.kernels import attention, common, epilogues, gemm, linear_activation
from fastbert.kernels import embedding_layernorm as embedding
from fastbert.kernels import linear_glu as glu
from fastbert.kernels import linear_residual_layernorm as residual_ln
from fastbert.kernels import qkv_rotary as rotary

TARGET = GPUTarget("cuda", 90, 32)
# H100/H200 (sm_90) per-SM limits
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
SMEM_PER_SM = 228 * 1024
SMEM_PER_BLOCK = 227 * 1024
SMEM_RESERVED_PER_BLOCK = 1024  # the driver reserves 1 KB per resident block
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
KERNELS = {
    "gemm": gemm._linear_kernel,
    "qkv_rotary": rotary._qkv_rotary_kernel,
    "linear_glu": glu._linear_glu_kernel,
    "attention": attention._attention_kernel,
    "attention_backward_dq": attention._attention_backward_dq_kernel,
    "attention_backward_dkdv": attention._attention_backward_dkdv_kernel,
    "embedding_layernorm": embedding._embedding_layernorm_kernel,
    "embedding_layernorm_backward": embedding._embedding_layernorm_backward_kernel,
    "layernorm_rows": residual_ln._layernorm_rows_kernel,
    "layernorm_rows_backward": residual_ln._layernorm_rows_backward_kernel,
    "relu_grad": linear_activation._relu_grad_kernel,
    "column_sum": common._column_sum_kernel,
    "gemm_split_k": gemm._linear_split_k_kernel,
    "gemm_split_k_epilogue": gemm._split_k_epilogue_kernel,
    "epilogue_activation": epilogues._activation_kernel,
    "epilogue_residual_layernorm": epilogues._residual_layernorm_kernel,
    "epilogue_glu": epilogues._glu_kernel,
    "epilogue_rotary": epilogues._rotary_kernel,
}
# label: (HAS_BIAS, HAS_RESIDUAL, ACTIVATION, DROPOUT, GRAD_ACTIVATION) as the ops launch the GEMM; the last two
# (Philox dropout before the residual, linear_activation's backward epilogue) take the `heavy` config lists
EPILOGUES = {"qkv": (True, False, 0, False, False), "gelu": (True, False, 1, False, False),
             "gelu_tanh": (True, False, 2, False, False), "residual": (True, True, 0, False, False),
             "residual dropout": (True, True, 0, True, False), "gelu grad": (True, False, 1, False, True)}
QUICK_EPILOGUES = ("gelu", "residual", "residual dropout", "gelu grad")
DROPOUT_ARGS = (0x1234_5678_9ABC, 0.1, 1 / 0.9)  # an int64 seed (as `fastbert.ops.dropout.op_seed` draws), p, 1/(1-p)

# BERT-like sizes: tokens, hidden, heads (all multiples of 16, as the usual shapes are); ModernBERT-base's GLU width
TOKENS, HIDDEN, INTERMEDIATE, HEADS, BATCH, SEQ = 4096, 768, 3072, 12, 32, 128
GLU_INTERMEDIATE = 1152
TABLE_MS = (16, 128, 512, 2048, 4096)  # token counts whose M-table configs are compiled: one per range of the tables
GLU_ACTIVATIONS = ("gelu", "silu")
QUICK_GLU_ACTIVATIONS = ("gelu",)


def _ptr(dtype: str):
    return ("ptr", dtype)


def gemm_cases(dtype: str, epilogues) -> list:
    m, n, k = TOKENS, INTERMEDIATE, HIDDEN
    p = _ptr(dtype)
    cases = []
    torch_dtype = DTYPES[dtype]
    for name in epilogues:
        has_bias, has_residual, activation, dropout, grad = EPILOGUES[name]
        heavy = dropout or grad
        reachable = [*gemm.gpu_configs(torch_dtype, heavy),
                     *(gemm.table_config(m, torch_dtype, heavy) for m in TABLE_MS)]
        for config in {gemm.config_key(c): c for c in reachable}.values():  # autotuner list + M table
            r_strides = (n, 1) if has_residual else (0, 0)
            g_strides = (n, 1) if grad else (0, 0)
            args = (p, p, p, p, p, p, _ptr("fp32"), m, n, k, k, 1, k, 1, *r_strides, n, 1, *g_strides,
                    *(DROPOUT_ARGS if dropout else (0, 0.0, 1.0)), triton.next_power_of_2(m))
            kw = dict(HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, ACTIVATION=activation, DROPOUT=dropout,
                      GRAD_ACTIVATION=grad, PARTIAL_BLOCK_M=gemm.MIN_BLOCK_M,
                      INPUT_PRECISION=common.dot_precision(DTYPES[dtype]), DOT_IN_FP32=False, **config.kwargs,
                      num_warps=config.num_warps, num_stages=config.num_stages)
            c = config.kwargs
            label = (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{config.num_warps} s{config.num_stages} "
                     f"{name}")
            cases.append(("gemm", dtype, label, args, kw))
    return cases


def glu_cases(dtype: str, activations, biases=(False, True)) -> list:
    """linear_glu's two-accumulator GEMM at ModernBERT-base sizes (I = 1152, W [2I, H]) for every config the autotuner
    or the M table can pick; ``biases``: without bias (ModernBERT's mlp_bias=False) and/or with."""
    m, inner, k = TOKENS, GLU_INTERMEDIATE, HIDDEN
    p = _ptr(dtype)
    torch_dtype = DTYPES[dtype]
    reachable = [*glu.gpu_configs(torch_dtype), *(glu.table_config(m, torch_dtype) for m in TABLE_MS)]
    cases = []
    for config in {gemm.config_key(c): c for c in reachable}.values():
        for activation in activations:
            for has_bias in biases:
                args = (p, p, p, p, m, inner, k, k, 1, k, 1, inner, 1, triton.next_power_of_2(m))
                kw = dict(HAS_BIAS=has_bias, ACTIVATION=gemm.ACTIVATION_CODES[activation],
                          INPUT_PRECISION=common.dot_precision(torch_dtype), DOT_IN_FP32=False, **config.kwargs,
                          num_warps=config.num_warps, num_stages=config.num_stages)
                c = config.kwargs
                label = (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{config.num_warps} s{config.num_stages} "
                         f"{activation}{'' if has_bias else ' no-bias'}")
                cases.append(("linear_glu", dtype, label, args, kw))
    return cases



def qkv_rotary_cases(dtype: str, biases=(False, True)) -> list:
    """qkv_rotary's GEMM with the rotary epilogue at ModernBERT-base sizes (H = 768, 12 heads of D = 64, W [3H, H],
    8192 table rows) for every config the autotuner or the M table can pick; ``biases``: without bias (ModernBERT's
    attention_bias=False) and/or with."""
    m, n, k, head_dim = TOKENS, 3 * HIDDEN, HIDDEN, HIDDEN // HEADS
    p = _ptr(dtype)
    torch_dtype = DTYPES[dtype]
    reachable = [*rotary.gpu_configs(torch_dtype),
                 *(rotary.pair_config(gemm.table_config(m, torch_dtype)) for m in TABLE_MS)]
    cases = []
    for config in {gemm.config_key(c): c for c in reachable}.values():
        for has_bias in biases:
            # x, W, bias, positions, cos, sin, out, M, N, K, rotated columns, table rows, strides, M bucket
            args = (p, p, p, _ptr("int64"), _ptr("fp32"), _ptr("fp32"), p, m, n, k, 2 * HIDDEN, 8192, k, 1, k, 1,
                    head_dim // 2, n, 1, triton.next_power_of_2(m))
            kw = dict(HALF=head_dim // 2, HAS_BIAS=has_bias, INPUT_PRECISION=common.dot_precision(torch_dtype),
                      DOT_IN_FP32=False, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
            c = config.kwargs
            label = (f"{c['BLOCK_M']}x{2 * c['BLOCK_C']}x{c['BLOCK_K']} w{config.num_warps} s{config.num_stages}"
                     f"{'' if has_bias else ' no-bias'}")
            cases.append(("qkv_rotary", dtype, label, args, kw))
    return cases


def attention_cases(dtype: str, quick: bool = False) -> list:
    """Global and sliding-window attention (ModernBERT's local_attention 128: window_half 64, its own meta), packed
    and padded, per head dim."""
    p = _ptr(dtype)
    cases = []
    for head_dim in (32, 64, 80, 96, 128):
        hd = HEADS * head_dim
        for window in (False, True):
            base = attention._meta(head_dim, 512, DTYPES[dtype], window=window)
            metas = [base]
            if base["BLOCK_M"] == 128 and not quick:  # the small-batch variant `_launch` switches to (fewer registers)
                metas.append({**base, "BLOCK_M": 64})
            # (packed, dropout, meta): training's dropout variant (its own meta) compiled for the packed form
            variants = [(packed, False, meta) for meta in metas for packed in (True, False)]
            if not quick:
                variants.append((True, True, attention._meta(head_dim, 512, DTYPES[dtype], window, dropout=True)))
            for packed, dropout, meta in variants:
                if packed:  # q, k, v: [1, T, heads, D] views of the [T, 3, heads, D] projection; out contiguous
                    qkv = (TOKENS * 3 * hd, 3 * hd, head_dim, 1)
                    out = (TOKENS * hd, hd, head_dim, 1)
                    rest = (_ptr("int32"), p, 0, 0, TOKENS)  # cu_seqlens, mask placeholder (q), strides, seqlen
                else:  # [B, S, heads, D] views of [B, S, 3, heads, D]; uint8 mask [B, S]
                    qkv = (SEQ * 3 * hd, 3 * hd, head_dim, 1)
                    out = (SEQ * hd, hd, head_dim, 1)
                    rest = (p, _ptr("uint8"), SEQ, 1, SEQ)
                args = (p, *qkv, p, *qkv, p, *qkv, p, *out, *rest, head_dim, 0.125 * 1.4426950408889634,
                        64 if window else 0, 6554, 1 / 0.9, 12345)  # dropout: p = 0.1 as 16-bit threshold
                kw = dict(PACKED=packed, HAS_MASK=not packed, WINDOW=window, DROPOUT=dropout,
                          INPUT_PRECISION=common.dot_precision(DTYPES[dtype]), DOT_IN_FP32=False, **meta)
                label = (f"d{head_dim} {meta['BLOCK_M']}x{meta['BLOCK_N']}x{meta['BLOCK_D']} "
                         f"w{meta['num_warps']} s{meta['num_stages']} {'packed' if packed else 'padded'}"
                         f"{' window' if window else ''}{' dropout' if dropout else ''}")
                cases.append(("attention", dtype, label, args, kw))
    return cases


def attention_backward_cases(dtype: str, quick: bool = False) -> list:
    """The two backward kernels (dq with the LSE pass; dk/dv) per head dim, packed and padded; with a window and
    dropout (the heaviest variant: band mask and Philox tiles) and without. --quick: D = 128 (the largest BERT
    head), padded with window and dropout, packed without."""
    p, f32 = _ptr(dtype), _ptr("fp32")
    cases = []
    for head_dim in (128,) if quick else (32, 64, 80, 96, 128, 256):
        hd = HEADS * head_dim
        for packed in (True, False):
            if packed:  # q, k, v: views of the [T, 3, heads, D] projection; O, dO and the gradients contiguous
                qkv, dense = (TOKENS * 3 * hd, 3 * hd, head_dim, 1), (TOKENS * hd, hd, head_dim, 1)
                rest = (_ptr("int32"), p, 0, 0, TOKENS, 512)  # cu_seqlens, mask placeholder, strides, seqlen, rows
            else:
                qkv, dense = (SEQ * 3 * hd, 3 * hd, head_dim, 1), (SEQ * hd, hd, head_dim, 1)
                rest = (p, _ptr("uint8"), SEQ, 1, SEQ, SEQ)
            tail = (head_dim, 0.125 * 1.4426950408889634, 0.125, 64, 6554, 1 / 0.9, 12345)
            for window, dropout in ((not packed, not packed),) if quick else ((False, False), (True, True)):
                metas = attention._backward_meta(head_dim, 512, DTYPES[dtype], heavy=window or dropout)
                for kernel, meta in zip(("attention_backward_dq", "attention_backward_dkdv"), metas, strict=True):
                    kw = dict(PACKED=packed, HAS_MASK=not packed, WINDOW=window, DROPOUT=dropout,
                              INPUT_PRECISION=common.dot_precision(DTYPES[dtype]), DOT_IN_FP32=False, **meta)
                    label = (f"d{head_dim} {meta['BLOCK_M']}x{meta['BLOCK_N']}x{meta['BLOCK_D']} "
                             f"w{meta['num_warps']} s{meta['num_stages']} {'packed' if packed else 'padded'}"
                             f"{' window dropout' if window else ''}")
                    # q, k, v, then O, dO, dq (dq kernel) or dO, dk, dv (dk/dv kernel): the same argument layout
                    args = (p, *qkv, p, *qkv, p, *qkv, p, *dense, p, *dense, p, *dense, f32, f32, *rest, *tail)
                    cases.append((kernel, dtype, label, args, kw))
    return cases


def row_cases(dtype: str) -> list:
    p = _ptr(dtype)
    cases = []
    for width in (384, 768, 1024):
        rows = common.rows_per_program(width)
        warps = common.row_warps(width, rows)
        block = common.row_block(width)
        i64 = _ptr("int64")
        gather = (i64, i64, i64, p, width, 1, p, width, 1, p, width, 1)
        args = (*gather, p, p, p, TOKENS, width, 1e-12, *DROPOUT_ARGS)
        # BERT's (every table, LayerNorm bias; with dropout as in training) and ModernBERT's (word table only, no
        # LayerNorm bias)
        for label, full, dropout in (("", True, False), (" dropout", True, True),
                                     (" no-position no-bias", False, False)):
            kw = dict(HAS_POSITION=full, HAS_BIAS=full, HAS_TYPE_TABLE=full, HAS_TYPE_IDS=full, DROPOUT=dropout,
                      ROWS=rows, BLOCK_E=block, num_warps=warps)
            cases.append(("embedding_layernorm", dtype, f"E{width} rows{rows} w{warps}{label}", args, kw))
        # in place with bias (linear_residual_layernorm), into a second buffer without (linear_residual_prenorm)
        args = (p, p, p, p, TOKENS, width, width, width, 1e-12)
        for label, has_bias in (("", True), (" no-bias", False)):
            kw = dict(HAS_BIAS=has_bias, ROWS=rows, BLOCK_N=block, num_warps=warps)
            cases.append(("layernorm_rows", dtype, f"N{width} rows{rows} w{warps}{label}", args, kw))
        # the backward kernels, with dropout (the heaviest variant) and prenorm's extra gradient
        back_rows = common.backward_rows_per_program(width)
        back_warps = common.backward_row_warps(width, back_rows)
        f32 = _ptr("fp32")
        args = (*gather, p, p, width, 1, f32, f32, TOKENS, width, 1e-12, *DROPOUT_ARGS)
        kw = dict(HAS_POSITION=True, HAS_TYPE_TABLE=True, HAS_TYPE_IDS=True, DROPOUT=True, ROWS=back_rows,
                  BLOCK_E=block, num_warps=back_warps)
        cases.append(("embedding_layernorm_backward", dtype, f"E{width} rows{back_rows} w{back_warps} dropout", args,
                      kw))
        args = (p, p, p, p, p, p, f32, TOKENS, width, width, width, 1, width, 1, 1e-12, *DROPOUT_ARGS)
        for label, extra, dropout in ((" post-LN dropout", False, True), (" prenorm dropout", True, True),
                                      (" prenorm", True, False)):
            kw = dict(HAS_EXTRA_GRAD=extra, DROPOUT=dropout, ROWS=back_rows, BLOCK_N=block, num_warps=back_warps)
            cases.append(("layernorm_rows_backward", dtype, f"N{width} rows{back_rows} w{back_warps}{label}", args,
                          kw))
    args = (p, p, p, _ptr("fp32"), TOKENS, INTERMEDIATE, INTERMEDIATE, 1, INTERMEDIATE, 1)
    cases.append(("relu_grad", dtype, "32x128 w4", args, dict(BLOCK_M=32, BLOCK_N=128, num_warps=4)))
    if dtype == "fp32":  # the second stage of the backward reductions: fp32 partial sums only
        args = (_ptr("fp32"), _ptr("fp32"), 528, 3 * HIDDEN)
        cases.append(("column_sum", dtype, "32x64 w4", args, dict(BLOCK_P=32, BLOCK_N=64, num_warps=4)))
    return cases


def split_k_cases(dtype: str, quick: bool = False) -> list:
    """The GEMM's split-K path at the shapes it is taken for (16 or 32 tokens, N = 768, K = 3072 in slices of 512):
    the slice kernel with `gemm.split_k_meta`, the reduction with the forward epilogues (--quick: the two
    heaviest)."""
    m, n, k, splits = 16, HIDDEN, INTERMEDIATE, 6
    p, f32 = _ptr(dtype), _ptr("fp32")
    cases = []
    for rows in (16, 32):
        meta = gemm.split_k_meta(rows)
        kw = dict(INPUT_PRECISION=common.dot_precision(DTYPES[dtype]), DOT_IN_FP32=False, **meta)
        label = f"{meta['BLOCK_M']}x{meta['BLOCK_N']}x{meta['BLOCK_K']} w{meta['num_warps']} s{meta['num_stages']}"
        cases.append(("gemm_split_k", dtype, label, (p, p, f32, rows, n, k, k, 1, k, 1, k // splits), kw))
    block_m, block_n = gemm.split_k_epilogue_blocks()
    for name in ("gelu", "residual dropout") if quick else ("qkv", "gelu", "residual", "residual dropout"):
        has_bias, has_residual, activation, dropout, _ = EPILOGUES[name]
        args = (f32, p, p, p, m, n, splits, n, 1, n, 1, *(DROPOUT_ARGS if dropout else (0, 0.0, 1.0)))
        kw = dict(HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, ACTIVATION=activation, DROPOUT=dropout,
                  BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
        cases.append(("gemm_split_k_epilogue", dtype, f"{block_m}x{block_n} w4 {name}", args, kw))
    return cases


def epilogue_cases(dtype: str, quick: bool = False) -> list:
    """The vendor backend's epilogue kernels (`epilogues`: after torch's GEMM) with the launchers' meta at BERT and
    ModernBERT widths: the activation in place, residual + LayerNorm (in place, and prenorm's sum + LayerNorm), GLU
    and rotary (--quick: gelu only, width 768 only)."""
    p = _ptr(dtype)
    cases = []
    block = epilogues.elementwise_block()
    for activation in ("gelu",) if quick else ("gelu", "gelu_tanh", "silu"):
        cases.append(("epilogue_activation", dtype, f"{block} w4 {activation}", (p, TOKENS * INTERMEDIATE),
                      dict(ACTIVATION=gemm.ACTIVATION_CODES[activation], BLOCK=block, num_warps=4)))
    for width in (768,) if quick else (384, 768, 1024):
        rows = common.rows_per_program(width)
        warps = common.row_warps(width, rows)
        args = (p, p, p, p, p, TOKENS, width, width, 1e-12)
        for label, has_bias, store_sum in (("", True, False), (" prenorm", True, True), (" prenorm no-bias", False,
                                                                                           True)):
            kw = dict(HAS_BIAS=has_bias, STORE_SUM=store_sum, ROWS=rows, BLOCK_N=common.row_block(width),
                      num_warps=warps)
            cases.append(("epilogue_residual_layernorm", dtype, f"N{width} rows{rows} w{warps}{label}", args, kw))
    block_m, block_n = epilogues.glu_blocks()
    cases.append(("epilogue_glu", dtype, f"{block_m}x{block_n} w4 gelu", (p, p, TOKENS, GLU_INTERMEDIATE),
                  dict(ACTIVATION=gemm.ACTIVATION_CODES["gelu"], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)))
    head_dim = HIDDEN // HEADS
    rows, block_p = epilogues.rotary_blocks(HIDDEN)
    args = (p, _ptr("int64"), _ptr("fp32"), _ptr("fp32"), TOKENS, 3 * HIDDEN, HIDDEN, 8192, head_dim // 2)
    cases.append(("epilogue_rotary", dtype, f"d{head_dim} rows{rows} pairs{block_p} w4", args,
                  dict(HALF=head_dim // 2, ROWS=rows, BLOCK_P=block_p, num_warps=4)))
    return cases


def all_cases(quick: bool = False) -> list:
    epilogues = QUICK_EPILOGUES if quick else tuple(EPILOGUES)
    glu = (QUICK_GLU_ACTIVATIONS, (False,)) if quick else (GLU_ACTIVATIONS, (False, True))
    return [case for dtype in DTYPES
            for case in (*gemm_cases(dtype, epilogues), *glu_cases(dtype, *glu),
                         *qkv_rotary_cases(dtype, (False,) if quick else (False, True)),
                         *attention_cases(dtype, quick), *attention_backward_cases(dtype, quick),
                         *row_cases(dtype), *split_k_cases(dtype, quick), *epilogue_cases(dtype, quick))]


_BACKEND = None


def _backend():
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = make_backend(TARGET)
        knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v's log: registers and spills
    return _BACKEND


_PTXAS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def _ptxas_stats(log: str, ptx: str) -> tuple[int, int]:
    """(registers, spill store bytes) from ptxas -v; re-runs ptxas on the PTX when the cubin came from the cache."""
    found = _PTXAS.search(log)
    if found is None:
        from triton.backends.nvidia.compiler import get_ptxas
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            done = subprocess.run([get_ptxas(90).path, "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a",
                                   src, "-o", src + ".o"], capture_output=True, text=True, check=True)
        found = _PTXAS.search(done.stderr + done.stdout)
    return int(found.group(3)), int(found.group(1))


def compile_case(case) -> dict:
    """Compile one case as `kernel[grid](*args, **kw)` would on an sm_90 device; return its resources."""
    kernel, dtype, label, args, kw = case
    fn = KERNELS[kernel]
    backend = _backend()
    args = tuple(MockTensor(getattr(torch, a[1]) if a[1] in ("int32", "int64", "uint8") else DTYPES[a[1]])
                 if isinstance(a, tuple) else a for a in args)
    kw = dict(kw, debug=False)
    row = {"kernel": kernel, "dtype": dtype, "config": label}
    start = time.perf_counter()
    try:
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kw)
        options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, options)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                                      options=options.__dict__)
        regs, spills = _ptxas_stats(log.getvalue(), compiled.asm["ptx"])
    except Exception as err:  # noqa: BLE001 - report every case, then fail
        row["error"] = f"{type(err).__name__}: {err}"[:2000]
        return row
    warps = compiled.metadata.num_warps
    shared = compiled.metadata.shared
    regs_per_warp = math.ceil(regs * 32 / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = (REGS_PER_SM // regs_per_warp) // warps
    by_smem = SMEM_PER_SM // (shared + SMEM_RESERVED_PER_BLOCK)
    blocks = min(by_regs, by_smem, MAX_WARPS_PER_SM // warps, MAX_BLOCKS_PER_SM)
    row.update(warps=warps, stages=compiled.metadata.num_stages, registers=regs, spill_bytes=spills,
               shared_bytes=shared, blocks_per_sm=blocks, occupancy=round(blocks * warps / MAX_WARPS_PER_SM, 3),
               limited_by=min((by_regs, "registers"), (by_smem, "shared"), (MAX_WARPS_PER_SM // warps, "warps"))[1],
               compile_s=round(time.perf_counter() - start, 2))
    return row


def problems(row: dict) -> list[str]:
    if "error" in row:
        return [row["error"]]
    found = []
    if row["spill_bytes"]:
        found.append(f"spills {row['spill_bytes']} B")
    if row["shared_bytes"] > SMEM_PER_BLOCK:
        found.append(f"shared memory {row['shared_bytes']} B > {SMEM_PER_BLOCK} B per block")
    return found


def markdown(rows: list[dict], host: dict) -> str:
    lines = ["# sm_90 (H100/H200) resources of the triton kernels",
             "",
             f"Compiled {host['date']} on {host['cpu']} ({host['cpu_cores']} CPUs, no GPU); python {host['python']}, "
             f"torch {host['versions'].get('torch')}, triton {triton.__version__}.",
             "",
             "Compiled without a GPU with the launch's own argument specialisation (tools/compile_sm90.py, "
             f"triton {triton.__version__}); registers and spills from ptxas -v. Occupancy: resident blocks per SM "
             "from 64 K registers, 228 KB shared memory (+1 KB per block), 64 warps; as a fraction of 64 warps. "
             "No kernel may spill.",
             "",
             "| kernel | dtype | config | warps | registers | spills (B) | shared (B) | blocks/SM | occupancy "
             "| limited by |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['dtype']} | {r['config']} | error | | | | | | |")
            continue
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['config']} | {r['warps']} | {r['registers']} "
                     f"| {r['spill_bytes']} | {r['shared_bytes']} | {r['blocks_per_sm']} | {r['occupancy']:.0%} "
                     f"| {r['limited_by']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("FASTBERT_SM90_OUT"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    opts = parser.parse_args(argv)
    cases = all_cases(opts.quick)
    start = time.perf_counter()
    if opts.jobs > 1:
        import multiprocessing
        with ProcessPoolExecutor(opts.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            rows = list(pool.map(compile_case, cases))
    else:
        rows = [compile_case(c) for c in cases]
    failures = 0
    for r in rows:
        found = problems(r)
        failures += bool(found)
        if "error" in r:
            print(f"FAIL {r['kernel']} {r['dtype']} {r['config']}: {r['error']}")
            continue
        print(f"{'FAIL' if found else 'ok  '} {r['kernel']} {r['dtype']} {r['config']}: {r['registers']} regs, "
              f"{r['spill_bytes']} B spilled, {r['shared_bytes']} B shared, occupancy {r['occupancy']:.0%}"
              + (f" -- {'; '.join(found)}" if found else ""))
    print(f"{len(rows)} kernels compiled in {time.perf_counter() - start:.0f} s, {failures} failing")
    if opts.out:
        os.makedirs(opts.out, exist_ok=True)
        from fastbert.bench.machine import machine_info

        host = machine_info("cpu")  # the compiling machine: date, CPU, versions
        with open(os.path.join(opts.out, "resources.json"), "w") as f:
            json.dump({"triton": triton.__version__, "target": "sm_90", "host": host, "rows": rows}, f, indent=1)
        with open(os.path.join(opts.out, "resources.md"), "w") as f:
            f.write(markdown(rows, host))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
