"""The triton backend of qkv_rotary (kernels/qkv_rotary.py): the GEMM with the rotary embedding of q and k in its
epilogue, against the fp64 reference with plain PyTorch in the same dtype as the yardstick (`fastbert.numerics`),
and against transformers' ModernBERT rotary code (the accuracy checks are `tools.op_checks`', shared with
benchmarks/gpu_check.py). On CPU it runs in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
from fastbert.kernels import gemm
from fastbert.kernels import qkv_rotary as kernel
from transformers import ModernBertConfig
from transformers.models.modernbert.modeling_modernbert import ModernBertRotaryEmbedding, apply_rotary_pos_emb

from fastbert import backends, ops
from tests.helpers import DEVICE, DTYPE_IDS, rand
from tools.op_checks import check_qkv_rotary, packed_positions

ALL_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16, torch.float32)]
# (tokens, heads, head_dim): odd token counts; 1, 2 and 12 heads; head_dim 32 and 64
SHAPES = [(1, 1, 64), (7, 2, 32), (130, 12, 64)]
SHAPE_IDS = [f"T{t}-heads{h}-d{d}" for t, h, d in SHAPES]


# ---------------------------------------------------------------------------------- cheap subset (CI, unmarked)
def test_qkv_rotary_fp16():
    check_qkv_rotary(7, 2, 32, torch.float16)


def test_qkv_rotary_bf16_strided_without_bias():
    check_qkv_rotary(7, 2, 32, torch.bfloat16, strided=True, with_bias=False)


# ------------------------------------------------------------------------------------ full grid (interpreter)
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", SHAPES, ids=SHAPE_IDS)
def test_qkv_rotary(tokens, heads, head_dim, dtype):
    check_qkv_rotary(tokens, heads, head_dim, dtype, strided=tokens == 7)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_qkv_rotary_without_bias_batched_int32_positions(dtype):
    check_qkv_rotary(14, 2, 64, dtype, with_bias=False, leading=(2, 7), position_dtype=torch.int32, theta=10000.0)


@pytest.mark.interpreter
def test_head_dim_whose_half_is_not_a_power_of_two():
    check_qkv_rotary(7, 3, 48, torch.float32)  # D/2 = 24: pairs of a tile span head boundaries


@pytest.mark.interpreter
@pytest.mark.parametrize("layer_type,theta", [("full_attention", 160000.0), ("sliding_attention", 10000.0)])
def test_equals_transformers_modernbert_attention_input(layer_type, theta):
    """Wqkv, ModernBertRotaryEmbedding and apply_rotary_pos_emb on a padded [B, S, H] batch, in fp32, against the
    triton op on the flattened batch."""
    batch, seqlen, heads, head_dim = 2, 9, 2, 64
    hidden = heads * head_dim
    rope = ModernBertRotaryEmbedding(ModernBertConfig(hidden_size=hidden, num_attention_heads=heads,
                                                      intermediate_size=64, num_hidden_layers=2)).to(DEVICE)
    assert rope.config.rope_parameters[layer_type]["rope_theta"] == theta
    x = rand(batch, seqlen, hidden, dtype=torch.float32)
    wqkv = rand(3 * hidden, hidden, dtype=torch.float32, scale=hidden ** -0.5)
    qkv = (x @ wqkv.t()).view(batch, seqlen, 3, heads, head_dim)
    q_hf, k_hf, v_hf = (t.transpose(1, 2) for t in qkv.unbind(2))
    position_ids = torch.arange(seqlen, device=DEVICE)[None].expand(batch, -1)
    q_hf, k_hf = apply_rotary_pos_emb(q_hf, k_hf, *rope(x, position_ids, layer_type), unsqueeze_dim=1)
    cos, sin = ops.rotary_tables(theta, head_dim, 64, DEVICE)
    ours = ops.qkv_rotary(x.reshape(-1, hidden), wqkv, None, heads, position_ids.reshape(-1), cos, sin,
                          backend="triton")
    for name, mine, theirs in zip("qkv", ours, (q_hf, k_hf, v_hf), strict=True):
        theirs = theirs.transpose(1, 2).reshape(batch * seqlen, heads, head_dim)
        assert float((mine - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max()), name


@pytest.mark.interpreter
def test_torch_op_passes_opcheck():
    x = rand(7, 64, dtype=torch.float16)
    weight, bias = rand(192, 64, dtype=torch.float16, scale=0.125), rand(192, dtype=torch.float16)
    cos, sin = ops.rotary_tables(10000.0, 32, 16, DEVICE)
    positions = packed_positions(7)
    for b in (bias, None):
        torch.library.opcheck(torch.ops.fastbert.triton_qkv_rotary.default, (x, weight, b, positions, cos, sin, 2))


@pytest.mark.interpreter
def test_positions_outside_the_tables_are_not_read():
    """The launcher does not check positions (the functional entry does): out-of-range rows must not read outside
    the tables; they come back unrotated."""
    x = rand(3, 64, dtype=torch.float32)
    weight = rand(192, 64, dtype=torch.float32, scale=0.125)
    cos, sin = ops.rotary_tables(10000.0, 32, 4, DEVICE)
    positions = torch.tensor([2, 4, -1], device=DEVICE)
    packed = torch.ops.fastbert.triton_qkv_rotary(x, weight, None, positions, cos, sin, 2)
    plain = x @ weight.t()
    torch.testing.assert_close(packed[1:], plain[1:])
    assert not torch.allclose(packed[0, :128], plain[0, :128])  # position 2 is a real rotation


def test_empty_rows_give_empty_outputs():
    x = torch.empty(0, 64, dtype=torch.float16, device=DEVICE)
    weight = rand(192, 64, dtype=torch.float16)
    cos, sin = ops.rotary_tables(10000.0, 32, 4, DEVICE)
    q, k, v = ops.qkv_rotary(x, weight, None, 2, torch.empty(0, dtype=torch.int64, device=DEVICE), cos, sin,
                             backend="triton")
    assert q.shape == k.shape == v.shape == (0, 2, 32)


def test_supports_reasons():
    x = torch.zeros(3, 64, dtype=torch.float16, device=DEVICE)
    weight = torch.zeros(192, 64, dtype=torch.float16, device=DEVICE)
    cos, sin = ops.rotary_tables(10000.0, 32, 4, DEVICE)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    assert backends.why_not("qkv_rotary", "triton", x, weight, None, 2, positions, cos, sin) is None
    assert "mixed dtypes" in backends.why_not("qkv_rotary", "triton", x, weight.float(), None, 2, positions, cos, sin)
    assert "float32" in kernel.supports(x, weight, None, 2, positions, cos.half(), sin.half())
    assert "unit column strides" in kernel.supports(x, weight, None, 2, positions, cos.t().contiguous().t(), sin)


def test_configs_are_the_shared_gemm_tiles_as_pairs():
    for dtype in (torch.float16, torch.float32):
        tiles = {(c.kwargs["BLOCK_M"], 2 * c.kwargs["BLOCK_C"], c.kwargs["BLOCK_K"], c.num_warps)
                 for c in kernel.gpu_configs(dtype)}
        assert tiles == {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps)
                         for c in gemm.gpu_configs(dtype)}
