"""The padding ops (unpad: padded [B, S, ...] to the packed real tokens, pad: back, zeros at padded positions): the
cpp torch ops against the eager gathers and scatters, in float and integer dtypes, with an all-padded row, their
index check, and opcheck. The attention ops' padding poison checks are in tests/ops/test_attention.py. Row buckets
(`fill_rows`): filler sequences up to the next bucket; the model's use of them is in tests/test_packing.py."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from fastbert.backends import cpp
from fastbert.ops.padding import FILLER_CHUNK, ROW_BUCKETS, VarlenBatch, fill_rows, has_gaps


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int64), ids=("fp32", "bf16", "int64"))
def test_cpp_pad_unpad_match_eager(dtype):
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(4, 9, generator=gen) > 0.4
    mask[2] = False
    varlen = ops.varlen_from_mask(mask, 4, 9, torch.device("cpu"))
    x = (torch.randn(4, 9, 2, 7, generator=gen) * 10).to(dtype)
    packed = cpp.unpad(x, varlen.indices)
    assert torch.equal(packed, ops.unpad_tokens(x, varlen))
    assert torch.equal(cpp.pad(packed, varlen.indices, 4, 9), ops.pad_tokens(packed, varlen))
    with pytest.raises(RuntimeError, match=r"indices holds 36, outside \[0, 36\)"):
        cpp.unpad(x, torch.tensor([0, 36]))


def test_cpp_opcheck_unpad():
    torch.manual_seed(0)
    torch.library.opcheck(torch.ops.fastbert.cpp_unpad.default, (torch.randn(2, 4, 3), torch.tensor([0, 1, 4, 6])))


def test_cpp_opcheck_pad():
    torch.manual_seed(0)
    torch.library.opcheck(torch.ops.fastbert.cpp_pad.default, (torch.randn(4, 3), torch.tensor([0, 1, 4, 6]), 2, 4))


# ------------------------------------------------------------------------------------------ row buckets
def packed(lengths: list[int], width: int | None = None) -> tuple:
    """ids (or vectors [T, width]), positions, types and the varlen of sequences of ``lengths``."""
    total = sum(lengths)
    tokens = torch.arange(3, 3 + total) if width is None else torch.randn(total, width)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return tokens, positions, torch.ones(total, dtype=torch.long), VarlenBatch(None, cu, max(lengths), len(lengths),
                                                                                max(lengths))


@pytest.mark.parametrize("lengths, sizes", (([1], (16, 32)), ([7], (16, 32)), ([130], ROW_BUCKETS),
                                           ([5, 1, 11], ROW_BUCKETS), ([300] * 7, ROW_BUCKETS)))
def test_fill_rows_grows_to_the_next_bucket_with_filler_sequences(lengths, sizes):
    tokens, positions, types, varlen = packed(lengths)
    total = sum(lengths)
    filled = fill_rows(tokens, positions, types, varlen, pad_token=0, sizes=sizes)
    size = min(s for s in sizes if s >= total)
    assert filled.rows == total and filled.tokens.shape == (size,)
    assert torch.equal(filled.tokens[:total], tokens) and not filled.tokens[total:].any()
    assert torch.equal(filled.positions[:total], positions) and not filled.positions[total:].any()
    assert torch.equal(filled.types[:total], types) and not filled.types[total:].any()
    cu = filled.varlen.cu_seqlens
    assert torch.equal(cu[: len(lengths) + 1], varlen.cu_seqlens)  # the real sequences first, unchanged
    fillers = (cu[len(lengths) + 1:] - cu[len(lengths):-1]).tolist()
    assert sum(fillers) == size - total and all(1 <= n <= FILLER_CHUNK for n in fillers)
    assert max(fillers) <= max(max(lengths), 16)  # attention's longest sequence stays the real one (or 16)
    assert int(cu[-1]) == size and filled.varlen.batch == cu.numel() - 1
    assert filled.varlen.max_seqlen == max(max(lengths), max(fillers))


def test_fill_rows_fills_vectors_with_zero_rows():
    tokens, positions, types, varlen = packed([7, 12], width=5)
    filled = fill_rows(tokens, positions, None, varlen, pad_token=0)
    assert filled.tokens.shape == (32, 5) and filled.types is None
    assert torch.equal(filled.tokens[:19], tokens) and not filled.tokens[19:].any()


def test_fill_rows_leaves_a_bucket_size_and_past_the_largest_alone():
    assert fill_rows(*packed([16]), pad_token=0) is None
    assert fill_rows(*packed([8, 8]), pad_token=0) is None
    assert fill_rows(*packed([10]), pad_token=0, sizes=(4, 8)) is None  # past the largest: no bucket


def test_filling_rows_to_a_bucket_never_changes_autos_shape_class():
    from fastbert.backends import tuning

    for total in range(1, ROW_BUCKETS[-1] + 1):
        filled = min(size for size in ROW_BUCKETS if size >= total)
        assert tuning.bucket(filled) == tuning.bucket(total), (total, filled)


def test_row_buckets_are_few_and_waste_at_most_a_sixteenth():
    """Every count below 16 is a bucket of its own: a one-token query filled to 16 rows took twice as long."""
    assert len(ROW_BUCKETS) < 100 and ROW_BUCKETS[:16] == tuple(range(1, 17)) and ROW_BUCKETS[-1] == 16384
    assert all(size % 16 == 0 for size in ROW_BUCKETS[15:])
    assert all(b / a <= 1.0625 + 16 / a for a, b in zip(ROW_BUCKETS[15:], ROW_BUCKETS[16:], strict=False))
    assert all(fill_rows(*packed([total]), pad_token=0) is None for total in range(1, 17))
    assert fill_rows(*packed([17]), pad_token=0).tokens.shape[0] == 32


@pytest.mark.parametrize("rows, expected", [
    ([[1, 1, 1]], False), ([[1, 1, 0]], False), ([[0, 1, 1]], False), ([[0, 0, 0]], False), ([[0, 1, 0]], False),
    ([[1, 0, 1]], True), ([[1, 1, 0], [0, 1, 0], [1, 0, 1]], True), ([[1]], False), ([[1, 0, 0, 1, 0, 0, 0]], True),
])
def test_has_gaps_finds_padding_between_the_tokens_of_a_row(rows, expected):
    assert has_gaps(torch.tensor(rows, dtype=torch.bool)) is expected
