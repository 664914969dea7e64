"""What the kernel tests share: the device they run on and the accuracy rule.

Rule (common.md): a fp16/bf16 result's max error against an fp64 reference must be at most twice the error of
plain PyTorch in the same dtype, plus half an ulp at the reference's magnitude; fp32 results must match to ~1e-5
relative. On CPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET=1), on a GPU natively.
"""

from __future__ import annotations

import math

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF_DTYPES = (torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    diff = (actual.double() - reference.double()).abs()
    if diff.isnan().any():
        return float("inf")
    return float(diff.max()) if diff.numel() else 0.0


def assert_accurate(fast: torch.Tensor, plain: torch.Tensor, reference: torch.Tensor, what: str = "") -> None:
    """fast and plain in the tested dtype, reference in fp64 (or fp32); see the module docstring."""
    assert fast.shape == reference.shape, f"{what}: shape {tuple(fast.shape)} != {tuple(reference.shape)}"
    assert fast.dtype == plain.dtype, f"{what}: dtype {fast.dtype} != {plain.dtype}"
    assert not fast.isnan().any(), f"{what}: NaN in the result"
    scale = max(float(reference.abs().max()), 1e-6) if reference.numel() else 1.0
    fast_err = max_error(fast, reference)
    if fast.dtype == torch.float32:
        assert fast_err <= 1e-5 * scale, f"{what}: fp32 error {fast_err:.3g} > 1e-5 x {scale:.3g}"
        return
    plain_err = max_error(plain, reference)
    assert math.isfinite(plain_err), f"{what}: plain PyTorch's result is not finite: the rule would pass anything"
    atol = torch.finfo(fast.dtype).eps / 2 * scale
    assert fast_err <= 2 * plain_err + atol, (
        f"{what}: error {fast_err:.3g} > 2 x plain PyTorch's {plain_err:.3g} + {atol:.3g}")


def rand(*shape: int, dtype: torch.dtype, scale: float = 1.0, generator: torch.Generator | None = None):
    return (torch.randn(*shape, generator=generator) * scale).to(device=DEVICE, dtype=dtype)
