"""Sliding-window attention (ModernBERT's local layers): the rule against transformers' own mask function, the eager
and cpp backends against the fp64 reference (packed and padded, odd lengths, windows 0..128 and wider than the
sequence), zeros for queries whose window holds no real key, no NaN from masked keys, opcheck, the argument checks and
the cost formula. The checks take a backend and a device: tests/ops/test_attention.py runs them on triton."""

from __future__ import annotations

import pytest
import torch

from fastbert import backends, ops
from fastbert.numerics import assert_accurate
from fastbert.ops.attention import attended_pairs, attention_cost
from tests.helpers import (
    WINDOWS,
    check_against_reference,
    check_no_key_in_window_gives_zeros,
    check_packed_matches_padded,
    check_rule_matches_transformers,
    check_wide_window_is_global,
    check_window_poison,
    cu_seqlens_of,
    transformers_allowed,
)


# ------------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("window", WINDOWS + (3, 24, 25))
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_window_rule_matches_transformers_modernbert_mask(backend, window):
    check_rule_matches_transformers(backend, window)


def test_window_rule_matches_a_transformers_modernbert_layer():
    """A ModernBERT local attention layer (sdpa) and fastbert's attention on its q, k, v give the same context."""
    from transformers import ModernBertConfig
    from transformers.models.modernbert import modeling_modernbert as mb

    torch.manual_seed(0)
    config = ModernBertConfig(hidden_size=32, num_attention_heads=2, local_attention=6, num_hidden_layers=2,
                              global_attn_every_n_layers=2, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    layer = mb.ModernBertAttention(config, layer_idx=1).eval()
    assert layer.sliding_window is not None, "layer 1 must be a local layer"
    seqlen = 19
    hidden = torch.randn(2, seqlen, 32)
    attention_mask = torch.ones(2, seqlen, dtype=torch.long)
    attention_mask[1, 12:] = 0
    mask = transformers_allowed(6, attention_mask)[:, None]
    position_embeddings = mb.ModernBertRotaryEmbedding(config)(hidden, torch.arange(seqlen)[None], "sliding_attention")
    captured = {}

    def capture(module, args, kwargs, output):
        captured["context"] = output[0]

    with torch.no_grad():
        handle = layer.register_forward_hook(capture, with_kwargs=True)
        layer(hidden, position_embeddings=position_embeddings, attention_mask=mask)
        handle.remove()
        q, k, v = layer.Wqkv(hidden).view(2, seqlen, 3, 2, 16).unbind(2)
        cos, sin = position_embeddings
        q, k = mb.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        ours = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v, key_padding_mask=attention_mask.bool(),
                             window=6, backend="eager")
        expected = captured["context"]
        real = attention_mask.bool()
        torch.testing.assert_close(layer.Wo(ours.reshape(2, seqlen, 32))[real], expected[real], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_packed_against_reference(dtype, window):
    """Lengths 1, 7, an empty sequence, 130 and 383 (past one query chunk and one key block), strided views."""
    check_against_reference("cpp", dtype, window, [1, 7, 0, 130, 383])


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_padded_against_reference(dtype, window):
    check_against_reference("cpp", dtype, window, [130, 7, 1, 0], form="padded", scale=0.3)


@pytest.mark.parametrize("head_dim", (1, 7, 64, 80), ids=lambda d: f"d{d}")
def test_cpp_head_dims_with_a_window(head_dim):
    check_against_reference("cpp", torch.float32, 16, [300, 7], head_dim=head_dim)


def test_cpp_long_sequence_window_128():
    """S = 1024, ModernBERT's window: many query chunks and key blocks, each item reading only its band."""
    check_against_reference("cpp", torch.float32, 128, [1024, 333], heads=2, head_dim=64)


def test_cpp_padded_with_holes_against_reference():
    """A key padding mask with holes: the window counts padded positions, the kernel walks the real keys' list."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 300, 3, 2, 16, generator=gen).unbind(2)
    mask = torch.rand(3, 300, generator=gen) > 0.6
    mask[2, 100:] = False
    for window in (2, 16, 128):
        kwargs = {"key_padding_mask": mask, "window": window}
        fast = ops.attention(q, k, v, backend="cpp", **kwargs)
        reference = ops.attention(q.double(), k.double(), v.double(), backend="eager", **kwargs)
        assert_accurate(fast, fast, reference, f"cpp holes window={window}")


@pytest.mark.parametrize("window", (1, 7, 128))
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_packed_and_padded_agree(backend, window):
    check_packed_matches_padded(backend, torch.float32, window, [1, 7, 130, 300])


@pytest.mark.parametrize("seqlen", (1, 2, 7, 130))
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_window_wider_than_the_sequence_is_global(backend, seqlen):
    check_wide_window_is_global(backend, torch.float32, seqlen)


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_query_without_a_real_key_in_its_window_gives_zeros(backend):
    check_no_key_in_window_gives_zeros(backend, torch.float32)


@pytest.mark.parametrize("window", (2, 7, 128))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_nan_and_inf_at_masked_keys_never_reach_real_rows(backend, dtype, window):
    check_window_poison(backend, dtype, window)


def test_eager_window_is_differentiable():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 9, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    torch.autograd.gradcheck(lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, window=4,
                                                           backend="eager")[mask], (q, k, v))


# ------------------------------------------------------------------------------------------------- calls and checks
def test_seven_argument_calls_still_run_global_attention():
    """The model's `table.attention(q, k, v, cu_seqlens, max_seqlen, mask, scale)` (no window) on every backend."""
    q, k, v = torch.randn(9, 3, 2, 8).unbind(1)
    cu = cu_seqlens_of([4, 5])
    expected = ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=5, backend="eager")
    for backend in ("eager", "cpp"):
        table = backends.OpTable(backend)
        torch.testing.assert_close(table.attention(q, k, v, cu, 5, None, None), expected)
        torch.testing.assert_close(backends.dispatch("attention", backend, q, k, v, cu, 5, None, None), expected)
    torch.testing.assert_close(torch.ops.fastbert.cpp_attention(q, k, v, cu, 5, None, None), expected)


