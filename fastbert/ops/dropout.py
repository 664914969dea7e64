"""Dropout as the fused ops take it: a probability ``dropout_p`` and an integer ``dropout_seed``.

The eager implementations, the references and the backward formulas in PyTorch ops draw their keep mask with
`keep_mask`, a deterministic function of (shape, p, seed, device): the backward regenerates exactly the forward's
mask from the seed instead of storing it, and a run is reproducible for a given seed. A backend that fuses dropout
into its kernel may draw its own mask (Triton: Philox from the same seed); its backward then regenerates that one.
Masks of different backends differ for p > 0; with p = 0 every backend computes the op without dropout.

The model draws one seed per forward from torch's default generator (`draw_seed`), so ``torch.manual_seed`` makes a
training run reproducible, and derives each op call's seed from it (`op_seed`).

Under torch.compile a seed read from a tensor would break the graph, and a ``torch.Generator`` cannot be created
inside one: there `keep_mask` draws from torch's default generator, which the compiler traces (and inductor
fuses), ignoring the seed, and only the eager implementations run dropout (`fastbert.backends` declines the
others, whose kernels would take the seed). The mask is saved by autograd rather than regenerated.
"""

from __future__ import annotations

import math

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


def dropout(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """x with the elements outside `keep_mask` zeroed and the rest scaled by 1 / (1 - p); x itself when p = 0.
    Differentiable (autograd multiplies the gradient by the same mask and scale). Applied to a gradient of x's shape
    with the same (p, seed), it is the backward of the forward's dropout."""
    if p == 0.0:
        return x
    return apply_keep(x, keep_mask(x.shape, p, seed, x.device), p)


def draw_seed() -> int:
    """A fresh base seed from torch's default CPU generator (no device synchronisation). Not called under
    torch.compile (a Python int read off a tensor would break the graph): the model draws no seed there."""
    return int(torch.randint(0, SEED_LIMIT, (), dtype=torch.int64))


def op_seed(base: int, index: int) -> int:
    """The seed of the ``index``-th dropout site of a forward whose base seed is ``base``."""
    return (base + index * 0x9E3779B97F4A7C15) % SEED_LIMIT
