"""The step's expected collectives (``expected_step``'s items), read against its trace: the
optional gathers a unit's trace runs, one run's bytes, the bytes per kind and axes."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from substrax._base import scopes
from substrax._base.jaxprs import equations

__all__ = ["gathered", "one_run", "recomputes", "required", "traced_gathers"]


def required(
    items: Sequence[Any], microbatches: int, data_axis: str
) -> tuple[dict[tuple[str, str], int], int]:
    """The bytes per step of the required ``items`` per (kind, axes), and those of the optional ones;
    ``data_axis``: the axes an item naming none is counted under."""
    by_kind: dict[tuple[str, str], int] = {}
    optional = 0
    for item in items:
        size = item.bytes * (microbatches if item.per_run and item.in_loop else 1)
        if item.optional:
            optional += size
            continue
        key = (item.kind, ",".join(item.axes) or data_axis)
        by_kind[key] = by_kind.get(key, 0) + size
    return by_kind, optional


def gathered(items: Sequence[Any], layout: str, one_at_a_time: bool) -> int:
    """The parameters' bytes one device holds gathered at once: under FSDP and HSDP, each unit's
    in turn (``one_at_a_time``: units in explicit mode), else all that ``items`` gather."""
    if layout not in ("fsdp", "hsdp"):
        return 0
    gathers = [one_run(i) for i in items if i.kind == "all-gather" and i.category == "parameters"]
    return max(gathers, default=0) if one_at_a_time else sum(gathers)


def one_run(item: Any) -> int:
    """One run's bytes of a gather: its buffer's (a unit's, once per microbatch and layer)."""
    found = re.fullmatch(r"([a-z]+)(\d+)\[([\d,]*)\]", item.buffer)
    if not item.in_loop or found is None:
        return item.bytes
    bits = int(found.group(2))
    return math.prod(int(d) for d in found.group(3).split(",") if d) * bits // 8


def recomputes(jaxpr: Any) -> bool:
    """Whether the traced step recomputes under remat (``nnx.remat``, ``jax.checkpoint``), as
    ``check_communication`` reads it from the compiled program's op names."""
    return any("rematted_computation" in str(e.source_info.name_stack) for e, _ in equations(jaxpr))


def traced_gathers(items: Sequence[Any], jaxpr: Any) -> tuple[Any, ...]:
    """``items`` with a unit's optional all-gathers (its backward gather, its forward gathered again
    under remat) required where the trace runs them: per buffer shape, the runs of the unit's
    all-gathers (``substrax.unit``) in the trace, code no result reads dropped (as XLA drops a
    first unit's backward gather), beyond those of the required buffers."""
    try:  # jax's own dead-code elimination, through scans and shard_map
        from jax._src.interpreters.partial_eval import dce_jaxpr

        jaxpr, _ = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    except Exception:  # noqa: BLE001  (another jax: the optional gathers stay optional)
        return tuple(items)
    runs: dict[tuple[int, ...], int] = {}
    for e, n in equations(jaxpr):
        if e.primitive.name == "all_gather" and scopes.UNIT in str(e.source_info.name_stack):
            shape = tuple(e.outvars[0].aval.shape)
            runs[shape] = runs.get(shape, 0) + n
    gathers = [i for i in items if i.kind == "all-gather" and i.scopes == (scopes.UNIT,) and _shape(i.buffer)]
    for i in gathers:
        if not i.optional:
            runs[_shape(i.buffer)] = runs.get(_shape(i.buffer), 0) - i.bytes // max(1, one_run(i))
    required = set()
    order = sorted((i for i in gathers if i.optional), key=lambda i: i.what.endswith("recomputed"))
    for i in order:  # the backward gathers first, then the recomputed forward ones
        own = i.bytes // max(1, one_run(i))
        if runs.get(_shape(i.buffer), 0) >= own:
            runs[_shape(i.buffer)] -= own
            required.add(id(i))
    return tuple(dataclasses.replace(i, optional=False, why="") if id(i) in required else i for i in items)


def _shape(buffer: str) -> tuple[int, ...] | None:
    found = re.fullmatch(r"[a-z]+\d+\[([\d,]*)\]", buffer)
    return None if found is None else tuple(int(d) for d in found.group(1).split(",") if d)