@pytest.mark.parametrize("window", [-1, 2.0, True, "8"], ids=["negative", "float", "bool", "str"])
def test_bad_window_is_a_value_error(window):
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="window must be None .global. or an int >= 0"):
        ops.attention(q, q, q, window=window)


def test_cpp_op_rejects_a_negative_window():
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        torch.ops.fastbert.cpp_attention(q, q, q, None, None, None, None, -2)


def _opcheck_cases():
    torch.manual_seed(0)
    q, k, v = torch.randn(10, 3, 2, 8).unbind(1)
    yield q, k, v, cu_seqlens_of([3, 0, 7]), 7, None, None, 2
    q, k, v = torch.randn(2, 6, 3, 2, 8).unbind(2)
    yield q, k, v, None, None, torch.tensor([[True] * 4 + [False] * 2, [False] * 6]), 0.5, 3
    yield q, k, v, None, None, None, None, 0


@pytest.mark.parametrize("case", list(enumerate(_opcheck_cases())), ids=lambda c: f"case{c[0]}")
def test_opcheck_with_window(case):
    torch.library.opcheck(torch.ops.fastbert.cpp_attention.default, case[1])


# ------------------------------------------------------------------------------------------------- cost
@pytest.mark.parametrize("seqlen", (0, 1, 2, 7, 130, 1024))
@pytest.mark.parametrize("window", (None, 0, 1, 2, 7, 128, 5000))
def test_attended_pairs_counts_the_band(seqlen, window):
    positions = torch.arange(seqlen)
    band = torch.ones(seqlen, seqlen, dtype=torch.bool)
    if window is not None:
        band = (positions[:, None] - positions[None, :]).abs() <= window // 2
    assert attended_pairs(seqlen, window) == int(band.sum())


def test_attention_cost_with_a_window():
    assert attention_cost([2, 3], 4, 8, 2) == attention_cost([2, 3], 4, 8, 2, window=None)
    local = attention_cost([1024], 12, 64, 2, window=128)
    assert local.flops == 4 * (1024 * 129 - 64 * 65) * 12 * 64
    assert local.bytes == attention_cost([1024], 12, 64, 2).bytes
