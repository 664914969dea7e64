"""Dropout in the fused ops (`fastbert.ops.dropout`): the keep rate and the 1/(1-p) scaling on large samples, the
mask a function of the seed (reproducible, different seeds differ), p = 0 equal to the op without dropout, and the
argument checks. That the backward uses exactly the forward's mask is gradcheck's job (`test_gradcheck_with_dropout`
in each dropout op's tests/ops/test_<op>.py); here the gradient's zeros sit where the output's do. Each backend's own
fused dropout (its mask read off its output) is tested in the op's module."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from fastbert.ops.dropout import dropout, keep_mask, op_seed

# Keep-rate tolerance: 5 standard deviations of a binomial proportion over the sample.
SAMPLE = 1 << 20


def _rate_tolerance(p: float, count: int) -> float:
    return 5 * (p * (1 - p) / count) ** 0.5


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_mask_rate_and_scaling(p):
    x = torch.ones(SAMPLE)
    out = dropout(x, p, seed=7)
    kept = out != 0
    assert abs(kept.float().mean().item() - (1 - p)) < _rate_tolerance(p, SAMPLE)
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p)))
    # the expectation is preserved: mean of the output ~ 1
    assert abs(out.mean().item() - 1) < 5 * (p / (1 - p) / SAMPLE) ** 0.5


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 130), (2, 5, 7)])
def test_keep_mask_shapes_and_the_ends_of_p(shape):
    """Odd element counts (the last 64-bit draw half used); p = 0 keeps all, p = 1 drops all."""
    for p, expected in ((0.0, True), (1.0, False)):
        mask = keep_mask(shape, p, 3, "cpu")
        assert mask.shape == shape and mask.dtype == torch.bool and bool(mask.all() == expected)
    assert keep_mask(shape, 0.5, 3, "cpu").shape == shape


def test_keep_mask_neighbours_are_independent():
    """Two elements share each 64-bit draw: the pairs (even, odd) and (odd, next even) are kept together at the
    rate (1 - p)^2 of independent elements."""
    p = 0.3
    mask = keep_mask((SAMPLE,), p, 5, "cpu").double()
    for first, second in ((mask[0::2], mask[1::2]), (mask[1:-1:2], mask[2::2])):
        both = (first * second).mean().item()
        assert abs(both - (1 - p) ** 2) < _rate_tolerance((1 - p) ** 2, first.numel())


def test_mask_is_a_function_of_the_seed():
    first = keep_mask((64, 64), 0.3, 11, "cpu")
    assert torch.equal(first, keep_mask((64, 64), 0.3, 11, "cpu"))
    assert not torch.equal(first, keep_mask((64, 64), 0.3, 12, "cpu"))
    assert op_seed(5, 0) != op_seed(5, 1) and 0 <= op_seed(2**62 - 1, 3) < 2**62


def test_p_one_drops_everything_and_zero_keeps_everything():
    x = torch.randn(100, requires_grad=True)
    assert torch.equal(dropout(x, 1.0, 3), torch.zeros(100))
    assert dropout(x, 0.0, 3) is x
    dropout(x, 1.0, 3).sum().backward()
    assert torch.equal(x.grad, torch.zeros(100))  # no NaN from 0 * inf


def _op_call(op: str, width: int, rows: int, p: float, seed: int, generator: torch.Generator):
    """(function of the differentiable float input, that input) for ``op`` with dropout (p, seed)."""
    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    if op == "embedding_layernorm":
        ids = torch.randint(0, 50, (rows,), generator=generator)
        table = rand(50, width).requires_grad_()
        weight, bias = rand(width), rand(width)
        return (lambda t: ops.embedding_layernorm(ids, None, None, t, None, None, weight, bias, 1e-5, dropout_p=p,
                                                  dropout_seed=seed, backend="eager")), table
    if op == "attention":
        heads, dim = 2, 8
        q = rand(rows, heads, dim).requires_grad_()
        k, v = rand(rows, heads, dim), rand(rows, heads, dim)
        cu = torch.tensor([0, rows // 2, rows], dtype=torch.int32)
        return (lambda t: ops.attention(t, k, v, cu_seqlens=cu, max_seqlen=rows - rows // 2, dropout_p=p,
                                        dropout_seed=seed, backend="eager")), q
    x = rand(rows, width).requires_grad_()
    weight, bias, residual = rand(width, width), rand(width), rand(rows, width)
    fn = getattr(ops, op)
    return (lambda t: fn(t, weight, bias, residual, torch.ones(width), None, 1e-5, dropout_p=p, dropout_seed=seed,
                         backend="eager")), x


DROPOUT_OPS = ["embedding_layernorm", "attention", "linear_residual_layernorm", "linear_residual_prenorm"]


@pytest.mark.parametrize("op", DROPOUT_OPS)
def test_ops_p_zero_equals_no_dropout_and_seed_reproduces(op):
    function, x = _op_call(op, 16, 10, 0.0, 99, torch.Generator().manual_seed(0))
    plain = function(x)
    unseeded, _ = _op_call(op, 16, 10, 0.0, 0, torch.Generator().manual_seed(0))
    for a, b in zip(torch.utils._pytree.tree_leaves(plain), torch.utils._pytree.tree_leaves(unseeded(x)),
                    strict=True):
        assert torch.equal(a, b)
    dropped, _ = _op_call(op, 16, 10, 0.3, 99, torch.Generator().manual_seed(0))
    first, second = function(x), dropped(x)
    again = dropped(x)
    for a, b in zip(torch.utils._pytree.tree_leaves(second), torch.utils._pytree.tree_leaves(again), strict=True):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(first),
                                                    torch.utils._pytree.tree_leaves(second), strict=True))


def test_attention_dropout_keep_rate_on_probabilities():
    """With v = identity rows, the output row is the dropped probability row: the kept fraction of nonzero
    probabilities is 1 - p and each kept one is scaled by 1/(1-p)."""
    p, seq, heads = 0.25, 64, 4
    q = torch.zeros(1, seq, heads, seq)  # equal scores: every probability 1/seq
    k = torch.zeros(1, seq, heads, seq)
    v = torch.eye(seq).expand(1, heads, seq, seq).transpose(1, 2).contiguous()  # [1, S, h, D=S]
    out = ops.attention(q, k, v, dropout_p=p, dropout_seed=5, backend="eager")
    kept = out != 0
    count = out.numel()
    assert abs(kept.float().mean().item() - (1 - p)) < _rate_tolerance(p, count)
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / seq / (1 - p)))


@pytest.mark.parametrize("op", ["embedding_layernorm", "linear_residual_layernorm"])
def test_gradient_zeros_follow_the_forward_mask(op):
    """d(out_i)/d(linear_i) is zero exactly where the forward dropped: checked through a diagonal probe."""
    width, rows = 32, 64
    if op == "embedding_layernorm":
        ids = torch.arange(rows)
        table = torch.randn(rows, width, requires_grad=True)
        out = ops.embedding_layernorm(ids, None, None, table, None, None, torch.ones(width), None, 1e-5,
                                      dropout_p=0.5, dropout_seed=3, backend="eager")
        expected_zero = out == 0
        grad = torch.autograd.grad(out, table, torch.ones_like(out) * expected_zero)[0]
        assert torch.equal(grad, torch.zeros_like(grad))  # the dropped outputs' gradient reaches nothing
    else:
        x = torch.randn(rows, width, requires_grad=True)
        weight = torch.eye(width)
        residual = torch.zeros(rows, width)
        summed, _ = ops.linear_residual_prenorm(x, weight, None, residual, torch.ones(width), None, 1e-5,
                                                dropout_p=0.5, dropout_seed=3, backend="eager")
        grad = torch.autograd.grad(summed.sum(), x)[0]  # identity linear: gradient = mask / (1 - p)
        assert torch.equal(grad != 0, summed != 0)
        torch.testing.assert_close(grad[grad != 0], torch.full_like(grad[grad != 0], 2.0))


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.1", True])
def test_bad_dropout_probability_is_refused(bad):
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="dropout_p"):
        ops.linear_residual_layernorm(x, torch.randn(4, 4), None, x, torch.ones(4), None, 1e-5, dropout_p=bad)


def test_cpp_declines_dropout_and_auto_takes_eager():
    from fastbert import backends

    x = torch.randn(3, 4)
    args = (x, torch.randn(4, 4), None, x, torch.ones(4), None, 1e-5, 0.2, 1)
    chosen, skipped = backends.choose("linear_residual_layernorm", "auto", *args)
    assert chosen == "eager" and "dropout" in skipped["cpp"]
    with pytest.raises(backends.BackendUnavailable, match="dropout"):
        ops.linear_residual_layernorm(*args[:7], dropout_p=0.2, backend="cpp")
