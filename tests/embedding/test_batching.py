"""fastbert.embedding.batching: windows of rows end at an input error, and token-budget batches cover every text
once, longest first, within the budget."""

import numpy as np

from fastbert.embedding import InputError, Row, windows
from fastbert.embedding.batching import real_token_batches


def test_batches_respect_the_token_budget_and_cover_every_text_once():
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 128, size=300)]
    batches = real_token_batches(lengths, max_batch_tokens=200, max_batch_size=7)
    assert sorted(i for batch in batches for i in batch) == list(range(300))
    for batch in batches:
        assert len(batch) <= 7
        assert sum(lengths[i] for i in batch) <= 200 or len(batch) == 1
    assert all(lengths[b[0]] >= lengths[c[0]] for b, c in zip(batches, batches[1:], strict=False))  # longest first


def test_a_text_longer_than_the_budget_is_a_batch_on_its_own():
    assert real_token_batches([10, 300, 10], max_batch_tokens=100) == [[1], [0, 2]]
    assert real_token_batches([], max_batch_tokens=100) == []


def test_batches_count_real_tokens_not_padded_ones_and_can_keep_the_order():
    # 100 + 10 + 10 real tokens fit a budget of 120; counted padded (3 x 100) they would not
    assert real_token_batches([100, 10, 10], max_batch_tokens=120) == [[0, 1, 2]]
    assert real_token_batches([10, 100, 10, 5], max_batch_tokens=110, longest_first=False) == [[0, 1], [2, 3]]


def test_windows_cut_rows_and_end_with_the_rows_before_an_input_error():
    def rows():
        for line in range(1, 6):
            yield Row(line, line, f"text {line}")
        raise InputError("in.txt:6: broken")

    cut = list(windows(rows(), 2))
    assert [[r.line for r in window] for window, _ in cut] == [[1, 2], [3, 4], [5]]
    assert [error is None for _, error in cut] == [True, True, False]
    assert str(cut[-1][1]) == "in.txt:6: broken"


def test_windows_of_an_exact_multiple_end_without_an_empty_window():
    cut = list(windows(iter([Row(i, i, "t") for i in range(1, 5)]), 2))
    assert [len(window) for window, _ in cut] == [2, 2]
