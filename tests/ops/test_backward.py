"""Backward of every fused op (`OpSpec.setup_context` / `OpSpec.backward`, attached to the torch ops by
`OpSpec.define`): the cpp backend's gradients against the eager op's autograd (fp32 within 1e-5 of an fp64
reference, bfloat16 by fastbert.numerics' rule), gradcheck of the formulas in float64 against the eager forward,
attention's masks, windows and packed form, opcheck on the torch ops with inputs that require grad, the grad-mode
backend choice, and a whole encoder's parameter gradients on cpp vs eager. The triton backend's are in
tests/ops/test_triton_backward.py."""

from __future__ import annotations

import importlib

import pytest
import torch

import fastbert
from fastbert import backends, ops
from fastbert.numerics import assert_accurate
from fastbert.ops.spec import SPECS
from tests.helpers import (
    IN_FEATURES,
    OP_HEADS,
    OUT_FEATURES,
    TOKEN_OPS,
    attention_args,
    attention_call,
    check_grads,
    float_tensor,
    gradcheck_spec,
    op_args,
    padded_batch,
    run_grads,
    spec_function,
    tiny_model,
    torch_op_args,
)

cpp = importlib.import_module("fastbert.backends.cpp")  # imports without its extension (the fixture below fails)


@pytest.fixture(autouse=True)
def _extension_built():
    """This module's tests run the cpp backend: a missing extension fails them, never skips them (tests elsewhere
    import its helpers, e.g. tests/ops/test_triton_backward.py, and need no extension)."""
    if cpp.EXTENSION_ERROR is not None:
        pytest.fail(cpp.EXTENSION_ERROR)


# ------------------------------------------------------------------------------------------------ token ops
@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("variant", ["full", "none"])
@pytest.mark.parametrize("op", TOKEN_OPS)
def test_cpp_grads_match_eager_fp32(op, variant, rows):
    check_grads(op, op_args(op, rows, torch.float32, variant), "cpp")


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("op", ["linear_activation", "linear_glu"])
def test_cpp_grads_other_activations(op, activation):
    check_grads(op, op_args(op, 33, torch.float32, activation), "cpp")


@pytest.mark.parametrize("op", TOKEN_OPS)
def test_cpp_grads_bf16(op):
    args = op_args(op, 65, torch.bfloat16)
    if op == "qkv_rotary":  # the fp32 tables' gradients (from bf16 q, k) would be judged by the fp32 rule: frozen
        args = (*args[:5], args[5].detach(), args[6].detach())
    check_grads(op, args, "cpp")


def test_batched_leading_shape_and_only_some_inputs_requiring_grad():
    """x [B, S, K] (the model's padded form), the weight frozen: only the inputs that require grad get one."""
    x, weight, bias, residual, ln_weight, ln_bias, eps = op_args("linear_residual_layernorm", 12, torch.float32)
    x = x.detach().view(3, 4, IN_FEATURES).requires_grad_()
    residual = residual.detach().view(3, 4, OUT_FEATURES)
    weight.requires_grad_(False)
    check_grads("linear_residual_layernorm", (x, weight, bias, residual, ln_weight, ln_bias, eps), "cpp")


# ------------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("window", [None, 0, 3, 8])
@pytest.mark.parametrize("lengths", [[1], [7, 3], [130, 1, 64]], ids=lambda n: "-".join(map(str, n)))
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_cpp_attention_grads_match_eager(form, lengths, window):
    check_grads("attention", attention_args(form, lengths, window=window), "cpp", call=attention_call)


