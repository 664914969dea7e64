"""fastbert.bench.timing: percentiles."""

import pytest

from fastbert.bench import timing


def test_percentile_interpolates():
    assert timing.percentile([4, 1, 3, 2], 50) == 2.5
    assert timing.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == pytest.approx(9.1)
    assert timing.percentile([7], 90) == 7
    with pytest.raises(ValueError):
        timing.percentile([], 50)
