"""The triton attention kernel (packed variable-length and padded + key padding mask) against fp64 references
(the checks are `fastbert.bench.op_checks`', shared with benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from fastbert import backends, ops
from fastbert.bench.op_checks import check_packed, check_padded
from tests.kernels.numerics import DEVICE, DTYPE_IDS
from tests.test_backends import check_padding_poison

ALL_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16, torch.float32)]
HEAD_DIMS = [32, 64, 80, 96, 128]


# ---------------------------------------------------------------------------------- cheap subset (CI, unmarked)
def test_packed_fp16_lengths_1_7_130():
    check_packed([1, 7, 130], heads=2, head_dim=64, dtype=torch.float16)


def test_padded_fp16_all_but_one_row_padded_and_a_fully_masked_row():
    check_padded([20, 3, 1, 0], seqlen=20, heads=2, head_dim=32, dtype=torch.float16)


def test_packed_bf16_head_dim_80_padded_to_the_block():
    check_packed([7, 1, 70], heads=2, head_dim=80, dtype=torch.bfloat16)


def test_unsupported_head_dim_reason():
    q = torch.zeros(4, 2, 12, dtype=torch.float16, device=DEVICE)
    cu_seqlens = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    reason = backends.why_not("attention", "triton", q, q, q, cu_seqlens, 4, None, None)
    assert reason is not None and "head_dim 12 not supported" in reason
    with pytest.raises(backends.BackendUnavailable, match="head_dim 12"):
        ops.attention(q, q, q, cu_seqlens=cu_seqlens, max_seqlen=4, backend="triton")


# ------------------------------------------------------------------------------------ full grid (interpreter)
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_packed_head_dims(head_dim, dtype):
    check_packed([7, 1, 130], heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("head_dim", [8, 48, 256])
def test_packed_other_head_dims(head_dim):
    check_packed([5, 40], heads=2, head_dim=head_dim, dtype=torch.float16)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_padded_head_dims(head_dim, dtype):
    check_padded([130, 7, 1, 0], seqlen=130, heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("heads,head_dim", [(6, 64), (12, 64), (16, 64)], ids=["h6", "h12", "h16"])
def test_packed_bert_head_counts(heads, head_dim):
    check_packed([7, 33], heads=heads, head_dim=head_dim, dtype=torch.bfloat16)


@pytest.mark.interpreter
def test_padded_without_mask_and_custom_scale():
    check_padded([9, 9], seqlen=9, heads=3, head_dim=32, dtype=torch.float16, with_mask=False)
    check_packed([9, 4], heads=3, head_dim=32, dtype=torch.float16, scale=0.3)


@pytest.mark.interpreter
# the NaN q rows at padded query positions make numpy's matmul warn; those rows' outputs are unspecified
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("dtype", [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float32, torch.float16)])
@pytest.mark.parametrize("head_dim", (8, 16), ids=lambda d: f"d{d}")
def test_padded_nan_and_inf_at_padded_positions_never_reach_real_rows(head_dim, dtype):
    """Masked keys' K and V are never loaded (masked loads), so NaN/Inf there cannot leak as 0 * NaN."""
    check_padding_poison("triton", dtype, head_dim, device=DEVICE)


@pytest.mark.interpreter
def test_single_token_sequences():
    check_packed([1, 1, 1], heads=2, head_dim=32, dtype=torch.float16)
    check_padded([1, 0], seqlen=1, heads=2, head_dim=32, dtype=torch.bfloat16)


@pytest.mark.interpreter
def test_long_sequence_1024():
    check_packed([1024], heads=1, head_dim=64, dtype=torch.float16)


@pytest.mark.interpreter
@pytest.mark.slow
def test_long_sequence_4096():
    check_packed([4096, 5], heads=1, head_dim=32, dtype=torch.bfloat16)


@pytest.mark.interpreter
def test_long_sequence_520():
    check_packed([520, 3], heads=1, head_dim=64, dtype=torch.bfloat16)