@pytest.mark.parametrize("form", ["packed", "padded"])
def test_cpp_attention_grads_bf16_and_explicit_scale(form):
    check_grads("attention", attention_args(form, [9, 4], torch.bfloat16, scale=0.3), "cpp", call=attention_call)
    check_grads("attention", attention_args(form, [9, 4], torch.float32, scale=0.3, window=2), "cpp",
                call=attention_call)


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_all_masked_rows_give_finite_zero_grads(backend, window):
    """A sequence with no real key (length 0 padded, or an empty packed one) and padded queries whose window holds
    no key: their outputs are zeros, so are the gradients they send, and nothing is NaN."""
    q, k, v, _, _, mask, _, _ = attention_args("padded", [6, 0, 2])
    grads = run_grads(lambda *a: attention_call(backend)(*a), (q, k, v, None, None, mask, None, window))
    for g in grads:
        assert torch.isfinite(g).all()
        assert torch.all(g[1] == 0)  # the sequence without keys
    packed = attention_args("packed", [6, 0, 2], window=window)
    for g in run_grads(lambda *a: attention_call(backend)(*a), packed):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_nan_at_masked_keys_reaches_no_gradient(backend, window):
    """NaN stored in k and v at masked keys: the gradients are those of zeros stored there (zeros at the masked
    keys themselves), on every real position."""
    q, k, v, _, _, mask, _, _ = attention_args("padded", [9, 5, 2])
    poisoned_k = k.detach().masked_fill(~mask[:, :, None, None], float("nan")).requires_grad_()
    poisoned_v = v.detach().masked_fill(~mask[:, :, None, None], float("nan")).requires_grad_()
    zeroed_k = k.detach().masked_fill(~mask[:, :, None, None], 0.0).requires_grad_()
    zeroed_v = v.detach().masked_fill(~mask[:, :, None, None], 0.0).requires_grad_()
    call = attention_call(backend)

    def grads(k_, v_):
        def fn(q_, k__, v__):  # upstream gradients only at real query rows: padded rows are unspecified outputs
            return call(q_, k__, v__, None, None, mask, None, window) * mask[:, :, None, None]
        return run_grads(fn, (q, k_, v_))

    poisoned, clean = grads(poisoned_k, poisoned_v), grads(zeroed_k, zeroed_v)
    for p, c in zip(poisoned, clean, strict=True):
        assert torch.isfinite(p).all()
        assert torch.equal(p, c)
    assert torch.all(poisoned[1][~mask] == 0) and torch.all(poisoned[2][~mask] == 0)


@pytest.mark.parametrize("window", [None, 4])
def test_packed_and_padded_grads_agree(window):
    """The same sequences packed and padded (upstream gradients zero at padded query rows): one set of gradients
    at the real tokens."""
    lengths = [11, 3, 7]
    packed = attention_args("packed", lengths, window=window)
    padded = attention_args("padded", lengths, window=window, seed=5)
    mask = padded[5]
    with torch.no_grad():  # the packed tokens in the padded layout
        for t_packed, t_padded in zip(packed[:3], padded[:3], strict=True):
            t_padded[mask] = t_packed
    seed_gen = torch.Generator().manual_seed(3)
    upstream = torch.randn(packed[0].shape, generator=seed_gen)
    spread = torch.zeros(padded[0].shape)
    spread[mask] = upstream
    call = attention_call("cpp")
    packed_grads = torch.autograd.grad((call(*packed) * upstream).sum(), packed[:3])
    padded_grads = torch.autograd.grad((call(*padded) * spread).sum(), padded[:3])
    for a, b in zip(packed_grads, padded_grads, strict=True):
        assert_accurate(b[mask], b[mask], a, what="padded vs packed")


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_attention_backward_in_blocks_equals_one_block(monkeypatch, form, window):
    """The spec's blocked recomputation (sequences and query rows in chunks) gives the gradients of one block."""
    attention_module = importlib.import_module("fastbert.ops.attention")  # (fastbert.ops.attention: the function)

    args = attention_args(form, [13, 9, 4], window=window)
    via_spec = spec_function("attention")

    def call(*a):
        return via_spec.apply(*torch_op_args("attention", a))

    whole = run_grads(call, args)
    monkeypatch.setattr(attention_module, "BACKWARD_BLOCK_ELEMENTS", OP_HEADS * 13 * 3)  # 3 query rows, 1 sequence
    blocked = run_grads(call, args)
    for a, b in zip(whole, blocked, strict=True):
        assert_accurate(b, b, a, what="blocked vs whole")


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_cpp_attention_backward_long_sequence_in_query_chunks(form, window):
    """A sequence longer than the C++ backward's query chunk (256 rows): the chunks' dk/dv sum up, each chunk's
    keys are the union of its rows' windows."""
    check_grads("attention", attention_args(form, [300, 5], window=window), "cpp", call=attention_call)


@pytest.mark.parametrize("window", [None, 3])
def test_cpp_attention_grads_key_mask_with_holes(window):
    """A padded key mask with holes (real keys not a prefix): the window counts positions, masked keys get zero
    gradients, against eager's autograd."""
    q, k, v, _, _, _, _, _ = attention_args("padded", [19, 19, 19])
    mask = torch.rand(3, 19, generator=torch.Generator().manual_seed(2)) < 0.6
    mask[2] = False  # a sequence without keys
    check_grads("attention", (q, k, v, None, None, mask, None, window), "cpp", call=attention_call)


