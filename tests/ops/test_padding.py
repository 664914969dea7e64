"""The padding ops (unpad: padded [B, S, ...] to the packed real tokens, pad: back, zeros at padded positions): the
cpp torch ops against the eager gathers and scatters, in float and integer dtypes, with an all-padded row, their
index check, and opcheck. The attention ops' padding poison checks are in tests/ops/test_attention.py."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from fastbert.backends import cpp


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
