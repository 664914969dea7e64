"""fastbert.numerics: the one accuracy rule, on numbers worked out by hand."""

import pytest
import torch

from fastbert import numerics


@pytest.mark.parametrize("dtype, fast_err, plain_err, scale, expected", [
    (torch.float16, 0.02 + 4 * 2 ** -11, 0.01, 4.0, True),   # exactly 2 x 0.01 + half an ulp x 4
    (torch.float16, 0.0225, 0.01, 4.0, False),
    (torch.bfloat16, 2 ** -8, 0.0, 1.0, True),               # plain PyTorch exact: rounding the output is allowed
    (torch.bfloat16, 2 ** -7, 0.0, 1.0, False),
    (torch.float16, 0.0, float("nan"), 1.0, False),          # a non-finite yardstick would pass anything
    (torch.float32, 1e-5, None, 2.0, True),
    (torch.float32, 3e-5, None, 2.0, False),
], ids=["fp16-at-limit", "fp16-over", "bf16-atol", "bf16-over", "nan-yardstick", "fp32-ok", "fp32-over"])
def test_judge(dtype, fast_err, plain_err, scale, expected):
    assert numerics.judge(dtype, fast_err, plain_err, scale)[0] is expected


def test_half_atol_is_half_the_dtype_epsilon():
    for dtype, atol in numerics.HALF_ATOL_REL.items():
        assert atol == torch.finfo(dtype).eps / 2


def test_assert_accurate_names_what_failed():
    reference = torch.linspace(-2, 2, 64, dtype=torch.float64)
    plain = reference.half()
    numerics.assert_accurate(plain.clone(), plain, reference, "copy")
    with pytest.raises(AssertionError, match=r"^shifted: err .* > 2 x plain PyTorch err"):
        numerics.assert_accurate(plain + 0.01, plain, reference, "shifted")
    with pytest.raises(AssertionError, match="NaN"):
        numerics.assert_accurate(torch.full_like(plain, float("nan")), plain, reference, "nan")
