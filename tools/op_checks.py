"""Accuracy checks of the triton backend's ops at any shape and dtype (the GEMM-bearing ones also of the vendor
backend, torch's GEMM + a Triton epilogue: ``backend="vendor"``): each builds random inputs (strided views
where asked, as models pass them), runs the op on that backend and on the eager one (plain PyTorch, the
yardstick) in the tested dtype and on eager in fp64 (the reference), and applies `fastbert.numerics`' rule.

tests/ops call them on small grids (CPU: the Triton interpreter), benchmarks/gpu_check.py at BERT-base/large
sizes. A failed check raises AssertionError saying what differed (explicit raises, so ``python -O`` checks too).
"""

from __future__ import annotations

import torch

from fastbert import ops
from fastbert.numerics import assert_accurate

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rand(*shape: int, dtype: torch.dtype, scale: float = 1.0, generator: torch.Generator | None = None):
    """Normal samples times ``scale`` on DEVICE in ``dtype`` (drawn in fp32 on CPU, so seeds give the same values
    on every device)."""
    return (torch.randn(*shape, generator=generator) * scale).to(device=DEVICE, dtype=dtype)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _maybe_strided(rows: int, cols: int, dtype, strided: bool, scale: float = 1.0) -> torch.Tensor:
    """[rows, cols], as a column slice of a wider tensor (non-contiguous rows) when strided."""
    if not strided:
        return rand(rows, cols, dtype=dtype, scale=scale)
    return rand(rows, cols + 9, dtype=dtype, scale=scale)[:, 5:5 + cols]


def _weight(out_features: int, in_features: int, dtype, transposed: bool) -> torch.Tensor:
    """[out, in] weight; transposed: a .t() view of an [in, out] tensor (column-major)."""
    if transposed:
        return rand(in_features, out_features, dtype=dtype, scale=0.05).t()
    return rand(out_features, in_features, dtype=dtype, scale=0.05)


# ----------------------------------------------------------------------------------------------------- GEMM ops
def check_linear_activation(rows, hidden, dtype, activation, strided, backend="triton"):
    inner = 4 * hidden
    x = _maybe_strided(rows, hidden, dtype, strided)
    weight, bias = _weight(inner, hidden, dtype, strided), rand(inner, dtype=dtype, scale=0.5)
    fast = ops.linear_activation(x, weight, bias, activation, backend=backend)
    plain = ops.linear_activation(x, weight, bias, activation, backend="eager")
    reference = ops.linear_activation(x.double(), weight.double(), bias.double(), activation, backend="eager")
    _require(fast.is_contiguous(), "linear_activation: the output is not contiguous")
    assert_accurate(fast, plain, reference, f"{backend} linear_activation {activation}")


