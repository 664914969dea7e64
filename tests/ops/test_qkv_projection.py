"""qkv_projection (x W_qkv^T + b split into q, k, v views) on every backend: the forward against fp64 references with
plain PyTorch in the same dtype as the error yardstick (triton's checks are `tools.op_checks`', shared with
benchmarks/gpu_check.py), the backward against the eager op's autograd and by gradcheck of the spec's formula, and
opcheck of the triton torch op (the cpp backend's QKV is one addmm: no torch op of its own). On CPU the triton
kernels run in the Triton interpreter: a cheap subset is unmarked, the rest `interpreter`."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from tests.helpers import (
    ALL_DTYPES,
    CPP_DTYPES,
    CPP_WIDTHS,
    assert_accurate_fp64,
    cpp_linear_inputs,
)
from tests.ops.helpers import BERT_SHAPE_IDS, BERT_SHAPES, grad_tests
from tools.op_checks import check_qkv_projection

OP = "qkv_projection"


# ------------------------------------------------------------------------------------------------- forward
def test_triton_fp16():
    check_qkv_projection(7, 384, 6, torch.float16, strided=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden,heads", BERT_SHAPES, ids=BERT_SHAPE_IDS)
def test_triton(rows, hidden, heads, dtype):
    check_qkv_projection(rows, hidden, heads, dtype, strided=rows == 7)


@pytest.mark.interpreter
def test_triton_batched_input():
    check_qkv_projection(12, 384, 6, torch.bfloat16, strided=False, leading=(3, 4))


@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("width", CPP_WIDTHS)
def test_cpp_one_head(width, dtype):
    """Through the dispatch, K = width, one head of width features, a strided 3-D x."""
    t = cpp_linear_inputs(width, dtype)
    x, w, b = t["x"], t["w"], t["b"]
    heads = 1
    w3 = torch.cat([w, w * 0.5, -w])
    b3 = torch.cat([b, b, b])
    reference = ops.qkv_projection_reference(x.double(), w3.double(), b3.double(), heads)
    for fast, plain, ref in zip(ops.qkv_projection(x, w3, b3, heads, backend="cpp"),
                                ops.qkv_projection_reference(x, w3, b3, heads), reference, strict=True):
        assert fast.shape == plain.shape == (2, 5, heads, width)
        assert_accurate_fp64(fast, plain, ref, "qkv")


# ------------------------------------------------------------------------------------------------ backward
# opcheck: the triton torch op alone (the cpp backend's QKV is one addmm, no torch op of its own)
TestGrads = grad_tests(OP, opcheck_backends=[pytest.param("triton", marks=pytest.mark.interpreter)])
