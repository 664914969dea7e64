"""The backend dispatch: forced backends, auto fallback, the env var, the reasons it gives, and the static order's
choice under autograd (eager on CPU for the token ops, cpp for attention). tests/conftest.py turns measuring off
(FASTBERT_TUNE=0), so `auto` here is the static order; measuring is tested in test_tuning.py."""

from __future__ import annotations

import warnings

import pytest
import torch

import fastbert
from fastbert import backends, ops
from tests.helpers import TOKEN_OPS, attention_args, op_args, padded_batch, tiny_model

STATIC = " (static order: measuring off)"


def _linear_args(dtype=torch.float32):
    x, w, b = torch.randn(7, 16, dtype=dtype), torch.randn(24, 16, dtype=dtype), torch.randn(24, dtype=dtype)
    return x, w, b


def test_eager_is_always_available():
    assert backends.available()["eager"] is None
    x, w, b = _linear_args(torch.float64)
    out = ops.linear_activation(x, w, b, "gelu", backend="eager")
    assert torch.allclose(out, torch.nn.functional.gelu(x @ w.T + b))


def test_auto_falls_back_and_says_why():
    x, w, b = _linear_args(torch.float64)  # float64: no fused backend takes it
    chosen, skipped = backends.choose("linear_activation", "auto", x, w, b, "gelu")
    assert chosen == "eager"
    assert "cpp" in skipped and skipped["cpp"]
    assert backends.explain("linear_activation", x, w, b, "gelu").startswith("linear_activation: eager")


def test_forced_backend_that_cannot_run_raises_with_reason():
    x, w, b = _linear_args()
    with pytest.raises(backends.BackendUnavailable, match="triton.*cannot run"):
        # CPU tensors: triton runs on CPU only under TRITON_INTERPRET=1 set before import; force a reason anyway
        backends.choose("linear_activation", "triton", x.double(), w.double(), b.double(), "gelu")


@pytest.fixture
def environment(monkeypatch):
    """monkeypatch for FASTBERT_BACKEND, which fastbert reads once: re-read after each change and at the end."""
    yield monkeypatch
    monkeypatch.undo()
    backends.read_environment()


def test_env_var_forces_backend_once_read(environment):
    x, w, b = _linear_args()
    environment.setenv("FASTBERT_BACKEND", "eager")
    before = backends.choose("linear_activation", "auto", x, w, b, "gelu")[0]
    if backends.available()["cpp"] is None:
        assert before == "cpp"  # not read yet: auto still prefers cpp on CPU
    backends.read_environment()
    assert backends.choose("linear_activation", "auto", x, w, b, "gelu") == ("eager", {})
    environment.setenv("FASTBERT_BACKEND", "nonsense")
    backends.read_environment()
    with pytest.raises(ValueError, match="FASTBERT_BACKEND='nonsense' is not a backend"):
        backends.choose("linear_activation", "auto", x, w, b, "gelu")
    with pytest.raises(ValueError, match="FASTBERT_BACKEND='nonsense' is not a backend"):  # at once, not at a call
        fastbert.optimize(tiny_model("bert"))


def test_grad_falls_back_to_a_backend_with_backward():
    x, w, b = _linear_args()
    w.requires_grad_(True)
    out = ops.linear_activation(x, w, b, "relu")
    out.sum().backward()
    assert w.grad is not None


