"""The embedding run: rows window by window through an embedder into an output, in input order, with a progress
line. Memory is bounded by the window (``window_rows`` texts and their embeddings), not by the corpus."""

from __future__ import annotations

import inspect
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from fastbert.common.resolve import UserError
from fastbert.embedding.batching import windows
from fastbert.embedding.reading import InputError, Row
from fastbert.embedding.stats import INVISIBLE_LINES_KEPT, EmbedStats

BLANK_POLICIES = ("null", "error")
PROGRESS_BAR_WIDTH = 24


class Progress:
    """A progress line on stderr: rows, texts/s, tokens/s, and with a known input size the fraction done and an
    ETA. On a terminal it redraws one line (at most 4 times a second); otherwise it prints a line every
    ``log_every`` seconds."""

    def __init__(self, total_bytes: int | None, enabled: bool, stream: TextIO | None = None, log_every: float = 10.0,
                 initial: EmbedStats | None = None):
        self.stream = stream or sys.stderr
        # a resumed run: rates and the ETA count this run's work only
        self.initial = initial.copy() if initial is not None else EmbedStats()
        self.enabled, self.total_bytes = enabled, total_bytes
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = 0.25 if self.tty else log_every
        self.start = time.perf_counter()
        self.last = -math.inf  # the first update always shows (perf_counter's zero is arbitrary, e.g. boot)

    def update(self, stats: EmbedStats, bytes_read: int, force: bool = False) -> None:
        """Show the counts so far (at most once an interval unless ``force``)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        line = "fastbert embed: " + "  ".join(self.fields(stats, bytes_read, max(now - self.start, 1e-9)))
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def fields(self, stats: EmbedStats, bytes_read: int, elapsed: float) -> list[str]:
        """The parts of the progress line: bar and fraction, rows, rates, ETA."""
        parts = []
        if self.total_bytes:
            fraction = min(bytes_read / self.total_bytes, 1.0)
            filled = int(fraction * PROGRESS_BAR_WIDTH)
            parts.append(f"[{'#' * filled}{'.' * (PROGRESS_BAR_WIDTH - filled)}] {fraction:4.0%}")
        parts.append(f"{stats.rows:,} rows")
        parts.append(f"{(stats.embedded - self.initial.embedded) / elapsed:,.0f} texts/s")
        parts.append(f"{(stats.tokens - self.initial.tokens) / elapsed:,.0f} tokens/s")
        if self.total_bytes and 0 < bytes_read < self.total_bytes:
            remaining = elapsed * (self.total_bytes - bytes_read) / bytes_read
            parts.append(f"ETA {int(remaining // 60)}:{int(remaining % 60):02d}")
        return parts

    def close(self) -> None:
        """End the redrawn line on a terminal."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def skip_rows(rows: Iterator[Row], count: int) -> None:
    """Consume ``count`` rows (a resumed run passes over what the manifest says is done)."""
    for _ in range(count):
        try:
            next(rows)
        except StopIteration as err:
            raise UserError(f"--resume: the input has fewer rows than the {count} already written; is it the same "
                            "input?") from err


def cut_at_first_blank(window: list[Row]) -> tuple[list[Row], InputError | None]:
    """The rows before the window's first blank text and an error naming its line, and why it is blank when it
    was more than whitespace (--on-blank error)."""
    for position, row in enumerate(window):
        if row.text is None:
            why = f": {row.why}" if row.why else ""
            return window[:position], InputError(f"line {row.line}: blank text{why} (--on-blank error)")
    return window, None


def mark_blank(embedder: Any, window: list[Row]) -> None:
    """Make the rows whose text the embedder's tokenizer keeps nothing of blank (null, with why), as the reader
    does for texts of only invisible characters: before the window is cut (--on-blank error) and embedded.
    An embedder without ``kept_nothing`` (a stand-in) decides in ``embed``."""
    kept_nothing = getattr(embedder, "kept_nothing", None)
    if kept_nothing is None:
        return
    texted = [row for row in window if row.text is not None]
    for row, why in zip(texted, kept_nothing([row.text for row in texted]), strict=True):
        if why is not None:
            row.text, row.why = None, why


def invisible_stats(window: list[Row]) -> EmbedStats:
    """The counts of the window's rows that are null though their text was more than whitespace."""
    lines = [row.line for row in window if row.text is None and row.why]
    return EmbedStats(invisible=len(lines), invisible_lines=lines[:INVISIBLE_LINES_KEPT])


def embed_window(embedder: Any, window: list[Row], total: EmbedStats, progress: Progress | None,
                 span: tuple[int, int]) -> tuple[Any, EmbedStats]:
    """One window's embeddings and counts. With a progress line and an embedder that reports its batches
    (``embed(..., on_batch=callback(texts, tokens))``, as `fastbert.embedding.Embedder` does) the line moves batch
    by batch: a window of 2,048 rows takes tens of seconds on a CPU, too long to show nothing. ``span``: the input's
    bytes read before and after the window; the line shows the part of it as far as the rows embedded (the window
    is read whole before its first batch)."""
    texts, lines = [r.text for r in window], [r.line for r in window]
    if progress is None or "on_batch" not in inspect.signature(embedder.embed).parameters:
        return embedder.embed(texts, lines)
    partial = total.copy()

    def on_batch(embedded: int, tokens: int) -> None:
        partial.rows, partial.embedded, partial.tokens = (partial.rows + embedded, partial.embedded + embedded,
                                                          partial.tokens + tokens)
        done = partial.rows - total.rows
        progress.update(partial, span[0] + (span[1] - span[0]) * done // len(window))

    return embedder.embed(texts, lines, on_batch=on_batch)


def run(embedder: Any, rows: Iterator[Row], output: Any, window_rows: int = 2048, progress: Progress | None = None,
        bytes_read: Callable[[], int] = lambda: 0, blank: str = "null",
        initial: EmbedStats | None = None) -> EmbedStats:
    """Embed ``rows`` window by window into ``output`` (`FileOutput` or `ShardedOutput`), in input order.
    ``embedder``: anything with ``embed(texts, lines) -> (embeddings, EmbedStats)`` (and, to tell which texts its
    tokenizer keeps nothing of, ``kept_nothing(texts)``). blank: "null" (a null row) or "error" (stop at the first
    blank text with its line number): blank is a text of whitespace and invisible characters only
    (`fastbert.embedding.reading.is_blank`) or one the tokenizer keeps nothing of; the null rows of such texts
    that were more than whitespace are counted in ``invisible``. Input errors stop the run after the rows
    before them are written; they are raised after. ``initial``: the counts of a resumed run's earlier part."""
    if window_rows < 1:
        raise UserError("--window-rows must be >= 1")
    total = initial.copy() if initial is not None else EmbedStats()
    pending_error: InputError | None = None
    read_before = bytes_read()  # where the first window starts (after the rows a resumed run skipped)
    for window, error in windows(rows, window_rows):
        read_after = bytes_read()
        mark_blank(embedder, window)
        if blank == "error":
            window, blank_error = cut_at_first_blank(window)
            error = blank_error or error
        if window:
            embeddings, stats = embed_window(embedder, window, total, progress, (read_before, read_after))
            total.add(stats)
            total.add(invisible_stats(window))
            output.write([r.id for r in window], embeddings, total)
            if progress is not None:
                progress.update(total, bytes_read())
        read_before = read_after
        if error is not None:
            pending_error = error
            break
    if progress is not None:
        progress.update(total, bytes_read(), force=True)
        progress.close()
    if pending_error is not None:
        raise pending_error
    return total
