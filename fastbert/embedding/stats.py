"""The counts of an embedding run (or of one `fastbert.embedding.Embedder.embed` call)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

TRUNCATED_LINES_KEPT = 10  # line numbers of truncated texts kept for the warning; the count covers all of them


@dataclass
class EmbedStats:
    """Counts over a run (or one `fastbert.embedding.Embedder.embed` call)."""

    rows: int = 0
    embedded: int = 0
    null_rows: int = 0
    truncated: int = 0
    tokens: int = 0
    batches: int = 0
    truncated_lines: list[int] = field(default_factory=list)  # the first few, for the warning

    def add(self, other: EmbedStats) -> None:
        """Add ``other``'s counts to these (keeping the first `TRUNCATED_LINES_KEPT` truncated lines)."""
        for name in ("rows", "embedded", "null_rows", "truncated", "tokens", "batches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        room = max(0, TRUNCATED_LINES_KEPT - len(self.truncated_lines))
        self.truncated_lines.extend(other.truncated_lines[:room])

    def counts(self) -> dict[str, Any]:
        """The counts as a dict, without the truncated lines (what a manifest records)."""
        return {k: v for k, v in asdict(self).items() if k != "truncated_lines"}

    @classmethod
    def from_counts(cls, counts: dict[str, Any]) -> EmbedStats:
        """The stats of `counts`' dict (keys it does not know are ignored)."""
        return cls(**{k: v for k, v in counts.items() if k in cls.__dataclass_fields__})