def test_op_argument_errors():
    x, w, b = _linear_args()
    with pytest.raises(ValueError, match="unknown activation"):
        ops.linear_activation(x, w, b, "swish")
    with pytest.raises(ValueError, match="weight must be"):
        ops.linear_residual_layernorm(x, w.T, b, x, b, b, 1e-5)
    q = torch.randn(2, 5, 4, 8)
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        ops.attention(q, q, q, key_padding_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        ops.attention(q[0], q[0], q[0], cu_seqlens=torch.tensor([0, 5]), max_seqlen=5)


def test_describe_available_says_what_loaded_in_words():
    from fastbert.backends import cpp as cpp_backend

    text = backends.describe_available()
    assert "None" not in text
    assert [part.split()[0] for part in text.split("; ")] == list(backends.BACKENDS)
    assert "eager loaded" in text
    capability = cpp_backend.compiled_capability()
    words = {"amx": ", bf16 attention on AMX", "avx512_bf16": ", bf16 attention on AVX512-BF16", "vector": ""}
    bf16 = words[cpp_backend.bf16_attention_kernel(64)] if capability else ""
    assert f"cpp loaded ({capability}{bf16})" in text if capability else "cpp not usable" in text
    if not torch.cuda.is_available():  # conftest sets TRITON_INTERPRET=1 without a GPU
        assert "triton loaded (no GPU: running on CPU in the Triton interpreter" in text


def test_describe_available_gives_the_reasons_for_failures(monkeypatch):
    from fastbert.backends import cpp as cpp_backend

    backends.available()  # cpp_backend imported and recorded before its extension is taken away
    monkeypatch.setattr(cpp_backend, "EXTENSION_ERROR", "the C++ extension fastbert._C is not built (gone)")
    monkeypatch.setattr(backends, "_LOADED", {"eager", "cpp"})
    missing = "ModuleNotFoundError: No module named 'triton'"
    onednn_dtypes = ("fp32 and bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported()
                     else "fp32 (no oneDNN bf16 on this CPU)")
    monkeypatch.setattr(backends, "_LOAD_ERRORS", {"triton": f"triton backend failed to load: {missing}",
                                                   "vendor": f"vendor backend failed to load: {missing}"})
    assert backends.describe_available() == (
        f"eager loaded; triton not loaded ({missing}); "
        "cpp not usable (the C++ extension fastbert._C is not built (gone)); "
        f"vendor not loaded ({missing}); "
        f"onednn loaded for qkv_projection and linear_activation only (CPU inference, {onednn_dtypes}; the other "
        "ops need the cpp backend, which is not usable)")


def test_a_backend_that_fails_to_load_warns_once_when_an_op_wants_it(monkeypatch):
    monkeypatch.setitem(backends._BACKEND_MODULES, "triton", "fastbert._no_such_backend_module")
    monkeypatch.setattr(backends, "_LOADED", {"eager"})
    monkeypatch.setattr(backends, "_LOAD_ERRORS", {})
    monkeypatch.setattr(backends, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert "failed to load" in backends.available()["triton"]  # listing backends does not warn
        assert not caught
        for _ in range(3):
            assert "ModuleNotFoundError" in backends.why_not("attention", "triton")
    assert [str(w.message) for w in caught] == [
        "fastbert: the triton backend failed to load: ModuleNotFoundError: No module named "
        "'fastbert._no_such_backend_module'; its ops run on another backend"]


def test_explain_a_model_says_which_backend_each_op_ran_on():
    import fastbert

    model = fastbert.optimize(tiny_model("bert", "ForSequenceClassification"), backend="eager")
    assert "has not run" in backends.explain(model)
    ids, mask = padded_batch()
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask)
    backends.read_environment()  # the backends' generation moves on (as when a backend loads during a first call)
    text = backends.explain(model)
    assert "on cpu float32 no grad" in text
    bert_ops = ("embedding_layernorm", "qkv_projection", "attention", "linear_activation", "linear_residual_layernorm")
    assert all(f"{op} eager" in text for op in bert_ops)  # the ops a BERT encoder runs (not ModernBERT's)
    assert backends.explain(torch.nn.Linear(2, 2)) == "Linear: no fastbert encoder inside"


# --------------------------------------------------------------------------------------- choice under autograd
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
        assert backends.explain(op, *op_args(op, 7, torch.float32)) == f"{op}: cpp{STATIC}"  # inference: cpp


def test_under_grad_auto_trains_attention_through_cpp_on_cpu():
    """Attention is the exception (fastbert.backends.AUTO_ORDER_AUTOGRAD_BY_OP): its cpp forward and backward are
    C++ kernels that follow the real lengths, measured faster than eager's autograd; with dropout too."""
    args = attention_args("packed", [5, 3], window=2)
    assert backends.explain("attention", *args, backend="cpp") == "attention: cpp"
    assert backends.explain("attention", *args) == f"attention: cpp{STATIC}"
    assert backends.explain("attention", *args, 0.1, 3) == f"attention: cpp{STATIC}"
    assert backends.autograd_order("attention", "cpu") == ("cpp", "eager")
    assert backends.autograd_order("attention", "cuda") == backends.AUTO_ORDER_AUTOGRAD["cuda"]
    assert backends.autograd_order("linear_activation", "cpu") == backends.AUTO_ORDER_AUTOGRAD["cpu"]


def test_auto_training_step_runs_attention_on_cpp_and_the_rest_on_eager(tmp_path):
    """A train() step through auto on CPU, dropout on: attention (with and without dropout) on cpp, the other
    ops on eager; the gradients are finite and reach every parameter that an eager step reaches."""
    import fastbert
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
