"""The triton backend's own backward kernels (LayerNorm backward with two-stage fp32 dW/dB, the GEMM's backward
epilogue, the embedding backward) and the dropout fused into the forwards of embedding_layernorm,
linear_residual_layernorm, linear_residual_prenorm (and linear_activation's backward).

Gradients against the eager op's autograd: fp32 within 1e-5 of an fp64 reference, fp16/bf16 by fastbert.numerics'
rule, odd row counts and widths; LayerNorm weight/bias and linear bias gradients over many rows (the fp32
reduction); with dropout: keep rate and 1/(1-p) scaling on large samples, the same seed giving the same output and
another seed another, and gradients equal to an fp64 reference built with the mask the forward drew (so a backward
drawing any other mask fails). The kernels' Philox masks differ from `fastbert.ops.dropout.keep_mask`'s, so p > 0
is never compared with the eager op's output. On CPU the kernels run in the Triton interpreter: a cheap subset is
unmarked, the rest `interpreter`."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastbert import kernels, ops  # noqa: F401 (kernels: registers the triton torch ops called directly)
from fastbert.numerics import assert_accurate
from fastbert.ops.layernorm import layer_norm_fp32
from fastbert.ops.spec import SPECS
from tests.helpers import DEVICE, DTYPE_IDS, check_grads, padded_batch, run_grads, tiny_model

HALF_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16)]
LAYERNORM_OPS = ["embedding_layernorm", "linear_residual_layernorm", "linear_residual_prenorm"]
DROPOUT_OPS = LAYERNORM_OPS
VOCAB, POSITIONS = 50, 40


# ------------------------------------------------------------------------------------------------------ cases
def op_args(op: str, rows: int, width: int, dtype: torch.dtype, in_features: int = 24, full: bool = True,
            activation: str = "gelu", seed: int = 0) -> tuple:
    """The functional entry's positional arguments for ``rows`` tokens of ``width`` features (the LayerNorm's or
    the linear output's), on the test device; float tensors require grad. ``full``: every optional given."""
    gen = torch.Generator().manual_seed(seed)

    def f(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
        return t.to(DEVICE).requires_grad_()

    def ids(high):
        return torch.randint(0, high, (rows,), generator=gen).to(DEVICE)

    if op == "embedding_layernorm":
        return (ids(VOCAB), ids(POSITIONS) if full else None, ids(2) if full else None, f(VOCAB, width),
                f(POSITIONS, width) if full else None, f(2, width), f(width), f(width) if full else None, 1e-12)
    scale = in_features ** -0.5
    if op == "linear_activation":
        return f(rows, in_features), f(width, in_features, scale=scale), f(width) if full else None, activation
    return (f(rows, in_features), f(width, in_features, scale=scale), f(width) if full else None, f(rows, width),
            f(width), f(width) if full else None, 1e-5)


def call(op: str, args: tuple, dropout_p: float = 0.0, dropout_seed: int = 0):
    """The triton backend's op with dropout (p, seed)."""
    return getattr(ops, op)(*args, dropout_p=dropout_p, dropout_seed=dropout_seed, backend="triton")


class _OpsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------- cheap subset (CI, unmarked)
@pytest.mark.parametrize("op", [*LAYERNORM_OPS, "linear_activation"])
def test_grads_fp32_odd_rows(op):
    check_grads(op, op_args(op, 7, 48, torch.float32), "triton")


@pytest.mark.parametrize("op, kernel_op", [
    ("embedding_layernorm", "fastbert::triton_embedding_layernorm_backward"),
    ("linear_residual_layernorm", "fastbert::triton_layernorm_rows_backward"),
    ("linear_residual_prenorm", "fastbert::triton_layernorm_rows_backward"),
    ("linear_activation", "fastbert::triton_linear_activation_grad"),
])
def test_backward_runs_the_triton_kernels(op, kernel_op):
    """The torch op's backward is the triton module's (its kernels' torch ops run), not the spec's PyTorch one."""
    args = op_args(op, 5, 48, torch.float32)
    out = call(op, args) if op != "linear_activation" else ops.linear_activation(*args, backend="triton")
    loss = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)))
    with _OpsSeen() as seen:
        loss.backward()
    assert kernel_op in seen.names, sorted(seen.names)
    assert "aten::native_layer_norm_backward" not in seen.names


