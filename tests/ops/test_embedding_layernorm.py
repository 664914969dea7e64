"""The triton embedding gather + LayerNorm kernel against an fp64 reference (the check is
`tools.op_checks`', shared with benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DTYPE_IDS
from tools.op_checks import check_embedding_layernorm

ALL_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16, torch.float32)]


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


def test_word_table_only_without_ln_bias_fp16():
    """ModernBERT's embedding: LayerNorm(word[ids]) without positions, token types or LayerNorm bias."""
    check_embedding_layernorm((3, 7), 130, torch.float16, types="none", positions=False, ln_bias=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("ids_shape,width", [((1, 1), 7), ((2, 7), 383), ((1, 130), 768)],
                         ids=["1x1-e7", "2x7-e383", "1x130-e768"])
@pytest.mark.parametrize("positions,ln_bias", [(False, False), (False, True), (True, False)],
                         ids=["no-positions-no-bias", "no-positions", "no-bias"])
def test_optional_positions_and_ln_bias(ids_shape, width, dtype, positions, ln_bias):
    check_embedding_layernorm(ids_shape, width, dtype, types="none" if not positions else "ids", positions=positions,
                              ln_bias=ln_bias)
