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


def real_token_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int | None = None,
                       longest_first: bool = True) -> list[list[int]]:
    """Indices of the texts of token counts ``lengths`` cut into batches of at most ``max_batch_tokens`` real
    tokens (the encoder runs packed, without padding: a forward's cost follows its real tokens) and at most
    ``max_batch_size`` texts; a text longer than the budget is a batch on its own. ``longest_first``: sorted by
    length first (`fastbert embed`: similar lengths share a batch); else in the order given (the server: jobs
    finish in queue order)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if longest_first else range(len(lengths))
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index in order:
        full = max_batch_size is not None and len(current) >= max_batch_size
        if current and (full or total + lengths[index] > max_batch_tokens):
            batches.append(current)
            current, total = [], 0
        current.append(index)
        total += lengths[index]
    if current:
        batches.append(current)
    return batches
