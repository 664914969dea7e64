"""The triton attention kernel (packed variable-length and padded + key padding mask, global or in a sliding window)
against fp64 references (the global checks are `tools.op_checks`', shared with benchmarks/gpu_check.py; the
window checks tests/ops/test_attention_window.py's, shared with the cpp backend)."""

from __future__ import annotations

import pytest
import torch

from fastbert import backends, ops
from tests.helpers import (
    DEVICE,
    DTYPE_IDS,
    check_against_reference,
    check_no_key_in_window_gives_zeros,
    check_packed_matches_padded,
    check_padding_poison,
    check_rule_matches_transformers,
    check_wide_window_is_global,
    check_window_poison,
    cu_seqlens_of,
)
from tools.op_checks import check_packed, check_padded

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


# ------------------------------------------------------------------------------------------ sliding window
def test_window_rule_matches_transformers_modernbert_mask():
    """Which keys each query attends (probed through the output) equals transformers' ModernBERT mask: padded with
    holes and an all-padding row, packed lengths 1, 7, 13; the odd window 7 (half 3) and the even 16 (half 8)."""
    for window in (7, 16):
        check_rule_matches_transformers("triton", window, device=DEVICE)


def test_window_packed_fp16_lengths_1_7_130():
    check_against_reference("triton", torch.float16, 16, [1, 7, 130], head_dim=64, device=DEVICE)


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # NaN q at padded rows
def test_window_without_a_real_key_gives_zeros_and_masked_nan_does_not_leak():
    check_no_key_in_window_gives_zeros("triton", torch.float16, device=DEVICE)
    check_window_poison("triton", torch.float32, 7, device=DEVICE)


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [0, 1, 2, 128], ids=lambda w: f"w{w}")
def test_window_rule_other_widths(window):
    check_rule_matches_transformers("triton", window, device=DEVICE)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("window", [1, 2, 7, 16, 128], ids=lambda w: f"w{w}")
def test_window_packed(window, dtype):
    check_against_reference("triton", dtype, window, [1, 7, 130], head_dim=64, device=DEVICE)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("window", [2, 7, 128], ids=lambda w: f"w{w}")
def test_window_padded(window, dtype):
    """Right padding and an all-padding row (zeros), an explicit scale."""
    check_against_reference("triton", dtype, window, [130, 7, 1, 0], head_dim=32, form="padded",
                                          device=DEVICE, scale=0.3)


@pytest.mark.interpreter
def test_window_128_over_a_long_sequence():
    """S = 520 with blocks of 64: query blocks in the middle skip whole key blocks on both sides."""
    check_against_reference("triton", torch.bfloat16, 128, [520, 3], heads=1, head_dim=64,
                                          device=DEVICE)


@pytest.mark.interpreter
@pytest.mark.parametrize("seqlen", [1, 7, 130], ids=lambda s: f"S{s}")
def test_window_wider_than_the_sequence_is_global(seqlen):
    check_wide_window_is_global("triton", torch.float16, seqlen, device=DEVICE)


@pytest.mark.interpreter
def test_window_packed_and_padded_agree():
    check_packed_matches_padded("triton", torch.float32, 7, [1, 7, 70], device=DEVICE)


@pytest.mark.interpreter
# the NaN q rows at padded query positions make numpy's matmul warn; those rows' outputs are unspecified
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("dtype", [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16)])
def test_window_nan_and_inf_at_masked_keys_never_reach_real_rows(dtype):
    check_window_poison("triton", dtype, 2, device=DEVICE)


@pytest.mark.interpreter
def test_window_opcheck():
    q, k, v = torch.randn(10, 3, 2, 8, device=DEVICE).unbind(1)
    cu_seqlens = cu_seqlens_of([3, 0, 7], DEVICE)
    torch.library.opcheck(torch.ops.fastbert.triton_attention.default, (q, k, v, cu_seqlens, 7, None, None, 2))
    q, k, v = torch.randn(2, 6, 3, 2, 8, device=DEVICE).unbind(2)
    mask = torch.tensor([[True] * 4 + [False] * 2, [False] * 6], device=DEVICE)
    torch.library.opcheck(torch.ops.fastbert.triton_attention.default, (q, k, v, None, None, mask, 0.5, 3))


def test_window_launcher_rejects_a_negative_window():
    q = torch.zeros(1, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="window must be >= 0"):
        torch.ops.fastbert.triton_attention(q, q, q, None, None, None, None, -1)
