"""Shared pieces of the triton backend: where it can run, dtype checks, and the meta-parameter policy.

Triton kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter. Whether the interpreter is on
is decided by triton when a kernel is decorated (``TRITON_INTERPRET=1`` must be in the environment before
`fastbert.kernels` is imported), so it is read once here from a decorated probe kernel, not from the environment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_kernel(ptr):
    tl.store(ptr, 0)


INTERPRETER: bool = type(_probe_kernel).__name__ == "InterpretedFunction"
"""True when triton runs kernels in its interpreter. For bf16 inputs the kernels then cast `tl.dot` operands to fp32
first (flag DOT_IN_FP32): the interpreter multiplies bf16 operands as raw integer bits (wrong by ~1e10, triton 3.9).
Products of bf16 values are exact in fp32, so results equal an fp32-accumulated GPU dot up to summation order.
fp16 operands go to `tl.dot` unmodified, as on a GPU: the interpreter's fp16 dot is right, so every fp16 test runs
the dot path the GPU runs."""


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels must widen `tl.dot` operands of this dtype (the interpreter's bf16 dot is wrong)."""
    return INTERPRETER and dtype == torch.bfloat16

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreter_index_fix() -> bool:
    """Loops over a runtime length (``range(0, K, BLOCK_K)``) call ``int()`` on the interpreter's scalar, a 1-element
    1-d numpy array; numpy >= 2.4 refuses that ("only 0-dimensional arrays can be converted to Python scalars").
    triton >= 3.7 squeezes first; on older ones (3.6) the interpreter's patch of ``tl.tensor.__index__`` is wrapped
    to do the same. Interpreter only: compiled kernels never see this. Returns whether the wrapper was installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_fastbert_index_fix", False):
        return False

    def patch_lang_tensor(tensor, scope, *args, **kwargs):
        result = original(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
        return result

    patch_lang_tensor._fastbert_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


if INTERPRETER:
    _interpreter_index_fix()

_INTERPRETED = tl.constexpr(INTERPRETER)


@triton.jit
def layernorm_tile(x, mask, offs_col, col_mask, weight_ptr, bias_ptr, width, eps, HAS_BIAS: tl.constexpr):
    """LayerNorm of each row of an fp32 tile x [ROWS, BLOCK] (``mask``: real elements; padding columns may hold
    anything), statistics in fp32; returns the normalised, scaled and (when HAS_BIAS) shifted fp32 tile."""
    mean = tl.sum(tl.where(mask, x, 0.0), axis=1) / width
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / width + eps)
    weight = tl.load(weight_ptr + offs_col, mask=col_mask, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * weight[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def cast_rtne(x, dtype: tl.constexpr):
    """x.to(dtype) rounded to nearest even. A GPU cast already rounds so; the interpreter (triton 3.9) truncates
    fp32 -> bf16, which would double bf16 errors, so there the rounding is done on the bits first."""
    if _INTERPRETED:  # nested constexpr ifs: compile-time on every triton version
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


def device_reason(tensors: list[torch.Tensor | None]) -> str | None:
    """Why these tensors cannot be handed to a triton kernel (device and dtype agreement), or None."""
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    if len(devices) > 1:
        return f"tensors are on different devices {sorted(str(d) for d in devices)}"
    device = next(iter(devices))
    if device.type == "cpu":
        if not INTERPRETER:
            return "tensors are on cpu and TRITON_INTERPRET is not set (set it to 1 before importing fastbert.kernels)"
    elif device.type != "cuda":
        return f"tensors are on {device.type}; the triton backend runs on cuda (or cpu under TRITON_INTERPRET=1)"
    return None


def float_reason(tensors: list[torch.Tensor | None]) -> str | None:
    """Why these floating tensors are not one dtype the kernels take (fp16, bf16, fp32), or None."""
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) > 1:
        return f"mixed dtypes {sorted(str(d).removeprefix('torch.') for d in dtypes)}"
    dtype = next(iter(dtypes))
    if dtype not in FLOAT_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} (the triton backend takes float16, bfloat16, float32)"
    return None


def first_reason(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r), None)


def tl_dtype(dtype: torch.dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs are multiplied in full precision (not TF32) so the fp32 path matches PyTorch to ~1e-5."""
    return "ieee" if dtype == torch.float32 else "tf32"


def row_block(width: int) -> int:
    """Power-of-two block covering a whole row of ``width`` elements (LayerNorm needs the full row)."""
    return triton.next_power_of_2(width)


def rows_per_program(width: int) -> int:
    """Rows one LayerNorm-style program handles: several under the interpreter (per-program overhead dominates
    there), one row per program on a GPU for wide rows, a few for narrow ones."""
    if INTERPRETER:
        return 16
    return max(1, min(16, 4096 // row_block(width)))


def row_warps(width: int, rows: int = 1) -> int:
    """Warps for a program holding ``rows`` x row_block(width) fp32 values: ~32 values per thread and tensor."""
    elements = rows * row_block(width)
    return max(1, min(8, elements // 1024))
