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

WINDOWS = (0, 1, 2, 7, 16, 128)
POISONS = (float("nan"), float("inf"), float("-inf"))


def cu_seqlens_of(lengths: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def transformers_allowed(window: int, attention_mask: torch.Tensor) -> torch.Tensor:
    """bool [B, S, S]: which key each query may attend in a ModernBERT local layer with local_attention = window,
    from transformers' own mask function (what its sdpa and eager attention apply)."""
    from transformers import ModernBertConfig
    from transformers.masking_utils import create_bidirectional_sliding_window_mask

    config = ModernBertConfig(local_attention=window, hidden_size=8, num_attention_heads=1)
    config._attn_implementation = "sdpa"
    batch, seqlen = attention_mask.shape
    mask = create_bidirectional_sliding_window_mask(config=config, inputs_embeds=torch.zeros(batch, seqlen, 8),
                                                    attention_mask=attention_mask.long(),
                                                    allow_is_bidirectional_skip=False)
    return mask[:, 0]


def probed_allowed(backend: str, window: int | None, seqlen: int, key_padding_mask: torch.Tensor | None = None,
                   lengths: list[int] | None = None, device="cpu") -> torch.Tensor:
    """bool [B, S, S]: the keys each query attends on ``backend``, read off its output: with q = k = 0 every attended
    key gets the same weight, and V = one-hot of the key's position makes output[i, j] = 1 / n_i where i attends j.
    Padded form with ``key_padding_mask``, or packed sequences of ``lengths`` (then [B, max, max], rows and columns
    past a sequence's length False)."""
    head_dim = max(8, -(-seqlen // 8) * 8)  # the triton kernel takes head dims that are multiples of 8
    eye = torch.eye(seqlen, head_dim, device=device)
    if lengths is None:
        batch = key_padding_mask.shape[0] if key_padding_mask is not None else 1
        v = eye.expand(batch, 1, seqlen, head_dim).transpose(1, 2).contiguous()
        out = ops.attention(torch.zeros_like(v), torch.zeros_like(v), v, key_padding_mask=key_padding_mask,
                            window=window, backend=backend)
        return (out[:, :, 0, :seqlen] > 0).cpu()
    v = torch.cat([eye[:n] for n in lengths])[:, None, :]
    out = ops.attention(torch.zeros_like(v), torch.zeros_like(v), v, cu_seqlens=cu_seqlens_of(lengths, device),
                        max_seqlen=seqlen, window=window, backend=backend)
    allowed = torch.zeros(len(lengths), seqlen, seqlen, dtype=torch.bool)
    start = 0
    for b, n in enumerate(lengths):
        allowed[b, :n, :n] = out[start:start + n, 0, :n].cpu() > 0
        start += n
    return allowed


def check_rule_matches_transformers(backend: str, window: int, device="cpu") -> None:
    """Padded (right padding, holes, an all-padding row) and packed (lengths 1, 7, 13) against transformers."""
    seqlen = 13
    mask = torch.ones(4, seqlen, dtype=torch.bool)
    mask[1, 9:] = False
    mask[2, [0, 3, 4, 5, 11]] = False
    mask[3] = False
    ours = probed_allowed(backend, window, seqlen, mask.to(device), device=device)
    assert torch.equal(ours, transformers_allowed(window, mask)), f"{backend} padded window={window}"
    lengths = [1, 7, 13]
    ours = probed_allowed(backend, window, seqlen, lengths=lengths, device=device)
    for b, n in enumerate(lengths):
        expected = transformers_allowed(window, torch.ones(1, n, dtype=torch.bool))[0]
        assert torch.equal(ours[b, :n, :n], expected), f"{backend} packed length {n} window={window}"


def check_against_reference(backend: str, dtype: torch.dtype, window: int | None, lengths: list[int],
                            head_dim: int = 32, heads: int = 2, form: str = "packed", device="cpu",
                            scale: float | None = None) -> torch.Tensor:
    """``backend`` vs plain eager in ``dtype`` vs the fp64 eager reference (fastbert.numerics' rule). q, k, v are the
    strided views of one QKV buffer. packed: sequences of ``lengths``; padded: rows of max(lengths) with the keys
    past each length masked (a 0 length is an all-padding row, whose output must be zeros). Returns the output."""
    gen = torch.Generator().manual_seed(1000 * len(lengths) + 7 * head_dim + (window or 0))
    seqlen = max(lengths)
    if form == "packed":
        qkv = torch.randn(sum(lengths), 3, heads, head_dim, generator=gen)
        kwargs = {"cu_seqlens": cu_seqlens_of(lengths, device), "max_seqlen": seqlen}
    else:
        qkv = torch.randn(len(lengths), seqlen, 3, heads, head_dim, generator=gen)
        mask = torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]
        kwargs = {"key_padding_mask": mask.to(device)}
    q, k, v = qkv.to(device=device, dtype=dtype).unbind(-3)
    kwargs.update(scale=scale, window=window)
    fast = ops.attention(q, k, v, backend=backend, **kwargs)
    plain = ops.attention(q, k, v, backend="eager", **kwargs)
    reference = ops.attention(q.double(), k.double(), v.double(), backend="eager", **kwargs)
    assert fast.is_contiguous() and fast.dtype == dtype
    assert_accurate(fast, plain, reference, f"{backend} {form} {lengths} window={window} d{head_dim}")
    if form == "padded":
        for row, length in enumerate(lengths):
            if length == 0:
                assert torch.equal(fast[row], torch.zeros_like(fast[row])), "an all-padding row must give zeros"
    return fast


def check_packed_matches_padded(backend: str, dtype: torch.dtype, window: int, lengths: list[int],
                                head_dim: int = 16, device="cpu") -> None:
    """The same sequences packed and right-padded give the same real rows (to fp32 rounding)."""
    gen = torch.Generator().manual_seed(sum(lengths) + window)
    seqlen = max(lengths)
    padded = torch.randn(len(lengths), seqlen, 3, 2, head_dim, generator=gen).to(device=device, dtype=dtype)
    mask = (torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]).to(device)
    packed = padded[mask]
    out_padded = ops.attention(*padded.unbind(2), key_padding_mask=mask, window=window, backend=backend)
    out_packed = ops.attention(*packed.unbind(1), cu_seqlens=cu_seqlens_of(lengths, device), max_seqlen=seqlen,
                               window=window, backend=backend)
    torch.testing.assert_close(out_packed, out_padded[mask], rtol=1e-5, atol=1e-6)


def check_wide_window_is_global(backend: str, dtype: torch.dtype, seqlen: int, head_dim: int = 16,
                                device="cpu") -> None:
    """A window reaching every key (window // 2 >= S - 1) gives exactly the global result; one narrower does not."""
    gen = torch.Generator().manual_seed(seqlen)
    q, k, v = torch.randn(2, seqlen, 3, 2, head_dim, generator=gen).to(device=device, dtype=dtype).unbind(2)
    global_out = ops.attention(q, k, v, backend=backend)
    for window in (2 * seqlen - 2, 2 * seqlen - 1, 10 * seqlen, 2 ** 40):
        assert torch.equal(ops.attention(q, k, v, window=window, backend=backend), global_out), f"window={window}"
    if seqlen > 2:
        narrower = ops.attention(q, k, v, window=2 * seqlen - 4, backend=backend)
        assert not torch.equal(narrower, global_out), "a window short of one key must change the first row"


def check_no_key_in_window_gives_zeros(backend: str, dtype: torch.dtype, device="cpu") -> None:
    """Padded form, real keys only at 0..3 and 36..39 of 40: with window 4 (|i - j| <= 2) queries 6..33 see no real
    key and must get zeros; their neighbours near the real keys must not."""
    seqlen, head_dim = 40, 16
    gen = torch.Generator().manual_seed(40)
    q, k, v = torch.randn(1, seqlen, 3, 2, head_dim, generator=gen).to(device=device, dtype=dtype).unbind(2)
    mask = torch.zeros(1, seqlen, dtype=torch.bool)
    mask[0, :4] = True
    mask[0, 36:] = True
    out = ops.attention(q, k, v, key_padding_mask=mask.to(device), window=4, backend=backend)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 6:34], torch.zeros_like(out[0, 6:34]))
    assert out[0, :6].abs().amax(dim=(1, 2)).gt(0).all() and out[0, 34:].abs().amax(dim=(1, 2)).gt(0).all()


