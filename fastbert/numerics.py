"""The accuracy rule of fastbert's fast path: one rule for the tests, `fastbert check` and benchmarks/gpu_check.py.

float16 / bfloat16: the fast path's max absolute error against a higher-precision reference (fp32 or fp64) must be
at most twice the error of plain PyTorch in the same dtype, plus an atol of HALF_ATOL_REL[dtype] x max|reference|:

    err(fast) <= 2 x err(plain PyTorch, same dtype) + HALF_ATOL_REL[dtype] x max|reference|

A low-precision result cannot be judged against a fixed tolerance (its error grows with the width of the reductions
and the magnitudes involved), so plain PyTorch's own error in that dtype is the yardstick; twice it leaves room for
a different (but no worse) order of summation. The atol is half a unit in the last place at the reference's
largest magnitude, what rounding the output alone costs, so that a case where plain PyTorch happens to be exact
does not demand exactness.

float32: the relative error max|fast - reference| / max|reference| must be at most a tolerance that depends on what
is compared: FP32_OP_REL (1e-5) for one op, FP32_MODEL_REL (1e-4) for a whole model, whose layers add up errors.
"""

from __future__ import annotations

import math

import torch

HALF_ERR_FACTOR = 2.0
HALF_ATOL_REL = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}  # half of finfo(dtype).eps
FP32_OP_REL = 1e-5
FP32_MODEL_REL = 1e-4


def max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """max |actual - reference| in fp64; inf when the difference holds a NaN, 0 for empty tensors."""
    diff = (actual.double() - reference.double()).abs()
    if diff.isnan().any():
        return float("inf")
    return float(diff.max()) if diff.numel() else 0.0


def judge(dtype: torch.dtype, fast_err: float, plain_err: float | None, scale: float,
          fp32_rel: float = FP32_OP_REL, plain_name: str = "plain PyTorch") -> tuple[bool, str]:
    """(passed, the comparison in words) for a result in ``dtype`` whose max error against the reference is
    ``fast_err``; ``plain_err``: the error of ``plain_name`` (plain PyTorch) in the same dtype, needed for
    float16/bfloat16 only; ``scale``: max|reference|. See the module docstring."""
    if dtype not in HALF_ATOL_REL:
        relative = fast_err / max(scale, 1e-30)
        ok = relative <= fp32_rel
        return ok, f"max rel err {relative:.2e} {'<=' if ok else '>'} {fp32_rel:g}"
    if plain_err is None or not math.isfinite(plain_err):
        return False, f"{plain_name}'s error in {dtype} is {plain_err}: the rule would pass anything"
    atol = HALF_ATOL_REL[dtype] * scale
    limit = HALF_ERR_FACTOR * plain_err + atol
    ok = fast_err <= limit
    return ok, (f"err {fast_err:.2e} {'<=' if ok else '>'} 2 x {plain_name} err {plain_err:.2e} + atol {atol:.1e} "
                f"= {limit:.2e}")


def assert_accurate(fast: torch.Tensor, plain: torch.Tensor, reference: torch.Tensor, what: str = "",
                    fp32_rel: float = FP32_OP_REL) -> None:
    """Raise AssertionError unless ``fast`` meets the rule: fast and plain in the tested dtype, reference in fp64
    (or fp32). Also checks shape and dtype, and that fast holds no NaN."""
    if fast.shape != reference.shape:
        raise AssertionError(f"{what}: shape {tuple(fast.shape)} != {tuple(reference.shape)}")
    if fast.dtype != plain.dtype:
        raise AssertionError(f"{what}: dtype {fast.dtype} != {plain.dtype}")
    if fast.isnan().any():
        raise AssertionError(f"{what}: NaN in the result")
    scale = max(float(reference.abs().max()), 1e-6) if reference.numel() else 1.0
    plain_err = max_error(plain, reference) if fast.dtype in HALF_ATOL_REL else None
    passed, why = judge(fast.dtype, max_error(fast, reference), plain_err, scale, fp32_rel)
    if not passed:
        raise AssertionError(f"{what}: {why}")
