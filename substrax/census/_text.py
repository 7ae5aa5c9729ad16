"""Text helpers of the census's ``str()``: an aligned table, a list cut short."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["shorten", "table"]


def table(rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """``rows`` as aligned lines, indented by two spaces; the columns in ``right`` aligned right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    ]


def shorten(items: Sequence[str], keep: int) -> str:
    """The first ``keep`` items joined by commas, then how many more."""
    shown = ", ".join(items[:keep])
    return shown + (f", +{len(items) - keep} more" if len(items) > keep else "")
