"""The shape of the explicit step's grouped reduce-scatters, shared by the step and the census."""

from __future__ import annotations

__all__ = ["SCATTER_ROWS", "scattered_elements"]

SCATTER_ROWS = 8  # rows of each device's block in a grouped reduce-scatter (a TPU sublane tile)


def scattered_elements(elements: int, n: int) -> int:
    """Elements a grouped reduce-scatter of ``elements`` moves over ``n`` devices: each device's
    block padded to a multiple of ``SCATTER_ROWS`` (``substrax.explicit._units``)."""
    block = -(-elements // n)
    return n * -(-block // SCATTER_ROWS) * SCATTER_ROWS
