"""The shape of the explicit step's reduce-scatters, shared by the step and the census.

On a TPU each device's block is written as whole ``(8, 128)`` tiles (16 rows for a 2-byte type,
32 for a 1-byte one), padded: up to ``MAX_TILES`` tiles in one row of tiles, more as rows of
``TILES_WIDE`` tiles, their number rounded up (``tile_rows``) to one the TPU compiler (libtpu
0.0.52) emits as a reduce-scatter on every v5e topology measured (census guide, "On a TPU").
Elsewhere one row. A slice summed across replicas goes as the same block (``to_tiles``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "WIDE",
    "block_of",
    "block_shape",
    "from_tiles",
    "on_tpu",
    "platform_of",
    "rows_for",
    "scatter_rows",
    "scattered_elements",
    "tile_rows",
    "tiled",
    "to_tiles",
]

LANES = 128  # a TPU tile's columns
ROW_BYTES = 32  # a TPU tile's rows hold 8 four-byte elements, 16 two-byte ones, 32 one-byte ones
# measured over 256 chips: every block of 1 to 16 tiles, and of any multiple of 8, compiled; of 17,
# 19, 23, 25, 29, 31, 34, 37, 38, 41, 43, 46 and 47 tiles the TPU compiler refused ("no feasible span count")
MAX_TILES = 16
TILES_WIDE = 8
# the rows of tiles a block of TILES_WIDE columns may have as they are; more are rounded up to 5
# significant bits (under 128, at least even), then 6: measured on v5e 2x4, 4x4, 4x8, 8x8, 8x16 and 16x16
# (1 to 64 rows, m * 2**k for m of 32 to 63 up to each one's memory), the compiler refused ("no feasible
# span count") 673 rows on 2x4 (the 1.1B model's unit), 191 on 4x4, 101 on 4x8, 59 and 2 x 59 on 8x8,
# 29 on 8x16; each rounded count compiled on all six
ROWS_AS_THEY_ARE = 16
WIDE = LANES * TILES_WIDE  # the columns of a block of more than MAX_TILES tiles

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
    return rows * tile_rows(-(-count // TILES_WIDE)), LANES * TILES_WIDE


def block_of(elements: Sequence[int], itemsize: int, tiles: bool) -> tuple[int, int]:
    """Rows and columns of each device's block of one reduce-scatter of several buffers, ``elements``
    each per device: ``block_shape`` of them all; of more than ``MAX_TILES`` tiles each buffer from
    the start of a row of ``WIDE`` (the step's form, ``explicit._units``), the rows rounded as there."""
    rows, columns = block_shape(sum(elements), itemsize, tiles)
    if columns != WIDE or len(elements) == 1:
        return rows, columns
    tile = max(8, ROW_BYTES // itemsize)
    lines = sum(-(-k // WIDE) for k in elements)
    return tile * tile_rows(-(-lines // tile)), WIDE


def tile_rows(count: int) -> int:
    """``count`` rows of tiles rounded up to a number the TPU compiler emits on every v5e topology
    measured (``ROWS_AS_THEY_ARE``): as it is to 16; then 5 significant bits and even; 6 from 128."""
    if count <= ROWS_AS_THEY_ARE:
        return count
    step = 1 << max(1, count.bit_length() - (5 if count < 128 else 6))
    return -(-count // step) * step


def scattered_elements(elements: int, n: int, itemsize: int = 4, tiles: bool = False) -> int:
    """Elements a reduce-scatter of ``elements`` moves over ``n`` devices as the step writes it
    (``block_shape`` of each device's ``ceil(elements / n)``)."""
    rows, columns = block_shape(-(-elements // n), itemsize, tiles)
    return n * rows * columns


def to_tiles(x: jax.Array) -> jax.Array:
    """``x`` flattened into its block of whole TPU tiles (``block_shape``), zero-padded."""
    rows, columns = block_shape(x.size, x.dtype.itemsize, True)
    return jnp.pad(jnp.ravel(x), (0, rows * columns - x.size)).reshape(rows, columns)


def from_tiles(block: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The array of ``shape`` that ``to_tiles`` put in ``block``."""
    size = 1
    for d in shape:
        size *= d
    return jnp.ravel(block)[:size].reshape(shape)


def scatter_rows(rows: list[jax.Array], axis: str, scope: str) -> list[jax.Array]:
    """One ``psum_scatter`` of ``rows`` (each ``(n, k)``): this device's summed row of each ``(k,)``.

    On a TPU each device's rows go as a block of whole tiles, padded to them
    (``block_of``): the TPU compiler (libtpu 0.0.52) reduces a
    one-row block, a flat one or one across a tile's lanes whole (census guide, "On a TPU").
    """
    n, sizes = rows[0].shape[0], [r.shape[1] for r in rows]
    lines, columns = block_of(sizes, rows[0].dtype.itemsize, tiled())
    if lines == 1:
        with jax.named_scope(scope):
            flat = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), axis, scatter_dimension=0, tiled=False)
        return _cut(flat, sizes, sizes)
    if columns == WIDE:  # each from the start of a row: concatenated along the lanes instead, the
        # compiler's time grows with their size (27 s of a 1.1B model's unit's 30; this under 2 s)
        widths = [WIDE * -(-k // WIDE) for k in sizes]
        pieces = [_padded(r, w).reshape(n, w // WIDE, WIDE) for r, w in zip(rows, widths, strict=True)]
        buffer = jnp.concatenate(pieces, axis=1)
        buffer = jnp.pad(buffer, ((0, 0), (0, lines - buffer.shape[1]), (0, 0)))
    else:  # one row of tiles
        widths = sizes
        buffer = _padded(jnp.concatenate(rows, axis=1), lines * columns).reshape(n, lines, columns)
    with jax.named_scope(scope):  # (n, lines, columns): as (n * lines, columns) it compiles slowly too
        block = jax.lax.psum_scatter(buffer, axis, scatter_dimension=0, tiled=False)
    return _cut(block.reshape(-1), sizes, widths)


def _padded(rows: jax.Array, width: int) -> jax.Array:
    """``rows`` ``(n, k)`` zero-padded to ``(n, width)``."""
    return jnp.pad(rows, ((0, 0), (0, width - rows.shape[1])))


def _cut(flat: jax.Array, sizes: list[int], widths: list[int]) -> list[jax.Array]:
    """The rows of ``sizes`` elements that start ``widths`` apart in ``flat``."""
    out, at = [], 0
    for k, w in zip(sizes, widths, strict=True):
        out.append(flat[at : at + k])
        at += w
    return out
