"""The triton embedding gather + LayerNorm kernel against an fp64 reference."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from tests.kernels.numerics import DEVICE, DTYPE_IDS, assert_accurate, rand

ALL_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16, torch.float32)]


def check_embedding_layernorm(ids_shape, width, dtype, types="ids", strided_tables=False, id_dtype=torch.int64,
                              strided_ids=False):
    """types: "ids" (token type ids given), "default" (table but no ids: row 0), "none" (no table, DistilBERT).
    strided_ids: every id tensor is a column-strided view whose flattening stays a view (batch 1)."""
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
    args = (input_ids, position_ids, token_type_ids, word, position, token_type, weight, bias, 1e-12)
    fast = ops.embedding_layernorm(*args, backend="triton")
    plain = ops.embedding_layernorm(*args, backend="eager")
    reference = ops.embedding_layernorm(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                          else a for a in args), backend="eager")
    assert fast.shape == (*ids_shape, width) and fast.is_contiguous()
    assert_accurate(fast, plain, reference, f"embedding_layernorm {ids_shape} E{width} types={types}")


def test_embedding_layernorm_fp16():
    check_embedding_layernorm((3, 7), 384, torch.float16)


def test_strided_ids_are_read_with_their_stride():
    check_embedding_layernorm((1, 9), 64, torch.float16, strided_ids=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("ids_shape,width", [((1, 1), 1024), ((2, 7), 768), ((1, 130), 384)],
                         ids=["1x1-e1024", "2x7-e768", "1x130-e384"])
def test_embedding_layernorm(ids_shape, width, dtype):
    check_embedding_layernorm(ids_shape, width, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("types", ["default", "none"])
def test_token_type_variants(types):
    check_embedding_layernorm((2, 9), 128, torch.bfloat16, types=types)


@pytest.mark.interpreter
def test_strided_tables_int32_ids_flat_ids():
    check_embedding_layernorm((5,), 312, torch.float16, strided_tables=True, id_dtype=torch.int32)
