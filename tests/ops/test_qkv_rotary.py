"""qkv_rotary (the QKV projection with ModernBERT's rotary embedding of q and k) on every backend: its rotary tables
and rotation against transformers' ModernBERT code, the eager and cpp backends against the fp64 reference, the
triton GEMM with the rotation in its epilogue against the fp64 reference with plain PyTorch in the same dtype as the
yardstick (`tools.op_checks`', shared with benchmarks/gpu_check.py), the backward against the eager op's autograd and
by gradcheck of the spec's formula, the torch ops (opcheck), the cost and the argument checks. On CPU the triton
kernel runs in the Triton interpreter: a cheap subset is unmarked, the rest `interpreter`."""

from __future__ import annotations

import pytest
import torch
from transformers import ModernBertConfig
from transformers.models.modernbert.modeling_modernbert import ModernBertRotaryEmbedding, apply_rotary_pos_emb

from fastbert import backends, ops
from fastbert.kernels import gemm
from fastbert.kernels import qkv_rotary as kernel
from fastbert.numerics import assert_accurate
from fastbert.ops.qkv_rotary import SPEC, qkv_rotary_cost, split_packed
from tests.helpers import (
    ALL_DTYPES,
    DEVICE,
    DTYPE_IDS,
    backend_op,
    float_tensor,
    gradcheck_spec,
    op_args,
    rand,
)
from tests.ops.helpers import VARIANTS, grad_tests
from tools.op_checks import check_qkv_rotary
from tools.op_checks import packed_positions as packed_position_ids

OP = "qkv_rotary"
# (tokens, heads, head_dim): odd token counts, 1 / 2 / 12 heads, head_dim 32 and 64
SHAPES = [(1, 1, 64), (7, 2, 32), (130, 12, 64), (7, 12, 32)]
SHAPE_IDS = [f"T{t}-heads{h}-d{d}" for t, h, d in SHAPES]
TRITON_SHAPES = SHAPES[:3]
TRITON_SHAPE_IDS = SHAPE_IDS[:3]


