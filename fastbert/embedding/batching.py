"""Cutting work into groups: the input's rows into windows (what the driver holds in memory at once), and a
window's texts into batches by a token budget (what one forward call of the model gets)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from fastbert.embedding.reading import InputError, Row


def windows(rows: Iterator[Row], size: int) -> Iterator[tuple[list[Row], InputError | None]]:
    """Rows in windows of ``size``; an `InputError` ends the stream after a last window of the rows before it."""
    window: list[Row] = []
    while True:
        try:
            row = next(rows)
        except StopIteration:
            break
        except InputError as err:
            yield window, err
            return
        window.append(row)
        if len(window) == size:
            yield window, None
            window = []
    if window:
        yield window, None


def token_budget_batches(lengths: Sequence[int], max_batch_tokens: int,
                         max_batch_size: int | None = None) -> list[list[int]]:
    """Indices of the texts of token counts ``lengths``, longest first, cut into batches of at most
    ``max_batch_tokens`` tokens counted padded (texts x longest text of the batch) and at most ``max_batch_size``
    texts. Sorting by length keeps the padding small; a text longer than the budget is a batch on its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (full or (len(current) + 1) * longest > max_batch_tokens):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches
