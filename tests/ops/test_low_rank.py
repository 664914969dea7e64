"""fastbert.ops.low_rank: LoRA updates inside the fused ops, against the plain formula (frozen linear + s * B(A(x)))
in float64, for both ops with a nonlinear epilogue and each CPU backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastbert import ops
from fastbert.ops.backward import activation_grad
from fastbert.ops.linear_activation import apply_activation
from fastbert.ops.linear_glu import glu_grad
from fastbert.ops.low_rank import (
    AdaptedLinear,
    AdapterGroup,
    LowRankAdapter,
    add_to_heads,
    augmented_linear,
    input_dropout,
)


def adapter(out_features: int, in_features: int, rank: int, scaling: float, seed: int,
            dropout: nn.Module | None = None, dtype=torch.float64) -> LowRankAdapter:
    gen = torch.Generator().manual_seed(seed)
    down = nn.Parameter(torch.randn(rank, in_features, generator=gen, dtype=dtype) * 0.3)
    up = nn.Parameter(torch.randn(out_features, rank, generator=gen, dtype=dtype) * 0.3)
    return LowRankAdapter(down, up, scaling, dropout)


def plain_update(x: torch.Tensor, item: LowRankAdapter | None, width: int) -> torch.Tensor:
    """PEFT's formula: lora_B(lora_A(x)) * scaling (zeros for a block without an adapter)."""
    if item is None:
        return x.new_zeros((*x.shape[:-1], width))
    return F.linear(F.linear(x, item.down), item.up) * item.scaling


