"""Ready means warm: the forwards the model's thread runs before the server says it is ready.

The first forward of each shape class pays what later ones do not: the backend dispatcher's measuring (or the
read of the tuning cache that spares it), kernel compiles, allocations. Run at start, they happen before /health
answers 200 rather than in the first clients' requests. ``quick`` runs one forward at a few token counts up to the
batch budget; ``full`` crosses more text lengths with more token counts; ``none`` is ready at once. The warm-up
stops after the forward that passes ``seconds``."""

from __future__ import annotations

import sys
import time
from typing import Any

from fastbert.common.text import plural
from fastbert.serving.engines import Tokens

WARMUPS = ("none", "quick", "full")
FILLER_ID = 1000  # an ordinary word piece in BERT-style vocabularies; any id below vocab_size would do


def shapes(mode: str, max_batch_tokens: int, max_length: int) -> list[tuple[int, int]]:
    """(text length, texts) of each warm-up forward: short texts at a few budgets, then the longest texts."""
    if mode == "none":
        return []
    lengths = (16, 48, max_length) if mode == "quick" else (8, 16, 32, 64, 128, 256, 512, max_length)
    totals = (64, max_batch_tokens) if mode == "quick" else (64, 512, max_batch_tokens // 4, max_batch_tokens)
    out = []
    for length in sorted({min(n, max_length) for n in lengths}):
        for total in sorted(set(totals)):
            out.append((length, max(1, min(total, max_batch_tokens) // length)))
    return list(dict.fromkeys(out))


def warm(engine: Any, max_batch_tokens: int, mode: str, seconds: float) -> int:
    """Run the warm-up forwards of ``mode`` on ``engine`` (in the model's thread), at most about ``seconds``; the
    forwards run. A line on stderr says what it took."""
    start = time.perf_counter()
    done = 0
    vocab = engine.config.vocab_size
    types = bool(getattr(engine.config, "type_vocab_size", 0)) and engine.task != "embed"
    for length, count in shapes(mode, max_batch_tokens, engine.max_length):
        if time.perf_counter() - start > seconds:
            break
        ids = [min(FILLER_ID, vocab - 1)] * length
        engine.run([Tokens(list(ids), [0] * length if types else None) for _ in range(count)])
        done += 1
    if mode != "none":
        sys.stderr.write(f"fastbert serve: warm-up {mode}: {plural(done, 'forward')} in "
                         f"{time.perf_counter() - start:.1f} s\n")
    return done
