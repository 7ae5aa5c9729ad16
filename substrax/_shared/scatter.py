"""The shape of the explicit step's grouped reduce-scatters, shared by the step and the census."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["SCATTER_ROWS", "rows_for", "scatter_rows", "scattered_elements"]

SCATTER_ROWS = 8  # rows of each device's block in a grouped reduce-scatter on a TPU (a sublane tile)

_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("substrax_scatter_rows", default=1)


def rows_of(platform: str | None) -> int:
    """Rows per device a grouped reduce-scatter is written in for ``platform``: the TPU compiler
    turns one row, or a flat buffer, into an all-reduce of the whole (census guide, "On a TPU");
    elsewhere one row, the program the plan's XLA:CPU estimate models."""
    return SCATTER_ROWS if platform == "tpu" else 1


@contextlib.contextmanager
def rows_for(platform: str | None) -> Iterator[None]:
    """Trace the explicit step's grouped reduce-scatters for ``platform`` (``rows_of``)."""
    token = _ROWS.set(rows_of(platform))
    try:
        yield
    finally:
        _ROWS.reset(token)


def scatter_rows() -> int:
    """The rows per device of the step being traced (``rows_for``; one outside it)."""
    return _ROWS.get()


def scattered_elements(elements: int, n: int, rows: int = 1) -> int:
    """Elements a grouped reduce-scatter of ``elements`` moves over ``n`` devices, ``rows`` rows a
    device: each device's block padded to a multiple of ``rows`` (``substrax.explicit._units``)."""
    block = -(-elements // n)
    return n * -(-block // rows) * rows
