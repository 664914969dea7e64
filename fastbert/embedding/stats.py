"""The counts of an embedding run (or of one `fastbert.embedding.Embedder.embed` call)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

TRUNCATED_LINES_KEPT = 10  # line numbers of truncated texts kept for the warning; the count covers all of them
INVISIBLE_LINES_KEPT = 10  # likewise for the texts of only invisible characters, for the note


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
    # null rows whose text was more than whitespace: only invisible characters, or nothing the tokenizer keeps
    invisible: int = 0
    invisible_lines: list[int] = field(default_factory=list)  # the first few, for the note

    def add(self, other: EmbedStats) -> None:
        """Add ``other``'s counts to these (keeping the first `TRUNCATED_LINES_KEPT` truncated lines and the first
        `INVISIBLE_LINES_KEPT` invisible ones)."""
        for name in ("rows", "embedded", "null_rows", "truncated", "tokens", "batches", "invisible"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        room = max(0, TRUNCATED_LINES_KEPT - len(self.truncated_lines))
        self.truncated_lines.extend(other.truncated_lines[:room])
        room = max(0, INVISIBLE_LINES_KEPT - len(self.invisible_lines))
        self.invisible_lines.extend(other.invisible_lines[:room])

    def copy(self) -> EmbedStats:
        """An independent copy (a run adds to its own total, never to the counts it started from)."""
        return dataclasses.replace(self, truncated_lines=list(self.truncated_lines),
                                   invisible_lines=list(self.invisible_lines))

    def counts(self) -> dict[str, Any]:
        """The counts and the kept truncated lines as a dict (what a manifest records: a resumed run's warning
        still names the lines of the earlier part)."""
        return asdict(self)

    @classmethod
    def from_counts(cls, counts: dict[str, Any]) -> EmbedStats:
        """The stats of `counts`' dict (keys it does not know are ignored)."""
        return cls(**{k: v for k, v in counts.items() if k in cls.__dataclass_fields__})


def truncation_note(stats: EmbedStats) -> str:
    """The truncated texts' line numbers for the warning: all of them, or the kept ones and how many more there
    are (a manifest of an older fastbert recorded none)."""
    listed = stats.truncated_lines[:stats.truncated]
    if not listed:
        return "their lines were not recorded"
    return lines_note(listed, stats.truncated)


def lines_note(listed: list[int], count: int) -> str:
    """'lines 3, 9' or 'lines 1, ..., 10 and 5 more': ``listed``, the first of ``count`` lines."""
    omitted = count - len(listed)
    return "lines " + ", ".join(str(n) for n in listed) + (f" and {omitted:,} more" if omitted > 0 else "")


def invisible_rows_note(stats: EmbedStats) -> str:
    """The note on the null rows whose texts were more than whitespace yet blank (empty when there were none)."""
    if not stats.invisible:
        return ""
    one = stats.invisible == 1
    listed = stats.invisible_lines[:stats.invisible]
    where = lines_note(listed, stats.invisible).replace("lines", "line" if one else "lines", 1) if listed else \
        "their lines were not recorded"
    return (f"{stats.invisible:,} text{'' if one else 's'} ({where}) held only invisible characters (zero-width, "
            f"format or control characters) or nothing the tokenizer keeps: {'it is' if one else 'they are'} blank, "
            f"{'a null row' if one else 'null rows'} as an empty line gives (--on-blank error stops at them)")
