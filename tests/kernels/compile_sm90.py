"""Compile every triton kernel of fastbert for an sm_90 (H100/H200) target without a GPU: Triton's bundled ptxas
turns them into cubins, which catches what the interpreter cannot (typing, layouts, shared memory sizes). Run in a
process where TRITON_INTERPRET is unset (tests/kernels/test_compile_sm90.py does). Prints one line per kernel."""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from fastbert.kernels import _gemm, attention  # noqa: E402
from fastbert.kernels import embedding_layernorm as embedding  # noqa: E402
from fastbert.kernels import linear_residual_layernorm as residual_ln  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTER = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def compile_kernel(fn, pointers: dict, floats: tuple, constexprs: dict, options: dict) -> int:
    """Compile with the given pointer types; other non-constexpr args are i64 strides/sizes or fp32 scalars.
    Returns the kernel's shared memory bytes."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i64"
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options=options)
    return kernel.metadata.shared


def cases(dtype: torch.dtype):
    ptr = POINTER[dtype]
    precision = "ieee" if dtype == torch.float32 else "tf32"
    gemm_ptrs = {n: ptr for n in ("x_ptr", "w_ptr", "bias_ptr", "residual_ptr", "out_ptr")}
    for config, activation, residual in ((_gemm.GPU_CONFIGS[0], 1, False), (_gemm.GPU_CONFIGS[-1], 2, True)):
        consts = dict(HAS_BIAS=True, HAS_RESIDUAL=residual, ACTIVATION=activation, INPUT_PRECISION=precision,
                      DOT_IN_FP32=False, **config.kwargs)
        yield (f"gemm {config.kwargs}", _gemm._linear_kernel, gemm_ptrs, (), consts,
               {"num_warps": config.num_warps, "num_stages": config.num_stages})
    attention_ptrs = {n: ptr for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    attention_ptrs.update(cu_seqlens_ptr="*i32", mask_ptr="*u8")
    for head_dim, packed in ((64, True), (80, False), (128, True)):
        meta = attention._meta(head_dim, 512, dtype)
        options = {k: meta.pop(k) for k in ("num_warps", "num_stages")}
        consts = dict(PACKED=packed, HAS_MASK=not packed, INPUT_PRECISION=precision, DOT_IN_FP32=False, **meta)
        yield f"attention d{head_dim} packed={packed}", attention._attention_kernel, attention_ptrs, ("qk_scale",), \
            consts, options
    embedding_ptrs = {n: ptr for n in ("word_ptr", "position_ptr", "type_ptr", "weight_ptr", "bias_ptr", "out_ptr")}
    embedding_ptrs.update(input_ids_ptr="*i64", position_ids_ptr="*i64", token_type_ids_ptr="*i32")
    yield ("embedding_layernorm", embedding._embedding_layernorm_kernel, embedding_ptrs, ("eps",),
           dict(HAS_TYPE_TABLE=True, HAS_TYPE_IDS=True, ROWS=4, BLOCK_E=1024), {"num_warps": 4})
    yield ("layernorm_rows", residual_ln._layernorm_rows_kernel, {n: ptr for n in ("x_ptr", "weight_ptr", "bias_ptr")},
           ("eps",), dict(ROWS=4, BLOCK_N=1024), {"num_warps": 4})


def main() -> int:
    failures = 0
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for name, fn, pointers, floats, consts, options in cases(dtype):
            try:
                shared = compile_kernel(fn, pointers, floats, consts, options)
                print(f"ok   {dtype} {name}: {shared} B shared memory")
            except Exception as err:  # noqa: BLE001 - report every kernel, then fail
                failures += 1
                print(f"FAIL {dtype} {name}: {type(err).__name__}: {err}"[:2000])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