def test_prenorm_backward_uses_the_forward_mask_identity_linear():
    """W = I, residual 0: summed = mask / (1 - p) * x and d(sum summed)/dx = mask / (1 - p), elementwise; any
    other mask in the backward puts nonzeros where the forward dropped."""
    rows, width, p = 64, 48, 0.5
    x = torch.randn(rows, width, device=DEVICE).requires_grad_()
    eye, zeros, ones = torch.eye(width, device=DEVICE), torch.zeros(rows, width, device=DEVICE), torch.ones(width)
    summed, _ = call("linear_residual_prenorm", (x, eye, None, zeros, ones.to(DEVICE), None, 1e-5), p, 77)
    kept = summed != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    torch.testing.assert_close(summed[kept], x.detach()[kept] * 2.0, rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(summed.sum(), x)
    assert torch.equal(grad != 0, kept)
    assert torch.equal(grad[kept], torch.full_like(grad[kept], 2.0))


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_post_ln_torch_op_backward_recomputes_the_sum(p):
    """linear_residual_layernorm's torch op has its own backward (the sum recomputed by the forward's GEMM); the
    backend's function under autograd runs prenorm's op instead (no recomputation). Both give the eager op's
    gradients (p = 0) or the fp64 reference's with the forward's mask (p > 0)."""
    op = "linear_residual_layernorm"
    args = op_args(op, 7, 48, torch.float32)
    torch_op = torch.ops.fastbert.triton_linear_residual_layernorm
    if p == 0:
        check_grads(op, args, "triton", call=lambda name: SPECS[op].eager if name == "eager" else torch_op)
    else:
        keep = _forward_mask(op, args, p, 99)
        fast = run_grads(lambda *a: torch_op(*a, p, 99), args)
        reference = run_grads(_masked_reference(op, args, keep, p), _upcast(args))
        for index, (f, r) in enumerate(zip(fast, reference, strict=True)):
            assert_accurate(f, f, r, what=f"{op} torch op dropout grad {index}")
    for function, recomputes in ((lambda *a: torch_op(*a, p, 99), True), (lambda *a: call(op, a, p, 99), False)):
        out = function(*args)
        with _OpsSeen() as seen:
            out.sum().backward()
        assert ("fastbert::triton_linear_dropout_residual" in seen.names) == recomputes, sorted(seen.names)
        assert "fastbert::triton_layernorm_rows_backward" in seen.names


def test_same_seed_same_output_other_seed_other_output():
    args = op_args("embedding_layernorm", 33, 48, torch.float32)
    first = call("embedding_layernorm", args, 0.2, 5)
    assert torch.equal(first, call("embedding_layernorm", args, 0.2, 5))
    other = call("embedding_layernorm", args, 0.2, 6)
    assert not torch.equal(first == 0, other == 0)
    plain = call("embedding_layernorm", args)
    assert torch.equal(plain, call("embedding_layernorm", args, 0.0, 123))  # p = 0: the seed plays no part
    torch.testing.assert_close(plain, ops.embedding_layernorm(*args, backend="eager"), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ full grid (interpreter)
@pytest.mark.interpreter
@pytest.mark.parametrize("full", [True, False], ids=["full", "none"])
@pytest.mark.parametrize("rows, width", [(1, 48), (130, 48), (7, 384), (130, 384), (7, 768)])
@pytest.mark.parametrize("op", [*LAYERNORM_OPS, "linear_activation"])
def test_grads_fp32(op, rows, width, full):
    check_grads(op, op_args(op, rows, width, torch.float32, full=full), "triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES], ids=["fp32", "fp16", "bf16"])
def test_linear_activation_grads_every_activation(activation, dtype):
    """The backward epilogue's derivative of each activation (relu: from the saved output)."""
    check_grads("linear_activation", op_args("linear_activation", 37, 96, dtype, activation=activation), "triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("op", [*LAYERNORM_OPS, "linear_activation"])
def test_grads_half(op, dtype):
    check_grads(op, op_args(op, 130, 384, dtype), "triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", LAYERNORM_OPS)
def test_weight_and_bias_grads_over_many_rows(op, dtype):
    """dW/dB summed over 1025 rows (each program's fp32 partial sums, then the second stage): within the rule
    (a reduction in bf16 would be far outside it)."""
    check_grads(op, op_args(op, 1025, 48, dtype, in_features=16), "triton")


@pytest.mark.interpreter
def test_batched_leading_shape_and_frozen_weight():
    """x [B, S, K], the weight frozen, the gradient broadcast from a sum (stride-0 rows)."""
    x, weight, bias, residual, ln_weight, ln_bias, eps = op_args("linear_residual_layernorm", 12, 48, torch.float32)
    x = x.detach().view(3, 4, -1).requires_grad_()
    residual = residual.detach().view(3, 4, -1).requires_grad_()
    weight.requires_grad_(False)
    check_grads("linear_residual_layernorm", (x, weight, bias, residual, ln_weight, ln_bias, eps), "triton")
    out = call("linear_residual_layernorm", (x, weight, bias, residual, ln_weight, ln_bias, eps))
    (grad,) = torch.autograd.grad(out.sum(), x)  # dL/dout expanded from a scalar: strides (0, 0, 0)
    reference = torch.autograd.grad(ops.linear_residual_layernorm(x, weight, bias, residual, ln_weight, ln_bias, eps,
                                                                  backend="eager").sum(), x)[0]
    torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------------ dropout
def _masked_reference(op: str, args: tuple, keep: torch.Tensor, p: float):
    """The op in fp64 (eager pieces, autograd) with the dropout mask ``keep``: what the triton op with that mask
    computes."""
    scale = 1.0 / (1.0 - p)

    def drop(t):
        return torch.where(keep, t * scale, t.new_zeros(()))

    if op == "embedding_layernorm":
        def fn(*a):
            return drop(SPECS[op].eager(*a))  # p = 0: LayerNorm(gathered sum)
        return fn

    def fn(x, weight, bias, residual, ln_weight, ln_bias, eps):
        summed = drop(torch.nn.functional.linear(x, weight, bias)) + residual
        normed = layer_norm_fp32(summed, ln_weight, ln_bias, eps)
        return (summed, normed) if op == "linear_residual_prenorm" else normed
    return fn


def _upcast(args: tuple) -> tuple:
    return tuple(a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a for a in args)


def _forward_mask(op: str, args: tuple, p: float, seed: int) -> torch.Tensor:
    """The keep mask the triton forward drew. embedding_layernorm: its nonzero outputs. The linear ops: prenorm's
    summed differs from the residual exactly where the linear output was kept; linear_residual_layernorm's GEMM
    draws the same mask (same epilogue, seed and [rows, N] offsets), so its mask is read off prenorm's."""
    with torch.no_grad():
        if op == "embedding_layernorm":
            return call(op, args, p, seed) != 0
        summed, _ = call("linear_residual_prenorm", args, p, seed)
        return summed != args[3]


@pytest.mark.interpreter
@pytest.mark.parametrize("rows, width", [(7, 48), (130, 384)])
@pytest.mark.parametrize("op", DROPOUT_OPS)
def test_dropout_grads_use_the_forward_mask(op, rows, width):
    """Gradients with p = 0.3 against an fp64 reference built with the forward's mask: 1e-5 (fp32). A backward
    regenerating another mask (another seed, offset or RNG) sends gradients through other elements and fails."""
    p, seed = 0.3, 2024
    args = op_args(op, rows, width, torch.float32)
    keep = _forward_mask(op, args, p, seed)
    assert 0.5 < keep.float().mean().item() < 0.9
    fast = run_grads(lambda *a: call(op, a, p, seed), args)
    reference = run_grads(_masked_reference(op, args, keep, p), _upcast(args))
    for index, (f, r) in enumerate(zip(fast, reference, strict=True)):
        assert_accurate(f, f, r, what=f"{op} dropout grad {index}")
    # the same check with the mask of another seed fails: the test can tell masks apart
    other = _forward_mask(op, args, p, seed + 1)
    wrong = run_grads(_masked_reference(op, args, other, p), _upcast(args))
    with pytest.raises(AssertionError):
        for index, (f, r) in enumerate(zip(fast, wrong, strict=True)):
            assert_accurate(f, f, r, what=f"{op} grad {index} vs another seed's mask")


def _rate_tolerance(p: float, count: int) -> float:
    return 5 * (p * (1 - p) / count) ** 0.5  # 5 standard deviations of a binomial proportion


@pytest.mark.interpreter
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("op", ["embedding_layernorm", "linear_residual_prenorm"])
def test_keep_rate_and_scaling(op, p):
    """Over 2**17 elements the kept fraction is 1 - p (5 sigma) and each kept element is the undropped value
    times 1/(1-p) (fp32, within one rounding)."""
    rows, width = 256, 512
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a
                 for a in op_args(op, rows, width, torch.float32, in_features=16))
    with torch.no_grad():
        if op == "embedding_layernorm":
            dropped, plain = call(op, args, p, 11), call(op, args)
        else:  # residual 0: summed is the dropped linear output (linear_residual_layernorm: the test below)
            zero_residual = (*args[:3], torch.zeros_like(args[3]), *args[4:])
            dropped, plain = call(op, zero_residual, p, 11)[0], call(op, zero_residual)[0]
    kept = dropped != 0
    assert abs(kept.float().mean().item() - (1 - p)) < _rate_tolerance(p, kept.numel())
    torch.testing.assert_close(dropped[kept], plain[kept] / (1 - p), rtol=3e-7, atol=0)


@pytest.mark.interpreter
def test_post_ln_keep_rate_through_its_gemm_mask():
    """linear_residual_layernorm's dropout acts inside, before the LayerNorm: its output equals the LayerNorm of
    (prenorm's dropped sum), i.e. the same GEMM mask, whose keep rate prenorm's test measures."""
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a
                 for a in op_args("linear_residual_layernorm", 130, 384, torch.float32))
    with torch.no_grad():
        out = call("linear_residual_layernorm", args, 0.4, 9)
        summed, normed = call("linear_residual_prenorm", args, 0.4, 9)
    torch.testing.assert_close(out, normed, rtol=0, atol=0)
    assert abs((summed != args[3]).float().mean().item() - 0.6) < _rate_tolerance(0.4, summed.numel())


@pytest.mark.interpreter
@pytest.mark.parametrize("op", DROPOUT_OPS)
def test_opcheck_with_dropout(op):
    """The torch ops (schema, fake, autograd registration, AOTAutograd tracing the backward's kernel ops) with
    p > 0."""
    args = (*op_args(op, 6, 48, torch.float32), 0.25, 31)
    torch.library.opcheck(getattr(torch.ops.fastbert, f"triton_{op}").default, args)


@pytest.mark.interpreter
def test_backward_kernel_ops_opcheck():
    """The backward's own torch ops (fakes against the kernels, schemas) on small inputs."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 48, generator=gen).to(DEVICE)
    grad = torch.randn(9, 48, generator=gen).to(DEVICE)
    weight = torch.randn(48, generator=gen).to(DEVICE)
    for extra, p in ((None, 0.0), (grad.clone(), 0.3)):
        torch.library.opcheck(torch.ops.fastbert.triton_layernorm_rows_backward.default,
                              (x, grad, weight, 1e-5, extra, p, 5, torch.float32))
    linear = torch.randn(48, 16, generator=gen).to(DEVICE)
    inputs = torch.randn(9, 16, generator=gen).to(DEVICE)
    torch.library.opcheck(torch.ops.fastbert.triton_linear_dropout_residual.default,
                          (inputs, linear, weight, x, 0.3, 5))
    for activation, output in (("gelu", None), ("relu", torch.relu(x))):
        torch.library.opcheck(torch.ops.fastbert.triton_linear_activation_grad.default,
                              (inputs, linear, weight, grad, output, activation, True))


def test_gemm_partial_sums_fit_every_config():
    """The backward epilogue's bias partial sums have one row per MIN_BLOCK_M GEMM rows: every BLOCK_M any config
    (autotuner list, M table, interpreter) can pick is a multiple of it, so the buffer is filled whole whichever
    config ran (stale rows from the autotuner's trial runs would be summed otherwise)."""
    from fastbert.kernels import gemm

    blocks = {c.kwargs["BLOCK_M"] for dtype in (torch.float16, torch.float32) for heavy in (False, True)
              for c in (*gemm.gpu_configs(dtype, heavy), *(gemm.table_config(m, dtype, heavy)
                                                             for m in (1, 100, 5000)))}
    blocks |= {gemm.interpreter_config(m)["BLOCK_M"] for m in (1, 20, 1000)}
    assert all(b % gemm.MIN_BLOCK_M == 0 for b in blocks), blocks


@pytest.mark.interpreter
def test_bert_training_step_with_dropout_runs_on_triton(tmp_path):
    """A tiny BERT in train mode (dropout 0.1 at every site): every op on triton, dropout fused (two seeds give two
    outputs, one seed the same), finite gradients for every parameter."""
    import fastbert
    from fastbert.bench.recording import record_backends

    tiny_model("bert").save_pretrained(tmp_path)
    ids, mask = (t.to(DEVICE) for t in padded_batch(3, 9))
    model = fastbert.from_pretrained(tmp_path, backend="triton", device=DEVICE).train()
    assert model.config.embedding_dropout > 0 and model.config.ffn_dropout > 0
    torch.manual_seed(5)
    with record_backends() as seen:
        hidden = model(ids, mask).last_hidden_state
    assert {b for counts in seen.values() for b in counts} == {"triton"}, seen
    hidden.square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if "pooler" not in name}  # the pooler: unused
    missing = [name for name, g in grads.items() if g is None or not torch.isfinite(g).all()]
    assert len(grads) > 10 and not missing, missing
    with torch.no_grad():
        torch.manual_seed(5)
        again = model(ids, mask).last_hidden_state
        torch.manual_seed(6)
        other = model(ids, mask).last_hidden_state
    assert torch.equal(hidden.detach(), again) and not torch.equal(again, other)