def check_qkv_projection(rows, hidden, heads, dtype, strided, leading=(), backend="triton"):
    x = _maybe_strided(rows, hidden, dtype, strided)
    if leading:
        x = x.reshape(*leading, hidden)
    weight, bias = _weight(3 * hidden, hidden, dtype, strided), rand(3 * hidden, dtype=dtype, scale=0.5)
    fast = ops.qkv_projection(x, weight, bias, heads, backend=backend)
    plain = ops.qkv_projection(x, weight, bias, heads, backend="eager")
    reference = ops.qkv_projection(x.double(), weight.double(), bias.double(), heads, backend="eager")
    base = fast[0].untyped_storage().data_ptr()
    for name, f, p, r in zip("qkv", fast, plain, reference, strict=True):
        expected = (*x.shape[:-1], heads, hidden // heads)
        _require(f.shape == expected, f"qkv_projection {name}: shape {tuple(f.shape)} != {expected}")
        _require(f.untyped_storage().data_ptr() == base, "q, k, v must be views of one buffer (no copies)")
        assert_accurate(f, p, r, f"{backend} qkv_projection {name}")


def check_linear_residual_layernorm(rows, hidden, dtype, strided, with_bias=True, with_ln_bias=True, inner=None,
                                    backend="triton"):
    """inner: K (default 4 x hidden); with_ln_bias False: LayerNorm without shift."""
    inner = 4 * hidden if inner is None else inner
    x = _maybe_strided(rows, inner, dtype, strided)
    weight = _weight(hidden, inner, dtype, strided)
    bias = rand(hidden, dtype=dtype, scale=0.5) if with_bias else None
    residual = _maybe_strided(rows, hidden, dtype, strided, scale=2.0)
    ln_weight = rand(hidden, dtype=dtype).abs() + 0.5
    ln_bias = rand(hidden, dtype=dtype, scale=0.2) if with_ln_bias else None
    args = (x, weight, bias, residual, ln_weight, ln_bias, 1e-12)
    fast = ops.linear_residual_layernorm(*args, backend=backend)
    plain = ops.linear_residual_layernorm(*args, backend="eager")
    reference = ops.linear_residual_layernorm(*(a.double() if isinstance(a, torch.Tensor) else a for a in args),
                                              backend="eager")
    assert_accurate(fast, plain, reference, f"{backend} linear_residual_layernorm")


def check_linear_glu(rows, hidden, inner, dtype, activation, strided, with_bias=True, leading=(), backend="triton"):
    """act(x W_in^T + b_in) * (x W_gate^T + b_gate) with weight [2 inner, hidden] (ModernBERT's Wi); strided: x a
    column slice and the weight a transposed view; leading: x reshaped to [*leading, hidden]."""
    x = _maybe_strided(rows, hidden, dtype, strided)
    if leading:
        x = x.reshape(*leading, hidden)
    weight = _weight(2 * inner, hidden, dtype, strided)
    bias = rand(2 * inner, dtype=dtype, scale=0.5) if with_bias else None
    fast = ops.linear_glu(x, weight, bias, activation, backend=backend)
    plain = ops.linear_glu(x, weight, bias, activation, backend="eager")
    reference = ops.linear_glu(x.double(), weight.double(), None if bias is None else bias.double(), activation,
                               backend="eager")
    _require(fast.is_contiguous(), "linear_glu: the output is not contiguous")
    assert_accurate(fast, plain, reference, f"{backend} linear_glu {activation} rows{rows} H{hidden} I{inner}")


def check_linear_residual_prenorm(rows, hidden, inner, dtype, strided, with_bias=True, with_ln_bias=True,
                                  backend="triton"):
    """(x W^T + b + residual, its LayerNorm) with x [rows, inner], W [hidden, inner]; both outputs checked, and
    normed must be the LayerNorm of summed as returned."""
    x = _maybe_strided(rows, inner, dtype, strided)
    weight = _weight(hidden, inner, dtype, strided)
    bias = rand(hidden, dtype=dtype, scale=0.5) if with_bias else None
    residual = _maybe_strided(rows, hidden, dtype, strided, scale=2.0)
    ln_weight = rand(hidden, dtype=dtype).abs() + 0.5
    ln_bias = rand(hidden, dtype=dtype, scale=0.2) if with_ln_bias else None
    args = (x, weight, bias, residual, ln_weight, ln_bias, 1e-5)
    summed, normed = ops.linear_residual_prenorm(*args, backend=backend)
    plain = ops.linear_residual_prenorm(*args, backend="eager")
    reference = ops.linear_residual_prenorm(*(a.double() if isinstance(a, torch.Tensor) else a for a in args),
                                            backend="eager")
    what = f"{backend} linear_residual_prenorm rows{rows} N{hidden} K{inner}"
    _require(summed.is_contiguous() and normed.is_contiguous(), f"{what}: the outputs are not contiguous")
    assert_accurate(summed, plain[0], reference[0], f"{what} summed")
    assert_accurate(normed, plain[1], reference[1], f"{what} normed")
    # normed is LN(summed) as stored: compare with an fp64 LayerNorm of the returned sum, to the output's rounding
    again = torch.nn.functional.layer_norm(summed.double(), (hidden,), ln_weight.double(),
                                           None if ln_bias is None else ln_bias.double(), 1e-5)
    assert_accurate(normed, again.to(dtype), again, f"{what} normed vs LayerNorm(summed)")


def packed_positions(tokens: int) -> torch.Tensor:
    """Positions of packed sequences of lengths 5, 11, 23, ... (the last one cut at ``tokens``), each restarting at
    0, as varlen batches give them to qkv_rotary."""
    parts, left, length = [], tokens, 5
    while left:
        parts.append(torch.arange(min(length, left)))
        left -= len(parts[-1])
        length = 2 * length + 1
    return torch.cat(parts).to(DEVICE)


def check_qkv_rotary(rows, heads, head_dim, dtype, strided=False, with_bias=True, leading=None,
                     position_dtype=torch.int64, theta=160000.0, backend="triton"):
    """ModernBERT's QKV projection + rotary on q and k, positions restarting per packed sequence; strided: x a
    column slice, the weight a transposed view; leading: x and positions reshaped to [*leading, ...]."""
    hidden = heads * head_dim
    x = _maybe_strided(rows, hidden, dtype, strided)
    weight = _weight(3 * hidden, hidden, dtype, strided)
    bias = rand(3 * hidden, dtype=dtype, scale=0.5) if with_bias else None
    positions = packed_positions(rows).to(position_dtype)
    if leading is not None:
        x, positions = x.reshape(*leading, hidden), positions.reshape(leading)
    cos, sin = ops.rotary_tables(theta, head_dim, max(rows, 256), DEVICE)
    fast = ops.qkv_rotary(x, weight, bias, heads, positions, cos, sin, backend=backend)
    plain = ops.qkv_rotary(x, weight, bias, heads, positions, cos, sin, backend="eager")
    reference = ops.qkv_rotary_reference(x.double(), weight.double(), None if bias is None else bias.double(), heads,
                                         positions, cos, sin)
    base = fast[0].untyped_storage().data_ptr()
    for name, f, p, r in zip("qkv", fast, plain, reference, strict=True):
        expected = (*x.shape[:-1], heads, head_dim)
        _require(f.shape == expected, f"qkv_rotary {name}: shape {tuple(f.shape)} != {expected}")
        _require(f.untyped_storage().data_ptr() == base, "qkv_rotary: q, k, v must be views of one buffer")
        assert_accurate(f, p, r, f"{backend} qkv_rotary {name} rows{rows} heads{heads} d{head_dim}")


# ----------------------------------------------------------------------------------------- embedding_layernorm
def check_embedding_layernorm(ids_shape, width, dtype, types="ids", strided_tables=False, id_dtype=torch.int64,
                              strided_ids=False, positions=True, ln_bias=True):
    """types: "ids" (token type ids given), "default" (table but no ids: row 0), "none" (no table, DistilBERT).
    strided_ids: every id tensor is a column-strided view whose flattening stays a view (batch 1).
    positions False: no position ids nor table; ln_bias False: LayerNorm without shift (ModernBERT: both)."""
    vocab, positions = 50, 140

    def table(rows):
        if strided_tables:  # a column slice of a wider table: row stride != width
            return rand(rows, width + 16, dtype=dtype)[:, 8:8 + width]
        return rand(rows, width, dtype=dtype)

    word, position = table(vocab), table(positions)
    token_type = table(2) if types != "none" else None
    wide = (*ids_shape[:-1], 2 * ids_shape[-1]) if strided_ids else ids_shape

    def ids(high, dtype=torch.int64):
        full = torch.randint(0, high, wide, device=DEVICE, dtype=dtype)
        return full[..., ::2] if strided_ids else full

    input_ids = ids(vocab, id_dtype)
    position_ids = ids(positions) if strided_ids else torch.arange(ids_shape[-1], device=DEVICE).expand(ids_shape)
    token_type_ids = ids(2) if types == "ids" else None  # position ids above: stride-0 rows, as models pass
    weight, bias = rand(width, dtype=dtype).abs() + 0.5, rand(width, dtype=dtype, scale=0.2)
    if not positions:
        position_ids, position = None, None
    if not ln_bias:
        bias = None
    args = (input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, 1e-12)
    fast = ops.embedding_layernorm(*args, backend="triton")
    plain = ops.embedding_layernorm(*args, backend="eager")
    reference = ops.embedding_layernorm(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                          else a for a in args), backend="eager")
    _require(fast.shape == (*ids_shape, width) and fast.is_contiguous(),
             f"embedding_layernorm: output {tuple(fast.shape)} (contiguous: {fast.is_contiguous()}), expected a "
             f"contiguous {(*ids_shape, width)}")
    assert_accurate(fast, plain, reference, f"embedding_layernorm {ids_shape} E{width} types={types} "
                                            f"positions={positions} ln_bias={ln_bias}")


