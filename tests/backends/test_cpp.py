"""The cpp backend (fastbert._C): the extension loads (and its absence falls back to eager), its `supports`
reasons, its own torch ops (bias_activation, bias_residual_layernorm: opcheck and accuracy at odd widths, strided
inputs; fp32 ~1e-5, bf16 by the 2x rule), the whole model against transformers for every family, and
torch.compile(fullgraph=True) through the ops. The fused ops' cpp tests are in tests/ops/test_<op>.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fastbert
from fastbert import backends, ops
from fastbert.backends import cpp as cpp  # imports even without fastbert._C; test_extension_loads checks it
from tests.helpers import FAMILIES, assert_accurate_fp64, padded_batch, rel_err, strided_rows, tiny_model

WIDTHS = (1, 7, 130, 383)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------------------------- extension
def test_extension_loads():
    """CI must fail when the C++ build broke: the extension is importable and the ops are registered."""
    assert cpp.EXTENSION_ERROR is None, cpp.EXTENSION_ERROR
    from fastbert import _C

    assert _C.compiled_capability() in ("AVX512", "AVX2", "DEFAULT")
    assert _C.vector_lanes() in (1, 4, 8, 16)
    assert backends.available()["cpp"] is None
    explained = backends.explain("linear_activation", torch.randn(3, 8), torch.randn(5, 8), None, "gelu")
    assert explained.startswith("linear_activation: cpp"), explained


def test_missing_extension_falls_back_to_eager():
    """Without fastbert._C (FASTBERT_SKIP_EXT=1 or a failed build) fastbert imports, warns once, runs eager."""
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["fastbert._C"] = None  # makes `from fastbert import _C` raise ImportError
        import torch, fastbert
        from fastbert import backends, ops
        x, w = torch.randn(3, 8), torch.randn(5, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = ops.linear_activation(x, w, None, "gelu")
            ops.linear_activation(x, w, None, "gelu")
        assert torch.allclose(out, ops.linear_activation_reference(x, w, None, "gelu"))
        assert sum("extension fastbert._C is not built" in str(c.message) for c in caught) == 1, caught
        explained = backends.explain("linear_activation", x, w, None, "gelu")
        assert explained.startswith("linear_activation: eager") and "not built" in explained, explained
        from fastbert.ops.dropout import dropout, kernel_for
        assert kernel_for(x) is None and bool((dropout(torch.ones(1000), 0.5, 1) == 0).any())
        print("OK")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr


def test_supports_reasons():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert "float32 and bfloat16" in backends.why_not("linear_activation", "cpp", x.half(), w.half(), None, "gelu")
    assert "one dtype" in backends.why_not("linear_activation", "cpp", x, w.bfloat16(), None, "gelu")
    with pytest.raises(backends.BackendUnavailable, match="float32 and bfloat16"):
        ops.linear_activation(x.half(), w.half(), None, "gelu", backend="cpp")
    # auto falls back to eager for what cpp cannot run
    assert ops.linear_activation(x.double(), w.double(), None, "relu").dtype == torch.float64


# ------------------------------------------------------------------------------------------------- opcheck
def _opcheck_cases():
    """The cpp backend's own torch ops (the fused ops' cases are in tests/ops/test_<op>.py, pad and unpad's in
    tests/ops/test_padding.py)."""
    torch.manual_seed(0)
    yield "bias_activation", (torch.randn(3, 2, 9), torch.randn(9), "gelu")
    yield "bias_activation", (torch.randn(4, 9).bfloat16(), None, "gelu_tanh")
    yield "bias_residual_layernorm", (torch.randn(3, 9), torch.randn(9), torch.randn(3, 9), torch.randn(9),
                                      torch.randn(9), 1e-5)
    yield "dropout", (torch.randn(5, 7), 0.3, 11)
    yield "dropout", (torch.randn(130).bfloat16(), 0.0, 2)


@pytest.mark.parametrize("case", list(enumerate(_opcheck_cases())), ids=lambda c: f"{c[1][0]}-{c[0]}")
def test_opcheck(case):
    _, (name, args) = case
    torch.library.opcheck(getattr(torch.ops.fastbert, f"cpp_{name}").default, args)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("activation", ops.ACTIVATIONS)
def test_bias_activation(activation, width, dtype):
    gen = torch.Generator().manual_seed(width)
    x = strided_rows(9, width, dtype, gen) * 3
    bias = torch.randn(width, generator=gen).to(dtype)
    fast = cpp.bias_activation(x, bias, activation)
    plain = ops.apply_activation(x + bias, activation)
    assert_accurate_fp64(fast, plain, ops.apply_activation(x.double() + bias.double(), activation), activation)
    assert_accurate_fp64(cpp.bias_activation(x, None, activation), ops.apply_activation(x, activation),
              ops.apply_activation(x.double(), activation), f"{activation} without bias")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("width", WIDTHS)
def test_bias_residual_layernorm(width, dtype):
    gen = torch.Generator().manual_seed(width)
    x, residual = strided_rows(6, width, dtype, gen), strided_rows(6, width, dtype, gen)
    bias, weight, ln_bias = (torch.randn(width, generator=gen).to(dtype) for _ in range(3))

    def reference(dt):
        summed = (x.to(dt) + bias.to(dt) + residual.to(dt)).float() if dt != torch.float64 else (
            x.double() + bias.double() + residual.double())
        out = F.layer_norm(summed, (width,), weight.to(summed.dtype), ln_bias.to(summed.dtype), 1e-5)
        return out.to(dt)

    fast = cpp.bias_residual_layernorm(x, bias, residual, weight, ln_bias, 1e-5)
    assert_accurate_fp64(fast, reference(dtype), reference(torch.float64), f"bias-res-ln w={width}")


def test_bias_activation_rejects_a_bad_bias():
    with pytest.raises(RuntimeError, match=r"bias must be \[5\]"):
        torch.ops.fastbert.cpp_bias_activation(torch.randn(3, 5), torch.randn(4), "relu")


# ------------------------------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 130), (2, 5, 768)])
def test_dropout_values_and_the_ends_of_p(shape, dtype):
    """Kept elements are x times fp32(1 / (1 - p)) (rounded once to the dtype), dropped ones 0; p = 0 is x, p = 1
    all zeros."""
    x = torch.randn(shape).to(dtype) + 3  # no zero input: a zero output means dropped
    out = cpp.dropout(x, 0.25, 5)
    kept = out != 0
    torch.testing.assert_close(out[kept], (x[kept].float() * torch.tensor(1 / 0.75)).to(dtype), rtol=0, atol=0)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(cpp.dropout(x, 0.0, 5), x)
    assert torch.equal(cpp.dropout(x, 1.0, 5), torch.zeros_like(x))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_rate_scale_and_independent_neighbours(p):
    count = 1 << 20
    out = cpp.dropout(torch.ones(count), p, 7)
    kept = (out != 0).double()
    tolerance = 5 * (p * (1 - p) / count) ** 0.5
    assert abs(kept.mean().item() - (1 - p)) < tolerance
    assert abs(out.double().mean().item() - 1) < 5 * (p / (1 - p) / count) ** 0.5  # unbiased
    both = (kept[:-1] * kept[1:]).mean().item()
    assert abs(both - (1 - p) ** 2) < 5 * ((1 - p) ** 2 * (1 - (1 - p) ** 2) / count) ** 0.5


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_dropout_mask_is_a_function_of_seed_and_flat_index_only(dtype):
    """Not of the threading (more elements than two chunks of the kernel's grain), nor of x's strides (read as its
    contiguous copy), nor of the values or the dtype; the vector body and the scalar tail give one mask."""
    x = (torch.randn(64, 2049) + 5).to(dtype)  # 131,136 elements; none is zero
    first = cpp.dropout(x, 0.3, 11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpp.dropout(x, 0.3, 11), first)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpp.dropout(x.t().contiguous().t(), 0.3, 11), first)
    assert torch.equal(cpp.dropout(x * 2, 0.3, 11) != 0, first != 0)
    assert torch.equal(cpp.dropout(x.float() if dtype == torch.bfloat16 else x.bfloat16(), 0.3, 11) != 0, first != 0)
    assert not torch.equal(cpp.dropout(x, 0.3, 12) != 0, first != 0)
    for start, stop in ((0, 1), (3, 20), (17, 130), (1000, 8320), (70000, 131136)):
        part = cpp.dropout(x.flatten()[:stop], 0.3, 11)[start:stop]
        assert torch.equal(part, first.flatten()[start:stop])


def test_dropout_rejects_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpp.dropout(torch.randn(4).half(), 0.1, 1)
    with pytest.raises(RuntimeError, match=r"p must be in \[0, 1\]"):
        cpp.dropout(torch.randn(4), 1.5, 1)
    with pytest.raises(RuntimeError, match="seed must be >= 0"):
        cpp.dropout(torch.randn(4), 0.1, -1)


def test_ops_dropout_runs_the_kernel_on_cpu_and_its_backward_is_the_same_mask():
    """`fastbert.ops.dropout.dropout` takes the registered kernel on CPU; the gradient passes through exactly the
    forward's mask and scale, twice differentiably; other dtypes (float64, float16) get the same mask, so that a
    forward and a backward in different dtypes agree."""
    from fastbert.ops.dropout import dropout, kernel_for

    assert kernel_for(torch.randn(2)) is cpp.dropout and kernel_for(torch.randn(2).double()) is cpp.dropout
    x = torch.randn(7, 130, requires_grad=True)
    out = dropout(x, 0.4, 9)
    assert torch.equal(out, cpp.dropout(x.detach(), 0.4, 9))
    grad = torch.randn(7, 130, requires_grad=True)
    (grad_x,) = torch.autograd.grad(out, x, grad, create_graph=True)
    assert torch.equal(grad_x, cpp.dropout(grad.detach(), 0.4, 9)) and grad_x.requires_grad
    (grad_grad,) = torch.autograd.grad(grad_x.sum(), grad)
    assert torch.equal(grad_grad, cpp.dropout(torch.ones(7, 130), 0.4, 9))
    kept = out != 0
    for dtype in (torch.float64, torch.float16):
        other = dropout(x.detach().to(dtype), 0.4, 9)
        assert torch.equal(other != 0, kept)
        torch.testing.assert_close(other.float(), out.detach(), rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------------------------- whole model
@pytest.mark.parametrize("family", FAMILIES)
def test_optimized_model_matches_transformers(family):
    model = tiny_model(family)
    ids, mask = padded_batch(4, 9, pad_id=model.config.pad_token_id or 0)
    with torch.inference_mode():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        fastbert.optimize(model, backend="cpp")
        actual = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert rel_err(actual[real], expected[real]) <= 1e-5


def test_minilm_cpp_matches_transformers(minilm_dir):
    import transformers
    hf = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    fast = fastbert.from_pretrained(minilm_dir, backend="cpp")
    ids, mask = padded_batch(3, 40, pad_id=0)
    ids = ids % 1000 + 1000 * mask  # real tokens from the vocabulary's ordinary range
    with torch.inference_mode():
        expected = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        actual = fast(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert rel_err(actual[real], expected[real]) <= 1e-5


def test_torch_compile_fullgraph(tmp_path):
    """One small case: FastBertModel on the cpp backend compiles as one graph (fakes registered) and matches."""
    hf = tiny_model("bert")
    hf.save_pretrained(tmp_path)
    model = fastbert.from_pretrained(tmp_path, backend="cpp")
    model.validate_inputs = False  # the id range check reads tensor values, which would break the graph
    ids = padded_batch(2, 8)[0]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.inference_mode():
        expected = model(input_ids=ids).last_hidden_state
        actual = compiled(input_ids=ids).last_hidden_state
    assert rel_err(actual, expected) <= 1e-5
