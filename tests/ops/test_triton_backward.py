"""The triton backend's backward: every op's torch op ``triton_<op>`` carries its spec's backward (`OpSpec.define`),
so gradients through the Triton forward must be the eager op's (fp32 within 1e-5 of an fp64 reference, fp16/bf16
by fastbert.numerics' rule). On CPU the forward runs in the Triton interpreter: small shapes, a cheap subset
unmarked, the rest `interpreter`. The formulas themselves (gradcheck, masks, NaN, blocks) are tested in
tests/ops/test_backward.py."""

from __future__ import annotations

import pytest
import torch

import fastbert
from fastbert import backends
from fastbert.numerics import assert_accurate
from tests.helpers import (
    DEVICE,
    DTYPE_IDS,
    TOKEN_OPS,
    attention_args,
    check_grads,
    op_args,
    padded_batch,
    tiny_model,
    torch_op_args,
)

HALF_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16)]


def on_device(args: tuple) -> tuple:
    """The arguments on the test device; float leaves stay leaves (requiring grad as before)."""
    moved = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.detach().to(DEVICE).requires_grad_(a.requires_grad)
        moved.append(a)
    return tuple(moved)


def _frozen_tables(op: str, args: tuple) -> tuple:
    """qkv_rotary's fp32 tables without grad: with fp16/bf16 q, k their gradients are not fp32-accurate."""
    return (*args[:5], args[5].detach(), args[6].detach()) if op == "qkv_rotary" else args


def _attention_call(backend):
    return lambda *a: backends._REGISTRY["attention"][backend].fn(*a)


def test_triton_has_backward_for_every_op():
    assert backends.available()["triton"] is None
    for op in [*TOKEN_OPS, "attention"]:
        assert backends._REGISTRY[op]["triton"].has_backward, op


# ---------------------------------------------------------------------------------- cheap subset (CI, unmarked)
def test_linear_activation_grads_fp32():
    check_grads("linear_activation", on_device(op_args("linear_activation", 7, torch.float32)), "triton")


def test_attention_packed_window_grads_fp32():
    check_grads("attention", on_device(attention_args("packed", [7, 3], window=2)), "triton", call=_attention_call)


def test_opcheck_with_inputs_requiring_grad():
    args = on_device(op_args("linear_residual_layernorm", 5, torch.float32, "none"))
    torch.library.opcheck(torch.ops.fastbert.triton_linear_residual_layernorm.default, args)


# ------------------------------------------------------------------------------------ full grid (interpreter)
@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 130])
@pytest.mark.parametrize("variant", ["full", "none"])
@pytest.mark.parametrize("op", TOKEN_OPS)
def test_grads_match_eager_fp32(op, variant, rows):
    check_grads(op, on_device(op_args(op, rows, torch.float32, variant)), "triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("op", TOKEN_OPS)
def test_grads_half(op, dtype):
    check_grads(op, on_device(_frozen_tables(op, op_args(op, 33, dtype))), "triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("lengths", [[1], [9, 0, 4]], ids=lambda n: "-".join(map(str, n)))
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_attention_grads_fp32(form, lengths, window):
    check_grads("attention", on_device(attention_args(form, lengths, window=window)), "triton",
                call=_attention_call)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_attention_grads_half(form, dtype):
    check_grads("attention", on_device(attention_args(form, [9, 4], dtype, window=4)), "triton",
                call=_attention_call)


@pytest.mark.interpreter
@pytest.mark.parametrize("op", [*TOKEN_OPS, "attention"])
def test_opcheck_every_op_with_grad(op):
    if op == "attention":
        cases = [attention_args("packed", [5, 2], window=2), attention_args("padded", [5, 2])]
    else:
        cases = [torch_op_args(op, op_args(op, 6, torch.float32, variant)) for variant in ("full", "none")]
    for args in cases:
        torch.library.opcheck(getattr(torch.ops.fastbert, f"triton_{op}").default, on_device(args))


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_encoder_parameter_grads_triton_equal_eager(family, tmp_path):
    """loss.backward() through a FastBertModel (eval mode) on the triton backend: eager's parameter gradients
    within 1e-5, every op on triton."""
    from fastbert.bench.recording import record_backends

    tiny_model(family).save_pretrained(tmp_path)
    ids, mask = (t.to(DEVICE) for t in padded_batch(3, 9))
    grads = {}
    for backend in ("eager", "triton"):
        model = fastbert.from_pretrained(tmp_path, backend=backend, device=DEVICE).eval()
        with record_backends() as seen:
            hidden = model(ids, mask).last_hidden_state
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
        (hidden * weights).sum().backward()
        grads[backend] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        assert {b for counts in seen.values() for b in counts} == {backend}, seen
    assert grads["triton"].keys() == grads["eager"].keys() and len(grads["triton"]) > 10
    for name, reference in grads["eager"].items():
        assert_accurate(grads["triton"][name], reference, reference, what=f"{family} {name}")