# --------------------------------------------------------------------------------------------------- attention
def packed_qkv(total: int, heads: int, head_dim: int, dtype):
    """q, k, v as the [T, heads, D] strided views of one [T, 3, heads, D] buffer (what qkv_projection returns)."""
    return rand(total, 3, heads, head_dim, dtype=dtype).unbind(1)


def check_packed(seqlens: list[int], heads: int, head_dim: int, dtype, scale: float | None = None):
    cu_seqlens = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, k, v = packed_qkv(sum(seqlens), heads, head_dim, dtype)
    _require(not q.is_contiguous(), "packed attention: q must be a strided view for this check")
    kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max(seqlens), "scale": scale}
    fast = ops.attention(q, k, v, backend="triton", **kwargs)
    plain = ops.attention(q, k, v, backend="eager", **kwargs)
    reference = ops.attention(q.double(), k.double(), v.double(), backend="eager", **kwargs)
    _require(fast.is_contiguous() and fast.dtype == dtype,
             f"packed attention: output {fast.dtype} (contiguous: {fast.is_contiguous()}), expected a contiguous "
             f"{dtype}")
    assert_accurate(fast, plain, reference, f"packed attention {seqlens} h{heads} d{head_dim}")


def check_padded(lengths: list[int], seqlen: int, heads: int, head_dim: int, dtype, with_mask: bool = True):
    """lengths: real tokens per row (0 = a fully masked row, whose output must be zeros)."""
    q, k, v = rand(len(lengths), seqlen, 3, heads, head_dim, dtype=dtype).unbind(2)
    mask = (torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]).to(DEVICE) if with_mask else None
    fast = ops.attention(q, k, v, key_padding_mask=mask, backend="triton")
    plain = ops.attention(q, k, v, key_padding_mask=mask, backend="eager")
    reference = ops.attention(q.double(), k.double(), v.double(), key_padding_mask=mask, backend="eager")
    assert_accurate(fast, plain, reference, f"padded attention {lengths} S{seqlen} h{heads} d{head_dim}")
    for row, length in enumerate(lengths):
        if length == 0:
            _require(fast[row].abs().max() == 0, "a query whose keys are all masked must give zeros")
