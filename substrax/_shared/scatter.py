"""The shape of the explicit step's reduce-scatters, shared by the step and the census.

On a TPU each device's block is written as whole ``(8, 128)`` tiles (16 rows for a 2-byte type,
32 for a 1-byte one), at most ``MAX_TILES_WIDE`` tiles wide: the blocks the TPU compiler
(libtpu 0.0.52) emits as a reduce-scatter (census guide, "On a TPU"). Elsewhere one row.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["block_shape", "on_tpu", "rows_for", "scattered_elements", "tiled"]

LANES = 128  # a TPU tile's columns
ROW_BYTES = 32  # a TPU tile's rows hold 8 four-byte elements, 16 two-byte ones, 32 one-byte ones
# widths of more tiles the TPU compiler refuses for some counts ("no feasible span count": 17, 19,
# 23, 25, 29, 31, 34, ... tiles of float32 over 256 chips); up to 16, every count compiled
MAX_TILES_WIDE = 16

_TILED: contextvars.ContextVar[bool] = contextvars.ContextVar("substrax_scatter_tiled", default=False)


def on_tpu(platform: str | None) -> bool:
    """Whether a step for ``platform`` writes its reduce-scatters in tiles (``block_shape``)."""
    return platform == "tpu"


@contextlib.contextmanager
def rows_for(platform: str | None) -> Iterator[None]:
    """Trace the explicit step's reduce-scatters for ``platform`` (``block_shape``)."""
    token = _TILED.set(on_tpu(platform))
    try:
        yield
    finally:
        _TILED.reset(token)


def tiled() -> bool:
    """Whether the step being traced writes its reduce-scatters in tiles (``rows_for``; no outside it)."""
    return _TILED.get()


def block_shape(elements: int, itemsize: int, tiles: bool) -> tuple[int, int]:
    """Rows and columns of each device's block of a reduce-scatter of ``elements`` per device
    in ``itemsize``-byte elements: ``(1, elements)``, or with ``tiles`` whole TPU tiles (padded)."""
    if not tiles:
        return 1, elements
    rows = max(8, ROW_BYTES // itemsize)
    wide = min(MAX_TILES_WIDE, max(1, -(-elements // (rows * LANES))))
    return rows * -(-elements // (rows * LANES * wide)), LANES * wide


def scattered_elements(elements: int, n: int, itemsize: int = 4, tiles: bool = False) -> int:
    """Elements a reduce-scatter of ``elements`` moves over ``n`` devices as the step writes it
    (``block_shape`` of each device's ``ceil(elements / n)``)."""
    rows, columns = block_shape(-(-elements // n), itemsize, tiles)
    return n * rows * columns