def check_window_poison(backend: str, dtype: torch.dtype, window: int, head_dim: int = 16, device="cpu") -> None:
    """NaN, +Inf and -Inf in q, k, v at masked positions (holes and right padding) inside the windows of real queries
    never reach them: real rows finite and bit-identical to the run with zeros there."""
    seqlen = 23
    gen = torch.Generator().manual_seed(window)
    qkv = torch.randn(3, seqlen, 3, 2, head_dim, generator=gen).to(device=device, dtype=dtype)
    mask = torch.ones(3, seqlen, dtype=torch.bool)
    mask[0, [2, 5, 6, 11]] = False
    mask[1, 15:] = False
    mask[2, ::2] = False
    mask = mask.to(device)
    masked = ~mask[:, :, None, None, None]
    cycle = torch.arange(qkv.numel(), device=device).view(qkv.shape) % len(POISONS)
    poison = torch.tensor(POISONS, dtype=dtype, device=device)[cycle]
    outputs = [ops.attention(*torch.where(masked, fill, qkv).unbind(2), key_padding_mask=mask, window=window,
                             backend=backend) for fill in (torch.zeros_like(qkv), poison)]
    clean, dirty = outputs
    assert torch.isfinite(dirty[mask]).all(), f"{backend}: NaN/Inf at masked keys reached real rows"
    assert torch.equal(dirty[mask], clean[mask]), f"{backend}: masked keys' values changed real rows"


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