# ------------------------------------------------------------------------------- cpp attention with dropout
def _cpp_keep_mask(lengths: list[int], heads: int, p: float, seed: int) -> torch.Tensor:
    """The cpp attention's keep mask, read off its forward: bool [B, heads, S, S] over the padded layout. With
    q = k = 0 every probability of a row is 1 / length and v = one-hot rows makes the output row the dropped
    probability row (no reference to the kernel's RNG: what it computes is what is checked)."""
    longest = max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.zeros(sum(lengths), heads, longest)
    v = torch.cat([torch.eye(longest)[:n] for n in lengths])[:, None, :].expand(-1, heads, -1).contiguous()
    out = ops.attention(q, q, v, cu_seqlens=cu, max_seqlen=longest, dropout_p=p, dropout_seed=seed, backend="cpp")
    keep = torch.zeros(len(lengths), heads, longest, longest, dtype=torch.bool)
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths, strict=True)):
        if n == 0:
            continue
        rows = out[start:start + n].transpose(0, 1)  # [heads, n, S]
        kept = rows != 0
        torch.testing.assert_close(rows[kept], torch.full_like(rows[kept], 1 / n / (1 - p)))  # 1/n, scaled
        keep[b, :, :n] = kept
    return keep


def _attention_with_mask(q, k, v, lengths, keep, p, window):
    """Packed attention written out in the inputs' dtype with a given keep mask (the reference for the cpp
    kernel's dropout)."""
    out, start = [], 0
    for b, n in enumerate(lengths):
        qb, kb, vb = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # [h, n, D]
        scores = qb @ kb.transpose(-1, -2) / q.shape[-1] ** 0.5
        if window is not None:
            position = torch.arange(n)
            scores = scores.masked_fill((position[:, None] - position[None, :]).abs() > window // 2, float("-inf"))
        probs = torch.softmax(scores, dim=-1) * keep[b, :, :n, :n] / (1 - p)
        out.append((probs @ vb).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_cpp_attention_dropout_keep_rate_and_scale(p):
    """Over ~0.5M probabilities the kept fraction is 1 - p within 5 standard deviations, kept ones scaled by
    1 / (1 - p) (checked in _cpp_keep_mask); different sequences and heads are not one repeated mask."""
    keep = _cpp_keep_mask([128] * 8, 4, p, seed=11)
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 5 * (p * (1 - p) / keep.numel()) ** 0.5, rate
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


def test_cpp_attention_dropout_same_seed_same_output():
    q, k, v, cu, longest, _, _, _ = attention_args("packed", [9, 4], requires_grad=False)

    def call(seed, p=0.3):
        return ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=longest, dropout_p=p, dropout_seed=seed,
                             backend="cpp")

    assert torch.equal(call(5), call(5))
    assert not torch.equal(call(5), call(6))
    assert not torch.equal(call(5), call(5 + 2**40))
    torch.testing.assert_close(call(5, 0.0), ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=longest,
                                                            backend="eager"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 4])
def test_cpp_attention_dropout_backward_uses_the_forward_mask(window):
    """Output and gradients of the cpp kernel with dropout equal attention written out with the mask read off its
    forward (fp32 rule against fp64); the same reference with another seed's mask is far off, so the check
    fails for a backward that regenerates any other mask. An empty sequence gets zero gradients."""
    lengths, p, seed = [37, 0, 5, 20], 0.3, 123
    keep = _cpp_keep_mask(lengths, OP_HEADS, p, seed)
    q, k, v, cu, longest, _, _, _ = attention_args("packed", lengths)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def grads(fn, tensors):
        out = fn(*tensors)
        return (out.detach(), *torch.autograd.grad((out.double() * upstream).sum(), tensors))

    fast = grads(lambda *t: ops.attention(*t, cu_seqlens=cu, max_seqlen=longest, window=window, dropout_p=p,
                                          dropout_seed=seed, backend="cpp"), (q, k, v))
    as_double = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference = grads(lambda *t: _attention_with_mask(*t, lengths, keep, p, window), as_double)
    for name, f, r in zip(("out", "dq", "dk", "dv"), fast, reference, strict=True):
        assert_accurate(f, f, r, what=f"cpp attention with dropout: {name}")
    other = grads(lambda *t: _attention_with_mask(*t, lengths, _cpp_keep_mask(lengths, OP_HEADS, p, seed + 1), p,
                                                  window), as_double)
    for f, o in zip(fast[1:], other[1:], strict=True):
        assert (f.double() - o).abs().max() > 0.1 * o.abs().max()
    assert torch.all(fast[1] == fast[1]) and fast[1].isfinite().all()


