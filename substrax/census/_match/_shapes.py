"""Expected buffers' shapes (their text, ``"f32[2,64]"``) against compiled ones."""

from __future__ import annotations

import re
from collections.abc import Sequence

from substrax.census._expected import ExpectedCollective
from substrax.census._hlo import Operand
from substrax.census._rows import Part

__all__ = ["dims", "same_shape", "shape_distance", "shapes_of"]


def dims(buffer: str) -> tuple[int, ...]:
    """The dimensions an expected buffer's text names (``"f32[2,64]"`` -> ``(2, 64)``), ``()`` if none."""
    inside = buffer.partition("[")[2].rstrip("]")
    return tuple(int(d) for d in inside.split(",") if d.strip().isdigit()) if "[" in buffer else ()


def same_shape(buffer: str, compiled: Operand, layer: bool = False) -> bool:
    """``compiled`` holds ``buffer``'s elements in some order (size-1 dimensions aside); with ``layer``,
    one layer of it: the shape without its leading (layer) dimension."""
    named = dims(buffer)[1:] if layer else dims(buffer)
    return sorted(d for d in named if d != 1) == sorted(d for d in compiled.shape if d != 1)


def shape_distance(buffer: str, compiled: Operand) -> int:
    """How far a compiled buffer is from ``buffer``: 0 same, 1 reordered, 2 but unit dims, 3 other."""
    if buffer == str(compiled):
        return 0
    named = [int(d) for d in re.findall(r"\d+", buffer.partition("[")[2])] if "[" in buffer else None
    if named is None:
        return 3
    if sorted(named) == sorted(compiled.shape):
        return 1
    return 2 if sorted(d for d in named if d != 1) == sorted(d for d in compiled.shape if d != 1) else 3


def shapes_of(items: Sequence[ExpectedCollective], mode: str, part: Part) -> list[str]:
    """The parameters (implicit mode) whose gradient or gathered value has ``part``'s shape, whole or
    one layer of a stack: what its shape says it may be (several when parameters share a shape)."""
    if mode != "implicit" or sum(d > 1 for d in part.buffer.shape) < 2:
        return []  # a vector's shape says nothing: a norm's scale and a statistic share it
    names = []
    for item in items:
        if item.category not in ("gradients", "parameters") or not dims(item.buffer):
            continue
        if same_shape(item.buffer, part.buffer):
            names.append(item.what)
        elif len(dims(item.buffer)) >= 2 and same_shape(item.buffer, part.buffer, layer=True):
            names.append(f"one layer of {item.what}")
    return list(dict.fromkeys(names))
