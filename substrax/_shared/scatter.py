"""The shape of the explicit step's reduce-scatters, shared by the step and the census.

On a TPU each device's block is written as whole ``(8, 128)`` tiles (16 rows for a 2-byte type,
32 for a 1-byte one), padded: up to ``MAX_TILES`` tiles in one row of tiles, more as rows of
``TILES_WIDE`` tiles, a multiple of 8 in all: the blocks the TPU compiler (libtpu 0.0.52) emits as
a reduce-scatter (census guide, "On a TPU"). Elsewhere one row.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax

__all__ = ["block_shape", "on_tpu", "platform_of", "rows_for", "scattered_elements", "tiled"]

LANES = 128  # a TPU tile's columns
ROW_BYTES = 32  # a TPU tile's rows hold 8 four-byte elements, 16 two-byte ones, 32 one-byte ones
# measured over 256 chips: every block of 1 to 16 tiles, and of any multiple of 8, compiled; of 17,
# 19, 23, 25, 29, 31, 34, 37, 38, 41, 43, 46 and 47 tiles the TPU compiler refused ("no feasible span count")
MAX_TILES = 16
TILES_WIDE = 8

_TILED: contextvars.ContextVar[bool] = contextvars.ContextVar("substrax_scatter_tiled", default=False)


def on_tpu(platform: str | None) -> bool:
    """Whether a step for ``platform`` writes its reduce-scatters in tiles (``block_shape``)."""
    return platform == "tpu"


def platform_of(mesh: Any) -> str | None:
    """The platform of ``mesh``'s devices (of an abstract mesh's, inside ``jax.jit``), or None."""
    if isinstance(mesh, jax.sharding.Mesh):
        return str(mesh.devices.flat[0].platform) if mesh.devices.size else None
    return getattr(getattr(mesh, "abstract_device", None), "platform", None)


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
    count = max(1, -(-elements // (rows * LANES)))
    if count <= MAX_TILES:
        return rows, LANES * count
    return rows * -(-count // TILES_WIDE), LANES * TILES_WIDE


def scattered_elements(elements: int, n: int, itemsize: int = 4, tiles: bool = False) -> int:
    """Elements a reduce-scatter of ``elements`` moves over ``n`` devices as the step writes it
    (``block_shape`` of each device's ``ceil(elements / n)``)."""
    rows, columns = block_shape(-(-elements // n), itemsize, tiles)
    return n * rows * columns
