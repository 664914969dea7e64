"""The onednn backend (oneDNN GEMMs on packed weights, CPU inference): registration, its three ops against fp64
references by `fastbert.numerics`' rule at rows 1/7/130 and BERT/odd widths, strided, transposed and 3-D inputs,
every activation, the packed-weight cache (packed once, packed again after an in-place change or new storage,
freed with its weight), the `supports` reasons, a model forced onto it against transformers, and `auto` timing it
beside cpp and eager."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import fastbert
from fastbert import backends, ops
from fastbert.backends import onednn, tuning
from fastbert.numerics import assert_accurate
from fastbert.ops.linear_activation import ACTIVATIONS
from tests.helpers import CPP_DTYPES, OpsSeen, assert_close, optimize_inputs, tiny_model

OWN_OPS = ("qkv_projection", "linear_activation", "linear_residual_layernorm")
ROWS = (1, 7, 130)
LINEAR_POINTWISE = "mkldnn::_linear_pointwise"


def _param(*shape, dtype, gen, scale=0.05, transposed=False) -> nn.Parameter:
    """An nn.Parameter (what the backend takes as weight); transposed: the .t() view of its transpose."""
    if transposed:
        return nn.Parameter((torch.randn(*reversed(shape), generator=gen) * scale).to(dtype).t())
    return nn.Parameter((torch.randn(*shape, generator=gen) * scale).to(dtype))


def _rows(rows, width, dtype, gen, strided=False, scale=1.0) -> torch.Tensor:
    if strided:
        return (torch.randn(rows, width + 9, generator=gen) * scale).to(dtype)[:, 5:5 + width]
    return (torch.randn(rows, width, generator=gen) * scale).to(dtype)


def _as_fp64(args):
    return tuple(a.detach().double() if isinstance(a, torch.Tensor) else a for a in args)


def _check(op: str, args: tuple) -> None:
    """onednn vs eager in the same dtype, both against eager in fp64 (every output of the op)."""
    with torch.no_grad():
        fast = getattr(ops, op)(*args, backend="onednn")
        plain = getattr(ops, op)(*args, backend="eager")
        reference = getattr(ops, op)(*_as_fp64(args), backend="eager")
    if isinstance(fast, torch.Tensor):
        fast, plain, reference = (fast,), (plain,), (reference,)
    for got, eager, exact in zip(fast, plain, reference, strict=True):
        assert_accurate(got, eager, exact, f"onednn {op}")


def test_registered_without_backward_and_cpp_for_the_other_ops():
    assert backends.available()["onednn"] is None
    for op in OWN_OPS:
        assert not backends.implementations(op)["onednn"].has_backward, op
    for op in ("attention", "embedding_layernorm", "qkv_rotary", "linear_glu", "linear_residual_prenorm"):
        assert backends.implementations(op)["onednn"].fn is backends.implementations(op)["cpp"].fn, op
    half = torch.zeros(3, 8, dtype=torch.float16)  # what cpp's kernels refuse: the reason says whose kernel runs
    reason = backends.implementations("attention")["onednn"].supports(half, half, half)
    assert reason.startswith("onednn runs the cpp backend's kernel for this op, and the cpp backend supports"), reason


def test_auto_considers_onednn_on_every_cpu():
    assert backends.cpu_auto_order() == ("cpp", "onednn", "eager")
    assert backends.AUTO_ORDER["cpu"] == backends.auto_order("cpu") == backends.cpu_auto_order()


# ------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear_activation_every_activation(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    for activation in ACTIVATIONS:
        x = _rows(rows, 384, dtype, gen, strided=rows == 7)
        weight, bias = _param(1536, 384, dtype=dtype, gen=gen), _param(1536, dtype=dtype, gen=gen, scale=0.5)
        _check("linear_activation", (x, weight, bias, activation))


@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_qkv_projection_views_of_one_buffer(rows, dtype):
    gen = torch.Generator().manual_seed(10 + rows)
    x = _rows(rows, 768, dtype, gen, strided=rows == 130)
    weight, bias = _param(3 * 768, 768, dtype=dtype, gen=gen), _param(3 * 768, dtype=dtype, gen=gen, scale=0.5)
    _check("qkv_projection", (x, weight, bias, 12))
    with torch.no_grad():
        q, k, v = ops.qkv_projection(x, weight, bias, 12, backend="onednn")
    assert q.shape == (rows, 12, 64)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear_residual_layernorm(rows, dtype):
    gen = torch.Generator().manual_seed(20 + rows)
    for inner, hidden, strided, with_bias in ((1536, 384, False, True), (130, 7, True, False), (3072, 768, True, True)):
        x = _rows(rows, inner, dtype, gen, strided=strided)
        weight = _param(hidden, inner, dtype=dtype, gen=gen, transposed=strided)
        bias = _param(hidden, dtype=dtype, gen=gen, scale=0.5) if with_bias else None
        residual = _rows(rows, hidden, dtype, gen, strided=strided, scale=2.0)
        ln_weight = _param(hidden, dtype=dtype, gen=gen, scale=1.0).abs() + 0.5
        ln_bias = _param(hidden, dtype=dtype, gen=gen, scale=0.2)
        _check("linear_residual_layernorm", (x, weight, bias, residual, ln_weight, ln_bias, 1e-12))


def test_three_dimensional_input_and_odd_widths():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 33, generator=gen)
    weight, bias = _param(7, 33, dtype=torch.float32, gen=gen), None
    _check("linear_activation", (x, weight, bias, "gelu"))
    with torch.no_grad():
        assert ops.linear_activation(x, weight, bias, "gelu", backend="onednn").shape == (2, 5, 7)


# ------------------------------------------------------------------------------------------------- the cache
def test_a_weight_is_packed_once_and_again_after_it_changes():
    gen = torch.Generator().manual_seed(4)
    weight, x = _param(96, 48, dtype=torch.float32, gen=gen), torch.randn(7, 48, generator=gen)
    packed = onednn.packed_weight(weight)
    assert onednn.packed_weight(weight) is packed  # second call: the kept copy
    with torch.no_grad():
        weight.mul_(-2.0)  # in place: its version moves
        assert onednn.packed_weight(weight) is not packed
        torch.testing.assert_close(ops.linear_activation(x, weight, None, "relu", backend="onednn"),
                                   torch.relu(x @ weight.T), rtol=1e-5, atol=1e-5)
        weight.data = torch.randn(96, 48, generator=gen)  # other storage
        torch.testing.assert_close(ops.linear_activation(x, weight, None, "relu", backend="onednn"),
                                   torch.relu(x @ weight.T), rtol=1e-5, atol=1e-5)
        weight.data = weight.data.view(48, 96).t()  # the same storage read in another layout
        torch.testing.assert_close(ops.linear_activation(x, weight, None, "relu", backend="onednn"),
                                   torch.relu(x @ weight.T), rtol=1e-5, atol=1e-5)


def test_the_packed_copy_is_freed_with_its_weight():
    weight = nn.Parameter(torch.randn(64, 32))
    onednn.packed_weight(weight)
    before = onednn.packed_count()
    del weight
    gc.collect()
    assert onednn.packed_count() == before - 1


# ------------------------------------------------------------------------------------------------- supports
def _why_not(op, *args, **kwargs):
    return backends.why_not(op, "onednn", *args, **kwargs)


def test_supports_reasons():
    x, w = torch.randn(3, 8), nn.Parameter(torch.randn(16, 8))
    assert "no backward" in _why_not("linear_activation", x, w, None, "gelu")  # grad mode, w requires grad
    residual, ln = torch.randn(3, 16), torch.ones(16)
    with torch.no_grad():
        assert _why_not("linear_activation", x, w, None, "gelu") is None
        assert "takes nn.Parameter weights" in _why_not("linear_activation", x, w.detach(), None, "gelu")
        assert "float32 and bfloat16" in _why_not("linear_activation", x.half(), nn.Parameter(w.detach().half()),
                                                   None, "gelu")
        assert "one dtype" in _why_not("linear_activation", x.bfloat16(), w, None, "gelu")
        assert _why_not("linear_residual_layernorm", x, w, None, residual, ln, None, 1e-5) is None
        assert "no dropout" in _why_not("linear_residual_layernorm", x, w, None, residual, ln, None, 1e-5, 0.1, 1)
    with torch.no_grad(), pytest.raises(backends.BackendUnavailable, match="takes nn.Parameter weights"):
        ops.linear_activation(x, w.detach(), None, "gelu", backend="onednn")
    with torch.inference_mode():
        built_here = nn.Parameter(torch.randn(16, 8))
        assert "inference-mode weight" in _why_not("linear_activation", x, built_here, None, "gelu")


def test_under_autograd_the_static_order_says_why_not_onednn(monkeypatch):
    x, w = torch.randn(3, 8), nn.Parameter(torch.randn(16, 8))
    text = backends.explain("linear_activation", x, w, None, "gelu")
    assert "onednn: onednn backend has no backward for linear_activation" in text, text


def test_linear_residual_layernorm_without_a_layernorm_bias():
    gen = torch.Generator().manual_seed(6)
    x, weight = torch.randn(7, 130, generator=gen), _param(48, 130, dtype=torch.float32, gen=gen)
    residual, ln_weight = torch.randn(7, 48, generator=gen), torch.rand(48, generator=gen) + 0.5
    _check("linear_residual_layernorm", (x, weight, None, residual, ln_weight, None, 1e-5))


# ------------------------------------------------------------------------------------------------- models
@pytest.mark.parametrize("dtype", CPP_DTYPES)
def test_a_model_forced_onto_onednn_matches_transformers(dtype):
    model = tiny_model("bert").eval()
    inputs = optimize_inputs("bert", "Model", model)
    with torch.no_grad():
        expected = model.to(torch.float64)(**inputs).last_hidden_state
        plain = model.to(dtype)(**inputs).last_hidden_state
        fastbert.optimize(model, backend="onednn")
        with OpsSeen() as seen:
            got = model(**inputs).last_hidden_state
    assert LINEAR_POINTWISE in seen.names
    mask = inputs["attention_mask"].bool()
    if dtype == torch.float32:
        assert_close(got[mask], expected[mask], "bert forced onto onednn")
    else:
        assert_accurate(got[mask], plain[mask], expected[mask], "bert bf16 forced onto onednn")


def test_torch_compile_of_a_model_forced_onto_onednn():
    """A traced call cannot hold a packed copy outside its graph: it runs the cpp backend's op (it was refused, and
    the compiled model raised); frames left to run eagerly keep the packed GEMMs."""
    model, reference = tiny_model("bert").eval(), tiny_model("bert").eval()
    inputs = optimize_inputs("bert", "Model", model)
    fastbert.optimize(model, backend="onednn")
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        got, expected = compiled(**inputs).last_hidden_state, reference(**inputs).last_hidden_state
    mask = inputs["attention_mask"].bool()
    assert_close(got[mask], expected[mask], "onednn model under torch.compile")


def test_a_forced_model_sees_weights_loaded_in_place_into_its_packed_query_key_value():
    """optimize packs Q, K and V into a tensor of its own: loading into the originals refreshes it in place, and
    onednn must see that (the packed tensor's version counter) and repack."""
    model, reference = tiny_model("bert").eval(), tiny_model("bert").eval()
    inputs = optimize_inputs("bert", "Model", model)
    fastbert.optimize(model, backend="onednn")
    changed = {name: value * (1.5 if "attention.self" in name else 1.0) for name, value in model.state_dict().items()}
    with torch.no_grad():
        model(**inputs)  # packs the weights as they are
        model.load_state_dict(changed)
        reference.load_state_dict(changed)
        got, expected = model(**inputs).last_hidden_state, reference(**inputs).last_hidden_state
    mask = inputs["attention_mask"].bool()
    assert_close(got[mask], expected[mask], "onednn after load_state_dict")


def test_auto_times_onednn_beside_cpp_and_eager(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    tuning.forget()
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(64, 96, generator=gen), _param(128, 96, dtype=torch.float32, gen=gen)
    backends.set_measuring(True)
    try:
        with torch.no_grad():
            decision = backends.decide("linear_activation", "auto", (x, w, None, "gelu"), {})
    finally:
        backends.set_measuring(False)
        tuning.forget()
    assert decision.how == "measured" and set(decision.times_ms) == {"cpp", "onednn", "eager"}, decision


@pytest.mark.parametrize("onednn_wins", [True, False], ids=["onednn-wins", "onednn-loses"])
def test_a_packed_copy_stays_only_where_onednn_won(monkeypatch, tmp_path, onednn_wins):
    """float32 calls time onednn on every CPU; the copy of the weight it packed to be timed is dropped when another
    backend wins (a model keeps packed copies only of the weights onednn runs)."""
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    times = {"cpp": 2.0, "onednn": 1.0 if onednn_wins else 3.0, "eager": 4.0}

    def measure(candidates, args, kwargs, **options):
        for fn in candidates.values():
            fn(*args, **kwargs)  # each candidate runs, as when timed: onednn packs the weight
        return {name: times[name] for name in candidates}, 3, "wall"

    monkeypatch.setattr(tuning, "measure", measure)
    tuning.forget()
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(64, 96, generator=gen), _param(128, 96, dtype=torch.float32, gen=gen)
    before = onednn.packed_count()
    backends.set_measuring(True)
    try:
        with torch.no_grad():
            decision = backends.decide("linear_activation", "auto", (x, w, None, "gelu"), {})
    finally:
        backends.set_measuring(False)
        tuning.forget()
    assert set(decision.times_ms) == {"cpp", "onednn", "eager"}
    assert decision.backend == ("onednn" if onednn_wins else "cpp")
    assert onednn.packed_count() - before == (1 if onednn_wins else 0)
    # A choice read from the cache releases nothing: another class may run this weight on onednn.
    with torch.no_grad():
        ops.linear_activation(x, w, None, "gelu", backend="onednn")
    packed = onednn.packed_count()
    backends.set_measuring(True)  # (a new generation: the memo of decisions is emptied, the cache file stays)
    try:
        with torch.no_grad():
            cached = backends.decide("linear_activation", "auto", (x, w, None, "gelu"), {})
    finally:
        backends.set_measuring(False)
        tuning.forget()
    assert cached.how == "cache" and onednn.packed_count() == packed


def test_packed_bf16_follows_the_cpus_features():
    assert backends.cpu_packed_bf16(frozenset({"avx512f", "amx_tile", "amx_bf16"})) == "onednn"
    assert backends.cpu_packed_bf16(frozenset({"avx512f", "avx512_bf16"})) is None
    assert backends.cpu_packed_bf16(frozenset({"avx2"})) is None
    assert backends.PACKED_BF16["cpu"] == backends.cpu_packed_bf16()


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bfloat16 on this CPU")
def test_on_amx_bf16_inference_gemms_run_on_packed_weights_without_timing_the_others(monkeypatch, tmp_path):
    """AMX (PACKED_BF16 = onednn): a bfloat16 inference call of a GEMM op goes to onednn untimed, measuring on or
    off; float32 calls, calls under autograd, ops onednn only borrows (attention) and weights onednn cannot take
    are decided as before."""
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(backends.PACKED_BF16, "cpu", backends.cpu_packed_bf16(frozenset({"amx_tile", "amx_bf16"})))
    tuning.forget()
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(64, 96, generator=gen).bfloat16(), _param(128, 96, dtype=torch.bfloat16, gen=gen)
    args = (x, w, None, "gelu")
    timed = []
    real_measure = tuning.measure
    monkeypatch.setattr(tuning, "measure", lambda fns, *a, **k: (timed.append(set(fns)), real_measure(fns, *a, **k))[1])
    for measuring in (True, False):
        backends.set_measuring(measuring)
        try:
            with torch.no_grad():
                packed = backends.decide("linear_activation", "auto", args, {})
                fp32 = backends.decide("linear_activation", "auto", (x.float(), w.float(), None, "gelu"), {})
                plain_weight = backends.decide("linear_activation", "auto", (x, w.detach().clone(), None, "gelu"), {})
                q, k, v = torch.randn(3, 20, 2, 16, generator=gen).bfloat16().unbind(0)
                cu = torch.tensor([0, 20], dtype=torch.int32)
                attention = backends.decide("attention", "auto", (q, k, v, cu, 20), {})
            grad_w = _param(128, 96, dtype=torch.bfloat16, gen=gen)
            training = backends.decide("linear_activation", "auto", (x.requires_grad_(), grad_w, None, "gelu"), {})
            x = x.detach()
        finally:
            backends.set_measuring(False)
        assert packed.backend == "onednn" and packed.times_ms is None, packed
        assert set(packed.skipped) == {"cpp", "eager"} and "PACKED_BF16" in packed.skipped["cpp"], packed
        assert fp32.backend != "onednn" or fp32.times_ms, fp32  # float32: timed (measuring) or the static order
        assert plain_weight.backend != "onednn", plain_weight  # (a temporary weight: onednn declines it)
        assert attention.backend != "onednn", attention  # (measuring: cpp or eager, whichever timed faster)
        assert training.backend != "onednn", training
    tuning.forget()
    # Timed while measuring: the float32 call, the plain weight, attention and the training call (each once); never
    # the bfloat16 inference call on the parameter.
    assert len(timed) == 4, timed