def packed_positions(lengths: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Each token's position within its own sequence, for sequences of these lengths packed back to back."""
    return torch.cat([torch.arange(n, dtype=dtype) for n in lengths])


def split_lengths(tokens: int) -> list[int]:
    """A few packed sequences of unequal lengths summing to ``tokens``."""
    lengths, left, n = [], tokens, 5
    while left:
        lengths.append(min(n, left))
        left -= lengths[-1]
        n = n * 2 + 1
    return lengths


def make_inputs(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, with_bias: bool = True,
                theta: float = 160000.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = heads * head_dim
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.randn(3 * hidden, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    bias = (torch.randn(3 * hidden, generator=gen) * 0.5).to(dtype) if with_bias else None
    positions = packed_positions(split_lengths(tokens))
    cos, sin = ops.rotary_tables(theta, head_dim, 512)
    return x, weight, bias, heads, positions, cos, sin


def fp64_reference(x, weight, bias, heads, positions, cos, sin):
    return ops.qkv_rotary_reference(x.double(), weight.double(), None if bias is None else bias.double(), heads,
                                    positions, cos, sin)


def modernbert_rope(hidden: int = 128, heads: int = 2) -> ModernBertRotaryEmbedding:
    """transformers' ModernBERT rotary module with its default thetas (160000 global, 10000 sliding)."""
    config = ModernBertConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=64,
                              num_hidden_layers=2)
    assert config.rope_parameters["full_attention"]["rope_theta"] == 160000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    return ModernBertRotaryEmbedding(config)


# ----------------------------------------------------------------------------------------------------- tables
@pytest.mark.parametrize("layer_type,theta", [("full_attention", 160000.0), ("sliding_attention", 10000.0)])
def test_tables_equal_transformers_modernbert_rope(layer_type, theta):
    rope = modernbert_rope()
    seqlen, head_dim = 300, 64
    cos_hf, sin_hf = rope(torch.zeros(1, seqlen, 128), torch.arange(seqlen)[None], layer_type)
    cos, sin = ops.rotary_tables(theta, head_dim, seqlen)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (seqlen, head_dim // 2)
    # transformers duplicates the angles over both halves (cat(freqs, freqs)); the table holds one half
    for half in (slice(0, head_dim // 2), slice(head_dim // 2, head_dim)):
        torch.testing.assert_close(cos, cos_hf[0, :, half], rtol=0, atol=0)
        torch.testing.assert_close(sin, sin_hf[0, :, half], rtol=0, atol=0)


def test_tables_are_cached_per_theta_size_and_device():
    first = ops.rotary_tables(160000.0, 64, 128)
    assert ops.rotary_tables(160000, 64, 128, "cpu")[0] is first[0]
    assert ops.rotary_tables(10000.0, 64, 128)[0] is not first[0]
    assert ops.rotary_tables(160000.0, 32, 128)[0].shape == (128, 16)
    assert ops.rotary_tables(160000.0, 64, 256)[0].shape == (256, 32)


def test_tables_built_under_inference_mode_serve_autograd():
    with torch.inference_mode():
        cos, sin = ops.rotary_tables(12345.0, 16, 8)
    assert not cos.is_inference()
    x, weight, bias, heads, positions, _, _ = make_inputs(5, 2, 16, torch.float32)
    weight.requires_grad_()
    q, k, _ = ops.qkv_rotary(x, weight, bias, heads, positions, cos, sin, backend="eager")
    (q.sum() + k.sum()).backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


@pytest.mark.parametrize("bad", [dict(head_dim=7), dict(head_dim=0), dict(max_positions=0), dict(theta=0.0)])
def test_tables_refuse_bad_sizes(bad):
    args = {"theta": 10000.0, "head_dim": 64, "max_positions": 16, **bad}
    with pytest.raises(ValueError, match="rotary_tables"):
        ops.rotary_tables(**args)


# ----------------------------------------------------------------------------------------------------- rotation
@pytest.mark.parametrize("layer_type,theta", [("full_attention", 160000.0), ("sliding_attention", 10000.0)])
@pytest.mark.parametrize("backend", ["eager", "cpp", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_equals_transformers_apply_rotary_pos_emb(backend, layer_type, theta):
    """Wqkv + ModernBertRotaryEmbedding + apply_rotary_pos_emb, as ModernBertAttention runs them on a padded
    batch [B, S, H] (positions arange(S) per row), in fp32, against qkv_rotary on the batch flattened to
    [B * S, H]."""
    device = DEVICE if backend == "triton" else torch.device("cpu")
    batch, seqlen, heads, head_dim = 2, 9, 2, 64
    hidden = heads * head_dim
    rope = modernbert_rope(hidden=hidden, heads=heads).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seqlen, hidden, generator=gen).to(device)
    wqkv = (torch.randn(3 * hidden, hidden, generator=gen) * hidden ** -0.5).to(device)

    qkv = (x @ wqkv.t()).view(batch, seqlen, 3, heads, head_dim)
    q_hf, k_hf, v_hf = (t.transpose(1, 2) for t in qkv.unbind(2))  # [B, heads, S, D]
    position_ids = torch.arange(seqlen, device=device)[None].expand(batch, -1)
    cos_hf, sin_hf = rope(x, position_ids, layer_type)
    q_hf, k_hf = apply_rotary_pos_emb(q_hf, k_hf, cos_hf, sin_hf, unsqueeze_dim=1)

    cos, sin = ops.rotary_tables(theta, head_dim, 64, device)
    q, k, v = ops.qkv_rotary(x.reshape(-1, hidden), wqkv, None, heads, position_ids.reshape(-1), cos, sin,
                             backend=backend)
    for name, ours, theirs in (("q", q, q_hf), ("k", k, k_hf), ("v", v, v_hf)):
        theirs = theirs.transpose(1, 2).reshape(batch * seqlen, heads, head_dim)
        scale = float(theirs.abs().max())
        assert float((ours - theirs).abs().max()) <= 1e-5 * scale, name


def test_positions_restart_for_every_packed_sequence():
    """A token's q/k depend on its position in its own sequence only: the packed result equals each sequence's
    result computed alone."""
    lengths = [3, 1, 6]
    x, weight, bias, heads, _, cos, sin = make_inputs(sum(lengths), 2, 32, torch.float32)
    packed = ops.qkv_rotary(x, weight, bias, heads, packed_positions(lengths), cos, sin, backend="eager")
    start = 0
    for n in lengths:
        alone = ops.qkv_rotary(x[start:start + n], weight, bias, heads, torch.arange(n), cos, sin, backend="eager")
        for ours, theirs in zip(packed, alone, strict=True):  # equal up to the GEMM's blocking for another M
            torch.testing.assert_close(ours[start:start + n], theirs)
        start += n
    # and the rotation did something: position 0 is the identity, later positions are not
    q_plain, _, _ = ops.qkv_projection(x, weight, bias, heads, backend="eager")
    q_rot = packed[0]
    torch.testing.assert_close(q_rot[0], q_plain[0])
    assert not torch.allclose(q_rot[2], q_plain[2], atol=1e-3)


def test_rotation_keeps_norms_and_leaves_v_alone():
    x, weight, bias, heads, positions, cos, sin = make_inputs(40, 2, 64, torch.float64)
    q, k, v = ops.qkv_rotary(x, weight, bias, heads, positions, cos, sin, backend="eager")
    q0, k0, v0 = ops.qkv_projection(x, weight, bias, heads, backend="eager")
    # a rotation of each (u1[i], u2[i]) pair keeps its length
    for rotated, plain in ((q, q0), (k, k0)):
        half = rotated.shape[-1] // 2
        torch.testing.assert_close(rotated[..., :half] ** 2 + rotated[..., half:] ** 2,
                                   plain[..., :half] ** 2 + plain[..., half:] ** 2)
    torch.testing.assert_close(v, v0, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------- backends
def check_backend(backend, tokens, heads, head_dim, dtype, with_bias=True, leading=None):
    x, weight, bias, heads, positions, cos, sin = make_inputs(tokens, heads, head_dim, dtype, with_bias)
    if leading is not None:
        x, positions = x.reshape(*leading, -1), positions.reshape(leading)
    fast = ops.qkv_rotary(x, weight, bias, heads, positions, cos, sin, backend=backend)
    plain = ops.qkv_rotary(x, weight, bias, heads, positions, cos, sin, backend="eager")
    reference = fp64_reference(x, weight, bias, heads, positions, cos, sin)
    for name, f, p, r in zip("qkv", fast, plain, reference, strict=True):
        assert f.shape == (*x.shape[:-1], heads, head_dim), name
        assert_accurate(f, p, r, f"qkv_rotary {backend} {name}")
    return fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("tokens,heads,head_dim", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_eager_and_cpp_against_fp64_reference(backend, tokens, heads, head_dim, dtype):
    fast = check_backend(backend, tokens, heads, head_dim, dtype)
    if backend == "cpp":  # q, k, v are views of one packed buffer, as the attention kernels read them
        assert fast[0].untyped_storage().data_ptr() == fast[2].untyped_storage().data_ptr()


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_without_bias_and_with_a_batch_shape(backend):
    check_backend(backend, 14, 2, 32, torch.float32, with_bias=False, leading=(2, 7))
    check_backend(backend, 14, 2, 32, torch.bfloat16, with_bias=False, leading=(2, 7))


def test_cpp_is_what_auto_picks_on_cpu():
    x, weight, bias, heads, positions, cos, sin = make_inputs(3, 1, 32, torch.float32)
    assert backends.explain("qkv_rotary", x, weight, bias, heads, positions, cos, sin).startswith("qkv_rotary: cpp")


def test_cpp_takes_int32_positions_and_a_strided_x():
    x, weight, bias, heads, positions, cos, sin = make_inputs(7, 2, 32, torch.float32)
    wide = torch.randn(7, x.shape[1] + 6)
    wide[:, 3:3 + x.shape[1]] = x
    fast = ops.qkv_rotary(wide[:, 3:3 + x.shape[1]], weight, bias, heads, positions.int(), cos, sin, backend="cpp")
    for f, r in zip(fast, fp64_reference(x, weight, bias, heads, positions, cos, sin), strict=True):
        assert_accurate(f, f, r, "strided x, int32 positions")


# ----------------------------------------------------------------------------------------------------- torch op
def test_cpp_torch_op_passes_opcheck():
    x, weight, bias, heads, positions, cos, sin = make_inputs(7, 2, 32, torch.float32)
    for b in (bias, None):
        torch.library.opcheck(backend_op("cpp", "qkv_rotary").default, (x, weight, b, positions, cos, sin, heads))
    packed = backend_op("cpp", "qkv_rotary")(x, weight, bias, positions, cos, sin, heads)
    for ours, theirs in zip(split_packed(packed, heads), ops.qkv_rotary_reference(x, weight, bias, heads, positions,
                                                                                  cos, sin), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_spec_fake_gives_the_packed_shape():
    x, weight, bias, heads, positions, cos, sin = make_inputs(7, 2, 32, torch.float32)
    with torch.device("meta"):
        fake = SPEC.fake(*(t.to("meta") for t in (x, weight, bias, positions, cos, sin)), heads)
    assert fake.shape == (7, 3 * 64) and fake.dtype == x.dtype


def test_cost_counts_the_gemm_and_the_rotation():
    cost = qkv_rotary_cost(tokens=10, hidden=64, head_dim=32, dtype_bytes=2)
    assert cost.flops == 2 * 10 * 64 * 192 + 3 * 2 * 10 * 64
    with_bias = qkv_rotary_cost(tokens=10, hidden=64, head_dim=32, dtype_bytes=2, bias=True)
    assert with_bias.bytes - cost.bytes == 192 * 2
    assert cost.bytes == (10 * 64 + 192 * 64 + 10 * 192) * 2 + 10 * (8 + 2 * 16 * 4)


# ----------------------------------------------------------------------------------------------------- checks
def bad_cases():
    x, weight, bias, heads, positions, cos, sin = make_inputs(6, 2, 32, torch.float32)
    base = dict(x=x, weight=weight, bias=bias, num_heads=heads, positions=positions, cos=cos, sin=sin)
    odd_weight = torch.randn(3 * 2 * 15, 30)
    return [
        ("weight shape", dict(weight=weight[:, :-1]), ValueError, r"weight must be \[3\*heads\*head_dim, 64\]"),
        ("heads do not divide", dict(num_heads=5), ValueError, "weight must be"),
        ("odd head_dim", dict(x=torch.randn(6, 30), weight=odd_weight, bias=None), ValueError, "must be even"),
        ("zero heads", dict(num_heads=0), ValueError, "num_heads must be a positive int"),
        ("weight dtype", dict(weight=weight.double()), TypeError, "must have x's dtype"),
        ("bias shape", dict(bias=bias[:-1]), ValueError, r"bias must be \[192\]"),
        ("float positions", dict(positions=positions.float()), TypeError, "int32 or int64"),
        ("positions shape", dict(positions=positions[:-1]), ValueError, "leading shape"),
        ("position too large", dict(positions=positions + 512), ValueError, r"positions must lie in \[0, 512\)"),
        ("negative position", dict(positions=positions - 1), ValueError, r"got \[-1, "),
        ("fp16 table", dict(cos=cos.half()), TypeError, "cos must be float32"),
        ("table width", dict(sin=sin[:, :8]), ValueError, r"sin must be \[max_positions, head_dim/2 = 16\]"),
        ("tables differ", dict(sin=sin[:100]), ValueError, "one shape"),
        ("int x", dict(x=x.long()), TypeError, "floating"),
    ], base


BAD, BASE = bad_cases()


@pytest.mark.parametrize("change,error,message", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_inputs_raise_clear_errors(change, error, message):
    args = {**BASE, **change}
    with pytest.raises(error, match=message):
        ops.qkv_rotary(args["x"], args["weight"], args["bias"], args["num_heads"], args["positions"], args["cos"],
                       args["sin"], backend="eager")


def test_cpp_kernel_checks_its_own_arguments():
    """Called directly (no functional entry in front), the C++ op still refuses what it cannot compute."""
    op = backend_op("cpp", "qkv_rotary")
    x, weight, bias, heads, positions, cos, sin = make_inputs(6, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="positions must lie in"):
        op(x, weight, bias, positions + 600, cos, sin, heads)
    with pytest.raises(RuntimeError, match="cos must be"):
        op(x, weight, bias, positions, cos[:, :4], sin, heads)
    with pytest.raises(RuntimeError, match="weight must be"):
        op(x, weight, bias, positions, cos, sin, 5)


# ------------------------------------------------------------------------------------------------ triton
def test_triton_fp16():
    check_qkv_rotary(7, 2, 32, torch.float16)


def test_triton_bf16_strided_without_bias():
    check_qkv_rotary(7, 2, 32, torch.bfloat16, strided=True, with_bias=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", TRITON_SHAPES, ids=TRITON_SHAPE_IDS)
def test_triton(tokens, heads, head_dim, dtype):
    check_qkv_rotary(tokens, heads, head_dim, dtype, strided=tokens == 7)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_triton_without_bias_batched_int32_positions(dtype):
    check_qkv_rotary(14, 2, 64, dtype, with_bias=False, leading=(2, 7), position_dtype=torch.int32, theta=10000.0)


@pytest.mark.interpreter
def test_triton_head_dim_whose_half_is_not_a_power_of_two():
    check_qkv_rotary(7, 3, 48, torch.float32)  # D/2 = 24: pairs of a tile span head boundaries


@pytest.mark.interpreter
def test_triton_torch_op_passes_opcheck():
    x = rand(7, 64, dtype=torch.float16)
    weight, bias = rand(192, 64, dtype=torch.float16, scale=0.125), rand(192, dtype=torch.float16)
    cos, sin = ops.rotary_tables(10000.0, 32, 16, DEVICE)
    positions = packed_position_ids(7)
    for b in (bias, None):
        torch.library.opcheck(backend_op("triton", "qkv_rotary").default, (x, weight, b, positions, cos, sin, 2))


@pytest.mark.interpreter
def test_triton_positions_outside_the_tables_are_not_read():
    """The launcher does not check positions (the functional entry does): out-of-range rows must not read outside
    the tables; they come back unrotated."""
    x = rand(3, 64, dtype=torch.float32)
    weight = rand(192, 64, dtype=torch.float32, scale=0.125)
    cos, sin = ops.rotary_tables(10000.0, 32, 4, DEVICE)
    positions = torch.tensor([2, 4, -1], device=DEVICE)
    packed = backend_op("triton", "qkv_rotary")(x, weight, None, positions, cos, sin, 2)
    plain = x @ weight.t()
    torch.testing.assert_close(packed[1:], plain[1:])
    assert not torch.allclose(packed[0, :128], plain[0, :128])  # position 2 is a real rotation


def test_triton_empty_rows_give_empty_outputs():
    x = torch.empty(0, 64, dtype=torch.float16, device=DEVICE)
    weight = rand(192, 64, dtype=torch.float16)
    cos, sin = ops.rotary_tables(10000.0, 32, 4, DEVICE)
    q, k, v = ops.qkv_rotary(x, weight, None, 2, torch.empty(0, dtype=torch.int64, device=DEVICE), cos, sin,
                             backend="triton")
    assert q.shape == k.shape == v.shape == (0, 2, 32)


def test_triton_supports_reasons():
    x = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    weight = torch.zeros(192, 64, dtype=torch.float16, device=DEVICE)
    cos, sin = ops.rotary_tables(10000.0, 32, 4, DEVICE)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    assert backends.why_not("qkv_rotary", "triton", x, weight, None, 2, positions, cos, sin) is None
    assert "mixed dtypes" in backends.why_not("qkv_rotary", "triton", x, weight.float(), None, 2, positions, cos, sin)
    assert "float32" in kernel.supports(x, weight, None, 2, positions, cos.half(), sin.half())
    assert "unit column strides" in kernel.supports(x, weight, None, 2, positions, cos.t().contiguous().t(), sin)


def test_triton_configs_are_the_shared_gemm_tiles_as_pairs():
    for dtype in (torch.float16, torch.float32):
        tiles = {(c.kwargs["BLOCK_M"], 2 * c.kwargs["BLOCK_C"], c.kwargs["BLOCK_K"], c.num_warps)
                 for c in kernel.gpu_configs(dtype)}
        assert tiles == {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps)
                         for c in gemm.gpu_configs(dtype)}


# ------------------------------------------------------------------------------------------------ backward
class TestGrads(grad_tests(OP)):
    @pytest.mark.parametrize("variant", VARIANTS)
    def test_gradcheck_backward_formula(self, variant):
        """Small tables: gradcheck perturbs each of their elements."""
        x, weight, bias, heads, _, _, _ = op_args(OP, 5, torch.float32, variant, small=True)
        cos, sin = (float_tensor((6, 1), torch.float32, torch.Generator().manual_seed(i)) for i in (1, 2))  # head_dim 2
        gradcheck_spec(OP, (x, weight, bias, heads, torch.tensor([0, 5, 2, 2, 3]), cos, sin))