@pytest.mark.parametrize("window", [None, 5])
def test_cpp_attention_dropout_padded_key_mask_with_holes(window):
    """The padded form with a key mask with holes: the mask is indexed by key position (the packed probe's, S equal),
    output and gradients equal the written-out attention with it, masked keys get zero gradients."""
    batch, seqlen, p, seed = 3, 16, 0.4, 77
    keep = _cpp_keep_mask([seqlen] * batch, OP_HEADS, p, seed)
    q, k, v, _, _, _, _, _ = attention_args("padded", [seqlen] * batch)
    key_mask = torch.rand(batch, seqlen, generator=torch.Generator().manual_seed(4)) < 0.7
    key_mask[2] = False  # no keys: zeros and zero gradients
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def reference(q_, k_, v_):
        scores = q_.transpose(1, 2) @ k_.transpose(1, 2).transpose(-1, -2) / q_.shape[-1] ** 0.5  # [B, h, S, S]
        allowed = key_mask[:, None, None, :].expand(batch, 1, seqlen, seqlen)
        if window is not None:
            position = torch.arange(seqlen)
            allowed = allowed & ((position[:, None] - position[None, :]).abs() <= window // 2)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0) * keep / (1 - p)
        return (probs @ v_.transpose(1, 2)).transpose(1, 2)

    def grads(fn, tensors):
        out = fn(*tensors)
        return (out.detach(), *torch.autograd.grad((out.double() * upstream).sum(), tensors))

    fast = grads(lambda *t: ops.attention(*t, key_padding_mask=key_mask, window=window, dropout_p=p,
                                          dropout_seed=seed, backend="cpp"), (q, k, v))
    slow = grads(reference, [t.detach().double().requires_grad_() for t in (q, k, v)])
    for name, f, r in zip(("out", "dq", "dk", "dv"), fast, slow, strict=True):
        assert_accurate(f, f, r, what=f"cpp attention, padded with dropout: {name}")
    assert torch.all(fast[2][~key_mask] == 0) and torch.all(fast[3][~key_mask] == 0)


# ------------------------------------------------------------------------------------- gradcheck (float64)
@pytest.mark.parametrize("variant", ["full", "none"])
@pytest.mark.parametrize("op", TOKEN_OPS)
def test_gradcheck_backward_formulas(op, variant):
    if op == "qkv_rotary":  # small tables: gradcheck perturbs each of their elements
        x, weight, bias, heads, _, _, _ = op_args(op, 5, torch.float32, variant, small=True)
        cos, sin = (float_tensor((6, 1), torch.float32, torch.Generator().manual_seed(i)) for i in (1, 2))  # head_dim 2
        args = (x, weight, bias, heads, torch.tensor([0, 5, 2, 2, 3]), cos, sin)
    else:
        args = op_args(op, 5, torch.float32, variant, small=True)
    gradcheck_spec(op, args)


DROPOUT_OPS = ("embedding_layernorm", "attention", "linear_residual_layernorm", "linear_residual_prenorm")


@pytest.mark.parametrize("op", DROPOUT_OPS)
def test_gradcheck_with_dropout(op):
    """With dropout the backward formula regenerates the forward's mask from the seed: gradcheck (the eager
    forward, perturbed, against the formula) fails for any other mask."""
    if op == "attention":
        args = attention_args("packed", [4, 2], head_dim=2)
    else:
        args = op_args(op, 5, torch.float32, "full", small=True)
    args = torch_op_args(op, args)[:-2] + (0.4, 1234)
    gradcheck_spec(op, args)


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu"])
@pytest.mark.parametrize("op", ["linear_activation", "linear_glu"])
def test_gradcheck_other_activations(op, activation):
    gradcheck_spec(op, op_args(op, 4, torch.float32, activation, small=True))


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_gradcheck_attention(form, window):
    lengths = [4, 2, 0] if form == "packed" else [4, 2]
    gradcheck_spec("attention", attention_args(form, lengths, window=window, head_dim=2))
    gradcheck_spec("attention", attention_args(form, [3, 2], window=window, scale=0.7, head_dim=4))


# ------------------------------------------------------------------------------------------------- opcheck
def _opcheck_cases():
    cases = []
    for op in cpp.TORCH_OPS:
        if op == "attention":
            for args in (attention_args("packed", [5, 2], window=2), attention_args("padded", [5, 2]),
                         (*attention_args("packed", [5, 2]), 0.3, 7)):  # (with dropout: cpp's own mask)
                cases.append((op, args))
            continue
        for variant in ("full", "none"):
            cases.append((op, torch_op_args(op, op_args(op, 6, torch.float32, variant))))
    return cases


@pytest.mark.parametrize("case", list(enumerate(_opcheck_cases())), ids=lambda c: f"{c[1][0]}-{c[0]}")
def test_opcheck_with_inputs_requiring_grad(case):
    _, (op, args) = case
    torch.library.opcheck(getattr(torch.ops.fastbert, f"cpp_{op}").default, args)


def test_every_spec_has_a_backward_on_every_backend():
    for op, spec in SPECS.items():
        assert spec.has_backward, op
        assert backends._REGISTRY[op]["cpp"].has_backward, op


# ------------------------------------------------------------------------------------------ backend choice
@pytest.mark.parametrize("op", TOKEN_OPS)
def test_under_grad_auto_trains_through_eager_on_cpu_and_cpp_when_forced(op):
    """auto keeps eager under autograd on CPU (cpp's backward recomputes with PyTorch ops and is slower, see
    fastbert.backends.AUTO_ORDER_AUTOGRAD), saying why; backend="cpp" trains through cpp."""
    args = op_args(op, 7, torch.float32)
    explained = backends.explain(op, *args)
    assert explained.startswith(f"{op}: eager") and "cpp: auto trains through eager here" in explained
    assert backends.explain(op, *args, backend="cpp") == f"{op}: cpp"
    table = backends.OpTable("cpp")
    out = getattr(table, op)(*args)
    assert table.chosen[op] == "cpp"
    assert (out[0] if isinstance(out, tuple) else out).requires_grad
    with torch.no_grad():
        assert backends.explain(op, *op_args(op, 7, torch.float32)) == f"{op}: cpp"  # inference still takes cpp


def test_under_grad_auto_trains_attention_through_cpp_on_cpu():
    """Attention is the exception (fastbert.backends.AUTO_ORDER_AUTOGRAD_BY_OP): its cpp forward and backward are
    C++ kernels that follow the real lengths, measured faster than eager's autograd; with dropout too."""
    args = attention_args("packed", [5, 3], window=2)
    assert backends.explain("attention", *args, backend="cpp") == "attention: cpp"
    assert backends.explain("attention", *args) == "attention: cpp"
    assert backends.explain("attention", *args, 0.1, 3) == "attention: cpp"
    assert backends.autograd_order("attention", "cpu") == ("cpp", "eager")
    assert backends.autograd_order("attention", "cuda") == backends.AUTO_ORDER_AUTOGRAD["cuda"]
    assert backends.autograd_order("linear_activation", "cpu") == backends.AUTO_ORDER_AUTOGRAD["cpu"]


def test_auto_training_step_runs_attention_on_cpp_and_the_rest_on_eager(tmp_path):
    """A train() step through auto on CPU, dropout on: attention (with and without dropout) on cpp, the other
    ops on eager; the gradients are finite and reach every parameter that an eager step reaches."""
    from fastbert.bench.recording import record_backends

    tiny_model("bert").save_pretrained(tmp_path)
    ids, mask = padded_batch(4, 11)
    grads = {}
    for backend in ("auto", "eager"):
        model = fastbert.from_pretrained(tmp_path, backend=backend).train()
        with record_backends() as seen:
            model(ids, mask).last_hidden_state.square().mean().backward()
        grads[backend] = {name for name, p in model.named_parameters() if p.grad is not None}
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        if backend == "auto":
            assert set(seen.pop("attention")) == {"cpp"}, seen
            assert {b for counts in seen.values() for b in counts} == {"eager"}, seen
    assert grads["auto"] == grads["eager"]


# ------------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("family, padding_free", [("bert", True), ("bert", False), ("modernbert", True),
                                                  ("modernbert", False)])
def test_encoder_parameter_grads_cpp_equal_eager(family, padding_free, tmp_path):
    """loss.backward() through a FastBertModel in eval mode, packed or padded: the cpp backend's parameter
    gradients are eager's (each within 1e-5 relative), and every op ran on cpp."""
    from fastbert.bench.recording import record_backends

    tiny_model(family).save_pretrained(tmp_path)
    ids, mask = padded_batch(4, 11)
    grads = {}
    for backend in ("eager", "cpp"):
        model = fastbert.from_pretrained(tmp_path, backend=backend).eval()
        model.padding_free = padding_free
        with record_backends() as seen:
            hidden = model(ids, mask).last_hidden_state
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(4))
        (hidden * weights).sum().backward()
        grads[backend] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        assert {b for counts in seen.values() for b in counts} == {backend}, seen
    assert grads["cpp"].keys() == grads["eager"].keys() and len(grads["cpp"]) > 10
    for name, reference in grads["eager"].items():
        assert_accurate(grads["cpp"][name], reference, reference, what=f"{family} {name}")
