"""The triton embedding gather + LayerNorm kernel against an fp64 reference (the check is
`fastbert.bench.op_checks`', shared with benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from fastbert.bench.op_checks import check_embedding_layernorm
from tests.kernels.numerics import DTYPE_IDS

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