@pytest.mark.parametrize("present", [(True, True, True), (True, False, True), (False, True, False)])
def test_group_update_and_merge_follow_the_plain_formula(present):
    hidden, widths = 12, (12, 12, 12)
    adapters = [adapter(w, hidden, 3, 2.0, seed) if on else None
                for seed, (w, on) in enumerate(zip(widths, present, strict=True))]
    group = AdapterGroup(adapters, widths)
    x = torch.randn(7, hidden, dtype=torch.float64)
    expected = torch.cat([plain_update(x, a, w) for a, w in zip(adapters, widths, strict=True)], dim=-1)
    torch.testing.assert_close(group.update(x), expected, rtol=1e-12, atol=1e-12)
    weight = torch.randn(sum(widths), hidden, dtype=torch.float64)
    torch.testing.assert_close(F.linear(x, group.merged(weight)), F.linear(x, weight) + expected, rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("shape", [(1,), (7,), (2, 130)])
def test_group_update_with_bias_adds_the_bias_to_every_token(shape):
    """update(x, bias) is bias + update(x) on any leading shape, with gradients to x, the adapters and the bias."""
    hidden, widths = 9, (5, 5, 5)
    adapters = [adapter(w, hidden, 2, 1.5, seed) for seed, w in enumerate(widths)]
    group = AdapterGroup(adapters, widths)
    x = torch.randn(*shape, hidden, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(sum(widths), dtype=torch.float64, requires_grad=True)
    got, expected = group.update(x, bias), bias + group.update(x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    leaves = (x, bias, adapters[0].down, adapters[2].up)
    grads = torch.autograd.grad(got.sin().sum(), leaves)
    for grad, plain in zip(grads, torch.autograd.grad(expected.sin().sum(), leaves), strict=True):
        torch.testing.assert_close(grad, plain, rtol=1e-12, atol=1e-12)


def test_group_needs_an_adapter():
    with pytest.raises(ValueError, match="at least one adapter"):
        AdapterGroup([None, None], (4, 4))


def test_group_dropout_follows_the_modules_at_call_time():
    dropout = nn.Dropout(0.5)
    group = AdapterGroup([adapter(6, 8, 2, 1.0, 0, dropout)], (6,))
    x = torch.randn(50, 8, dtype=torch.float64)
    dropout.eval()
    assert not group.dropping()
    torch.testing.assert_close(group.update(x), plain_update(x, group.present[0], 6))
    dropout.train()
    assert group.dropping()
    assert not torch.allclose(group.update(x), plain_update(x, group.present[0], 6))
    dropout.p = 0.0
    assert not group.dropping()


def test_add_to_heads_adds_each_block():
    q, k, v = (torch.randn(5, 2, 3) for _ in range(3))
    update = torch.randn(5, 18)
    got = add_to_heads((q, k, v), update)
    for i, (head, out) in enumerate(zip((q, k, v), got, strict=True)):
        torch.testing.assert_close(out, head + update[:, 6 * i:6 * (i + 1)].view(5, 2, 3))


def _needs_the_kernel(dtype: torch.dtype):
    """float32 tests the CPU kernel's path: without it (a build without csrc/dropout.cpp) that case is skipped
    rather than run as a second 16-bit-draws case."""
    from fastbert.backends import cpp

    if dtype == torch.float32 and cpp.DROPOUT_ERROR is not None:
        pytest.skip(f"no CPU dropout kernel: {cpp.DROPOUT_ERROR}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["16-bit-draws", "kernel"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.0])
def test_input_dropout_keeps_one_minus_p_and_is_unbiased(p, dtype):
    """Both ways of dropping: 16-bit draws (float64 here: no kernel takes it) and the CPU kernel (float32)."""
    _needs_the_kernel(dtype)
    torch.manual_seed(0)
    x = torch.ones(400, 301, dtype=dtype)
    kept_values, scale = input_dropout(x, p)
    out = kept_values * scale
    kept = (out != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 4 * (p * (1 - p) / x.numel()) ** 0.5 + 1e-12
    assert abs(out.double().mean().item() - 1.0) < 0.01
    torch.manual_seed(0)
    assert torch.equal(input_dropout(x, p)[0] * scale, out)  # torch.manual_seed makes it reproducible
    assert torch.equal(input_dropout(x, 1.0)[0], torch.zeros_like(x))


def test_input_dropout_takes_the_cpu_kernel_seeded_from_torch_s_generator():
    from fastbert.ops.dropout import draw_seed, kernel_for

    _needs_the_kernel(torch.float32)

    x = torch.randn(7, 130)
    torch.manual_seed(3)
    dropped, scale = input_dropout(x, 0.2)
    torch.manual_seed(3)
    assert scale == 1.0 and torch.equal(dropped, kernel_for(x)(x, 0.2, draw_seed()))


def test_input_dropout_draws_every_16_bit_lane():
    """Each of the four lanes of a 64-bit draw keeps at the same rate (the high lane's sign bit is random too)."""
    torch.manual_seed(1)
    kept = (input_dropout(torch.ones(4 * 50_000, dtype=torch.float64), 0.5)[0] != 0).view(-1, 4).double().mean(0)
    assert torch.all((kept - 0.5).abs() < 0.01), kept


def activation_case(x, weight, bias, group):
    op = lambda *args: ops.linear_activation(*args, backend="eager")  # noqa: E731
    fast = augmented_linear(op, activation_grad, x, weight, bias, group, "gelu")
    plain = apply_activation(F.linear(x, weight, bias) + group.update(x), "gelu")
    return fast, plain


def glu_case(x, weight, bias, group):
    op = lambda *args: ops.linear_glu(*args, backend="eager")  # noqa: E731
    fast = augmented_linear(op, glu_grad, x, weight, bias, group, "gelu")
    projected_input, gate = (F.linear(x, weight, bias) + group.update(x)).chunk(2, dim=-1)
    plain = apply_activation(projected_input, "gelu") * gate
    return fast, plain


@pytest.mark.parametrize("case", [activation_case, glu_case], ids=["linear_activation", "linear_glu"])
@pytest.mark.parametrize("tokens", [1, 7, 130])
@pytest.mark.parametrize("weight_trains", [False, True])
def test_augmented_linear_matches_autograd_of_the_plain_formula(case, tokens, weight_trains):
    gen = torch.Generator().manual_seed(tokens)
    hidden, width = 24, 38
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(width, hidden, generator=gen, dtype=torch.float64).requires_grad_(weight_trains)
    bias = torch.randn(width, generator=gen, dtype=torch.float64, requires_grad=True)
    group = AdapterGroup([adapter(width, hidden, 4, 0.5, 3)], (width,))
    leaves = [x, bias, group.present[0].down, group.present[0].up] + ([weight] if weight_trains else [])
    fast, plain = case(x, weight, bias, group)
    torch.testing.assert_close(fast, plain, rtol=1e-10, atol=1e-10)
    grad = torch.randn(fast.shape, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad(plain, leaves, grad)
    got = torch.autograd.grad(case(x, weight, bias, group)[0], leaves, grad)
    for name, a, b in zip(["x", "bias", "A", "B", "weight"], got, expected, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_augmented_linear_asks_no_weight_gradient_of_a_frozen_weight():
    """Two GEMMs of the op's size in the backward (recompute, input gradient), not three."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(64, 32, requires_grad=True)
    bias = torch.randn(96, requires_grad=True)
    group = AdapterGroup([adapter(96, 32, 2, 1.0, 0, dtype=torch.float32)], (96,))
    counts = {}
    for trains in (False, True):
        weight = torch.randn(96, 32).requires_grad_(trains)
        out = augmented_linear(lambda *a: ops.linear_activation(*a, backend="eager"), activation_grad, x, weight,
                               bias, group, "gelu")
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        counts[trains] = counter.get_total_flops()
    big = 2 * 64 * 32 * 96
    assert counts[False] < 2.3 * big < counts[True]


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_augmented_linear_on_each_cpu_backend(backend):
    x = torch.randn(7, 20)
    weight, bias = torch.randn(30, 20), torch.randn(30)
    group = AdapterGroup([adapter(30, 20, 2, 2.0, 1, dtype=torch.float32)], (30,))
    with torch.no_grad():
        got = augmented_linear(lambda *a: ops.linear_activation(*a, backend=backend), activation_grad, x, weight,
                               bias, group, "gelu")
    expected = F.gelu(F.linear(x.double(), weight.double(), bias.double()) + group.update(x).double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_adapted_linear_reads_merged_weight_without_grad_and_the_update_with_it():
    base = nn.Parameter(torch.randn(6, 5, dtype=torch.float64), requires_grad=False)
    bias = nn.Parameter(torch.randn(6, dtype=torch.float64))
    group = AdapterGroup([adapter(6, 5, 2, 1.5, 4)], (6,), base)
    linear = AdaptedLinear(nn.Parameter(group.merged(base), requires_grad=False), bias, group)
    x = torch.randn(3, 5, dtype=torch.float64)
    expected = F.linear(x, base, bias) + plain_update(x, group.present[0], 6)
    with torch.no_grad():
        torch.testing.assert_close(linear(x), expected)
    out = linear(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert group.present[0].up.grad is not None and base.grad is None
