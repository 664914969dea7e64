"""Dropout as the fused ops take it: a probability ``dropout_p`` and an integer ``dropout_seed``.

The eager implementations, the references and the backward formulas in PyTorch ops drop elements with `dropout`
(attention's eager probabilities with `keep_mask`): deterministic functions of (shape, p, seed, device), so that a
backward regenerates exactly the forward's mask from the seed instead of storing it, and a run is reproducible for
a given seed. `dropout` runs the kernel registered for the tensor's device (`register_kernel`: on CPU the C++
extension's counter-based ``fastbert::cpp_dropout``, one pass, no mask tensor, its backward the same kernel on the
gradient), else applies `keep_mask`'s mask. A backend that fuses dropout into its kernel may draw its own mask
(Triton: Philox from the same seed); its backward then regenerates that one. Masks of different backends differ for
p > 0; with p = 0 every backend computes the op without dropout.

The model draws one seed per forward from torch's default generator (`draw_seed`), so ``torch.manual_seed`` makes a
training run reproducible, and derives each op call's seed from it (`op_seed`).

Under torch.compile a seed read from a tensor would break the graph, and a ``torch.Generator`` cannot be created
inside one: there `keep_mask` draws from torch's default generator, which the compiler traces (and inductor
fuses), ignoring the seed, and only the eager implementations run dropout (`fastbert.backends` declines the
others, whose kernels would take the seed). The mask is saved by autograd rather than regenerated.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

SEED_LIMIT = 1 << 62  # seeds lie in [0, SEED_LIMIT): room to add op indices without overflowing an int64


def check_dropout(name: str, dropout_p: float, dropout_seed: int) -> None:
    """ValueError unless 0 <= dropout_p <= 1 and the seed is an int in [0, 2**63)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{name}: dropout_p must be a float in [0, 1], got {dropout_p!r}")
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int) or not 0 <= dropout_seed < 1 << 63:
        raise ValueError(f"{name}: dropout_seed must be an int in [0, 2**63), got {dropout_seed!r}")


def keep_mask(shape: tuple[int, ...] | torch.Size, p: float, seed: int, device: torch.device | str) -> torch.Tensor:
    """Bool [shape]: True where an element is kept (probability 1 - p, p rounded to a multiple of 2**-32), the same
    for the same arguments (under torch.compile: from torch's traced default generator, see the module docstring).
    Each element compares 32 random bits with p's threshold, two elements per 64-bit draw: several times faster on
    CPU than comparing ``torch.rand``'s floats, which cost a 32-bit draw and a conversion each."""
    if torch.compiler.is_compiling():
        return torch.rand(shape, device=device) >= p
    if p >= 1.0:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    count = math.prod(shape)
    words = torch.empty((count + 1) // 2, dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)  # every 64-bit value equally likely
    threshold = round(p * (1 << 32)) - (1 << 31)  # bits + 2**31 >= p * 2**32, in int32
    return words.view(torch.int32)[:count].view(shape) >= threshold


def keep_scale(p: float) -> float:
    """What kept elements are multiplied by: 1 / (1 - p) (0 when p = 1: nothing is kept)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def apply_keep(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """x scaled by 1 / (1 - p) where ``keep`` (broadcastable) is True, zero elsewhere (a select: no 0 * inf NaN)."""
    return torch.where(keep, x * keep_scale(p), x.new_zeros(()))


# device type -> kernel(x, p, seed) for x in KERNEL_DTYPES: x dropped with a mask that is a function of (p, seed,
# flat index), whatever x's values and dtype
_KERNELS: dict[str, Callable[[torch.Tensor, float, int], torch.Tensor]] = {}
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def register_kernel(device_type: str, kernel: Callable[[torch.Tensor, float, int], torch.Tensor]) -> None:
    """Make ``kernel`` what `dropout` runs on ``device_type`` (it takes KERNEL_DTYPES)."""
    _KERNELS[device_type] = kernel


@functools.cache
def _load_backend_kernels(device_type: str) -> None:
    """Load the backend that registers ``device_type``'s kernel (the C++ extension on CPU) once, before the first
    dropout there, so that a forward and its backward see the same kernel whatever else loads it later."""
    if device_type == "cpu":
        from fastbert import backends  # lazily: the backends import the ops

        backends.load("cpp")


def kernel_for(x: torch.Tensor) -> Callable[[torch.Tensor, float, int], torch.Tensor] | None:
    """The kernel whose mask `dropout` uses on x's device (None: `keep_mask`'s; always None under torch.compile).
    By device only, so that a forward and a backward in another dtype (fp16 forward, fp32 gradient) share a mask."""
    if torch.compiler.is_compiling():
        return None
    _load_backend_kernels(x.device.type)
    return _KERNELS.get(x.device.type)


class _KernelDropout(torch.autograd.Function):
    """kernel(x, p, seed); the backward is the same on the gradient (the same mask, regenerated), itself
    differentiable."""

    @staticmethod
    def forward(ctx, x, p, seed, kernel):
        ctx.p, ctx.seed, ctx.kernel = p, seed, kernel
        return kernel(x, p, seed)

    @staticmethod
    def backward(ctx, grad):
        return _KernelDropout.apply(grad.contiguous(), ctx.p, ctx.seed, ctx.kernel), None, None, None


def dropout(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """x with each element zeroed with probability p and the rest scaled by 1 / (1 - p); x itself when p = 0. The
    mask is a function of (shape, p, seed, device), not of the dtype: the device's kernel's (module docstring; for a
    dtype the kernel does not take, its mask is read off a float32 tensor of ones and applied), else `keep_mask`'s.
    Differentiable (the gradient goes through the same mask and scale). Applied to a gradient of x's shape with the
    same (p, seed), it is the backward of the forward's dropout."""
    if p == 0.0:
        return x
    kernel = kernel_for(x)
    if kernel is None:
        return apply_keep(x, keep_mask(x.shape, p, seed, x.device), p)
    if x.dtype in KERNEL_DTYPES:
        return _KernelDropout.apply(x.contiguous(), p, seed, kernel)
    return apply_keep(x, kernel(torch.ones(x.shape, device=x.device), p, seed) != 0, p)


def draw_seed() -> int:
    """A fresh base seed from torch's default CPU generator (no device synchronisation). Not called under
    torch.compile (a Python int read off a tensor would break the graph): the model draws no seed there."""
    return int(torch.randint(0, SEED_LIMIT, (), dtype=torch.int64))


def op_seed(base: int, index: int) -> int:
    """The seed of the ``index``-th dropout site of a forward whose base seed is ``base``."""
    return (base + index * 0x9E3779B97F4A7C15) % SEED_LIMIT
