"""The vendor backend (torch's GEMM + one Triton epilogue kernel): registration, every op's forward against fp64
references by `fastbert.numerics`' rule (`tools.op_checks`, shared with benchmarks/gpu_check.py) at odd row counts
and BERT widths, strided and 3-D inputs, K = 0 and empty inputs, the `supports` reasons (dropout declined, CPU
without the interpreter), the epilogue launchers' errors, torch.compile over the torch ops, and the autograd route
of linear_residual_layernorm. Gradients and opcheck are in tests/ops/test_<op>.py (the GEMM_* case lists)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fastbert import backends, ops
from fastbert.kernels import epilogues
from tests.helpers import ALL_DTYPES, DEVICE, HALF_DTYPES, OpsSeen, assert_accurate, ln_op_args, rand
from tools.op_checks import (
    check_linear_activation,
    check_linear_glu,
    check_linear_residual_layernorm,
    check_linear_residual_prenorm,
    check_qkv_projection,
    check_qkv_rotary,
)

GEMM_OPS = ("qkv_projection", "linear_activation", "linear_residual_layernorm", "linear_residual_prenorm",
            "linear_glu", "qkv_rotary")
ROWS = [1, 7, 130]


def test_gemm_ops_registered_with_their_backward():
    assert backends.available()["vendor"] is None
    for op in GEMM_OPS:
        assert backends.implementations(op)["vendor"].has_backward, op
        assert hasattr(torch.ops.fastbert, f"vendor_{op}")
    for op in ("attention", "embedding_layernorm"):  # no GEMM: triton's kernels, so a forced model runs whole
        assert backends.implementations(op)["vendor"].fn is backends.implementations(op)["triton"].fn


# ------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("rows", ROWS)
def test_linear_activation_fp16(rows):
    check_linear_activation(rows, 384, torch.float16, "gelu", strided=rows == 7, backend="vendor")


@pytest.mark.parametrize("rows", ROWS)
def test_linear_residual_layernorm_bf16(rows):
    check_linear_residual_layernorm(rows, 384, torch.bfloat16, strided=rows == 7, backend="vendor")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_every_op_every_dtype(rows, dtype):
    strided = rows == 7
    for activation in ops.ACTIVATIONS:
        check_linear_activation(rows, 96, dtype, activation, strided, backend="vendor")
    check_qkv_projection(rows, 384, 6, dtype, strided, backend="vendor")
    check_linear_residual_layernorm(rows, 384, dtype, strided, backend="vendor")
    check_linear_residual_layernorm(rows, 96, dtype, strided, with_bias=False, with_ln_bias=False, inner=130,
                                    backend="vendor")
    check_linear_residual_prenorm(rows, 384, 130, dtype, strided, backend="vendor")
    check_linear_residual_prenorm(rows, 96, 48, dtype, strided, with_bias=False, with_ln_bias=False,
                                  backend="vendor")
    for activation in ("gelu", "silu"):
        check_linear_glu(rows, 96, 130, dtype, activation, strided, backend="vendor")
    check_linear_glu(rows, 96, 48, dtype, "gelu", strided, with_bias=False, backend="vendor")
    check_qkv_rotary(rows, 4, 16, dtype, strided, backend="vendor")
    check_qkv_rotary(rows, 2, 6, dtype, strided, with_bias=False, position_dtype=torch.int32, backend="vendor")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_bert_base_widths(dtype):
    check_qkv_projection(130, 768, 12, dtype, strided=False, backend="vendor")
    check_linear_activation(130, 768, dtype, "gelu", strided=False, backend="vendor")
    check_linear_residual_layernorm(130, 768, dtype, strided=True, backend="vendor")
    check_linear_residual_prenorm(130, 768, 1152, dtype, strided=False, backend="vendor")
    check_linear_glu(130, 768, 1152, dtype, "gelu", strided=False, with_bias=False, backend="vendor")
    check_qkv_rotary(130, 12, 64, dtype, backend="vendor")


def test_three_d_inputs():
    check_linear_glu(14, 96, 48, torch.float16, "gelu", strided=False, leading=(2, 7), backend="vendor")
    check_qkv_rotary(14, 2, 8, torch.float16, leading=(2, 7), backend="vendor")
    check_qkv_projection(14, 64, 2, torch.bfloat16, strided=False, leading=(2, 7), backend="vendor")


def test_k_zero_gives_the_bias_through_the_epilogue():
    x = torch.empty(5, 0, dtype=torch.float32, device=DEVICE)
    weight = torch.empty(24, 0, dtype=torch.float32, device=DEVICE)
    bias = rand(24, dtype=torch.float32)
    fast = ops.linear_activation(x, weight, bias, "silu", backend="vendor")
    torch.testing.assert_close(fast, torch.nn.functional.silu(bias).expand(5, 24), rtol=1e-6, atol=1e-7)


def test_empty_rows_give_empty_outputs():
    x = torch.empty(0, 32, dtype=torch.float16, device=DEVICE)
    weight, residual = rand(48, 32, dtype=torch.float16), torch.empty(0, 48, dtype=torch.float16, device=DEVICE)
    ln_weight = rand(48, dtype=torch.float16)
    assert ops.linear_activation(x, weight, None, "gelu", backend="vendor").shape == (0, 48)
    assert ops.linear_glu(x, weight, None, "gelu", backend="vendor").shape == (0, 24)
    summed, normed = ops.linear_residual_prenorm(x, weight, None, residual, ln_weight, None, 1e-5, backend="vendor")
    assert summed.shape == normed.shape == (0, 48)


def test_prenorm_normed_is_the_layernorm_of_summed_and_equals_post_ln():
    """Both LayerNorm ops normalise the rounded sum: the post-LN op's output is prenorm's normed bit for bit."""
    args = ln_op_args("linear_residual_prenorm", 33, 96, torch.float16)
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad():
        summed, normed = ops.linear_residual_prenorm(*plain, backend="vendor")
        post = ops.linear_residual_layernorm(*plain, backend="vendor")
    assert torch.equal(post, normed)
    again = torch.nn.functional.layer_norm(summed.double(), (96,), plain[4].double(), plain[5].double(), 1e-5)
    assert_accurate(normed, again.to(normed.dtype), again, "normed vs LayerNorm(summed)")


def test_post_ln_under_autograd_runs_the_prenorm_op():
    args = ln_op_args("linear_residual_layernorm", 9, 48, torch.float32)
    with OpsSeen() as seen:
        out = ops.linear_residual_layernorm(*args, backend="vendor")
    assert "fastbert::vendor_linear_residual_prenorm" in seen.names, seen.names
    with torch.no_grad():
        assert torch.equal(out.detach(), ops.linear_residual_layernorm(*args, backend="vendor"))


@pytest.mark.parametrize("used", [0, 1], ids=["summed-only", "normed-only"])
def test_prenorm_backward_runs_the_triton_layernorm_backward(used):
    """One output unused (its gradient None): the LayerNorm backward kernel still gives eager's gradients."""
    args = ln_op_args("linear_residual_prenorm", 13, 48, torch.float32)
    leaves = [a for a in args if isinstance(a, torch.Tensor)]
    weights = torch.randn(13, 48, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with OpsSeen() as seen:
        fast = torch.autograd.grad((ops.linear_residual_prenorm(*args, backend="vendor")[used] * weights).sum(),
                                   leaves)
    assert "fastbert::triton_layernorm_rows_backward" in seen.names, seen.names
    plain = torch.autograd.grad((ops.linear_residual_prenorm(*args, backend="eager")[used] * weights).sum(), leaves,
                                allow_unused=True)  # summed alone does not reach the LayerNorm's parameters
    for index, (f, p) in enumerate(zip(fast, plain, strict=True)):
        expected = torch.zeros_like(f) if p is None else p
        torch.testing.assert_close(f, expected, rtol=1e-5, atol=1e-5, msg=f"gradient of argument {index}")


# ------------------------------------------------------------------------------------------------ supports
def test_dropout_is_declined_with_the_reason():
    args = ln_op_args("linear_residual_layernorm", 5, 16, torch.float16)
    for op in ("linear_residual_layernorm", "linear_residual_prenorm"):
        reason = backends.why_not(op, "vendor", *args, 0.1, 3)
        assert "does not fuse dropout" in reason
        assert backends.why_not(op, "vendor", *args, 0.0, 3) is None
        with pytest.raises(backends.BackendUnavailable, match="dropout"):
            getattr(ops, op)(*args, dropout_p=0.1, dropout_seed=3, backend="vendor")


def test_supports_reasons():
    x64 = torch.zeros(3, 8, dtype=torch.float64, device=DEVICE)
    w64 = torch.zeros(8, 8, dtype=torch.float64, device=DEVICE)
    assert "dtype float64" in backends.why_not("linear_activation", "vendor", x64, w64, None, "gelu")
    assert "mixed dtypes" in backends.why_not("linear_glu", "vendor", x64.half(), w64, None, "gelu")
    assert backends.why_not("linear_glu", "vendor", x64.half(), w64.half(), None, "gelu") is None
    cos, sin = ops.rotary_tables(10000.0, 4, 8, DEVICE)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    weight = torch.zeros(12, 8, dtype=torch.float16, device=DEVICE)
    assert "float32" in backends.why_not("qkv_rotary", "vendor", x64.half(), weight, None, 1, positions, cos.half(),
                                         sin.half())
    assert backends.why_not("qkv_rotary", "vendor", x64.half(), weight, None, 1, positions, cos, sin) is None


def test_auto_on_cpu_never_takes_vendor():
    x, weight = rand(3, 8, dtype=torch.float32), rand(8, 8, dtype=torch.float32)
    chosen, _ = backends.choose("linear_activation", "auto", x.cpu(), weight.cpu(), None, "gelu")
    assert chosen != "vendor"


def test_cpu_without_interpreter_is_refused_with_the_reason():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = (
        "import torch, fastbert\n"
        "x = torch.zeros(2, 8, dtype=torch.float16)\n"
        "print(fastbert.backends.why_not('linear_glu', 'vendor', x, torch.zeros(4, 8, dtype=torch.float16),"
        " None, 'gelu'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tensors are on cpu and TRITON_INTERPRET is not set" in out.stdout


# ------------------------------------------------------------------------------------------------ launchers
def test_epilogue_launchers_say_what_is_wrong():
    y = rand(4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="must be contiguous"):
        epilogues.activate_rows(y.t(), "gelu")
    with pytest.raises(ValueError, match="unknown activation"):
        epilogues.activate_rows(y, "tanh")
    with pytest.raises(ValueError, match="unit column stride"):
        epilogues.residual_layernorm_rows(y, rand(16, 4, dtype=torch.float16).t(), y[0], None, 1e-5)
    wide = torch.zeros(1, epilogues.MAX_WIDTH + 1, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="exceeds"):
        epilogues.residual_layernorm_rows(wide, wide, wide[0], None, 1e-5)
    cos, sin = ops.rotary_tables(10000.0, 4, 8, DEVICE)
    with pytest.raises(ValueError, match="even D"):
        epilogues.rotary_rows(rand(4, 18, dtype=torch.float16), torch.zeros(4, dtype=torch.int64), cos, sin, 1)


def test_epilogue_kernels_can_be_replayed_by_the_cached_launcher():
    """Runtime parameters before constexprs in every epilogue kernel (what `common.launch` needs)."""
    from triton.runtime.jit import JITFunction

    from fastbert.kernels import common

    kernels = [value for name, value in vars(epilogues).items() if name.endswith("_kernel")]
    assert len(kernels) == 4
    for kernel in kernels:
        info = common.KernelInfo(JITFunction(kernel.fn))
        assert info.reason is None and info.runtime_count > 0, info.reason


def test_rotary_rows_outside_the_tables_rotate_by_zero():
    """The functional entry refuses such positions; the kernel itself leaves those rows as projected."""
    packed = rand(3, 24, dtype=torch.float32)
    cos, sin = ops.rotary_tables(10000.0, 4, 8, DEVICE)
    positions = torch.tensor([8, -1, 2], dtype=torch.int64, device=DEVICE)
    expected = packed.clone()
    epilogues.rotary_rows(packed, positions, cos, sin, 2)
    assert torch.equal(packed[:2], expected[:2])
    assert not torch.equal(packed[2], expected[2])


# ------------------------------------------------------------------------------------------------ compile
def _layer(x, qkv_w, qkv_b, ffn_w, ffn_b, out_w, out_b, ln_w, ln_b):
    q, k, v = ops.qkv_projection(x, qkv_w, qkv_b, 2, backend="vendor")
    hidden = ops.linear_activation(q.flatten(1) + v.flatten(1), ffn_w, ffn_b, "gelu", backend="vendor")
    return ops.linear_residual_layernorm(hidden, out_w, out_b, x, ln_w, ln_b, 1e-12, backend="vendor")


def test_torch_compile_fullgraph_over_vendor_ops():
    dtype = torch.float16
    args = (rand(8, 64, dtype=dtype), rand(192, 64, dtype=dtype, scale=0.1), rand(192, dtype=dtype),
            rand(96, 64, dtype=dtype, scale=0.1), rand(96, dtype=dtype), rand(64, 96, dtype=dtype, scale=0.1),
            rand(64, dtype=dtype), rand(64, dtype=dtype).abs() + 0.5, rand(64, dtype=dtype))
    eager = _layer(*args)
    compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_describe_says_where_it_runs():
    from fastbert.backends import vendor

    assert vendor.describe().startswith("vendor loaded (")


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_a_model_forced_onto_vendor_runs_whole_and_matches_transformers(family):
    """Attention and the embeddings have no GEMM: vendor runs triton's kernels for them, so backend="vendor" works
    for a whole model (the GEMM ops through vendor's own functions)."""
    import copy

    import fastbert
    from tests.helpers import tiny_model

    reference = tiny_model(family)
    model = fastbert.optimize(copy.deepcopy(reference), backend="vendor")
    ids = torch.randint(5, 90, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    seen = set()
    with torch.no_grad(), backends.observe(lambda op, chosen: seen.add(chosen)):
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)
    assert seen == {"vendor"}


def test_auto_does_not_time_the_same_function_twice(monkeypatch, tmp_path):
    """vendor's attention is triton's very function: auto skips it as a candidate, saying so (the CPU order is
    widened to the CUDA one so that the interpreter runs it here)."""
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    q, k, v = (torch.randn(7, 4, 8, device=DEVICE) for _ in range(3))
    cu_seqlens = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    args = (q, k, v, cu_seqlens, 4, None, 8 ** -0.5, None, 0.0, 0)
    monkeypatch.setitem(backends.AUTO_ORDER, q.device.type, ("triton", "vendor", "eager"))
    decision = backends.decide("attention", "auto", args, {}, measure=True)
    assert decision.skipped.get("vendor") == "runs triton's implementation of attention"
    assert set(decision.times_ms) <= {"triton", "eager"}
