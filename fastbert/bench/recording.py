"""Which backend each fused op ran on: `record_backends` counts the calls within a block, `backends_used` puts the
counts in words, `backend_availability` says which backends loaded. Used by the CLI, the benchmarks and tests that
assert fastbert ran every op."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from fastbert import backends
from fastbert.ops import SPECS

OPS = tuple(SPECS)  # the registry's list of fused ops


@contextlib.contextmanager
def record_backends() -> Iterator[dict[str, Counter]]:
    """Within the block, count which backend each fused op call ran on: yields {op: Counter({backend: calls})}.

    Works through `fastbert.backends.observe`, which both `dispatch` and the models' resolved op tables report to.
    """
    seen: dict[str, Counter] = {}

    def count(op: str, backend: str) -> None:
        seen.setdefault(op, Counter())[backend] += 1

    with backends.observe(count):
        yield seen


def backends_used(seen: dict[str, Counter]) -> dict[str, str]:
    """{op: 'cpp'} or {op: 'cpp x5, eager x1'} from `record_backends`' counts, in the order the ops first ran
    (a forward's order: embedding_layernorm first)."""
    out = {}
    for op, counts in seen.items():
        out[op] = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{b} x{n}" for b, n in counts.most_common())
    return out


def backend_availability() -> dict[str, str]:
    """Each backend: 'loaded' or the reason it could not load."""
    return {name: reason or "loaded" for name, reason in backends.available().items()}
