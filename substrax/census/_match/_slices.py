"""All-reduces across TPU slices: the send/recv pairs (and in-slice collectives) that carry them.

The TPU compiler compiles one slice's program; an all-reduce whose groups span the slices runs as a
send/recv pair the TPU runtime reduces across them (``Collective.crosses``), fed by an all-reduce
over the slice's own chips where the groups span those too, or by a reduce-scatter over them with
an all-gather of what comes back (census guide, "Across slices"). Each such pair is a *crossing*;
the expected all-reduces over the same axes are packed into the crossings, each crossing used
carrying exactly its bytes (those its buffer held before the compiler padded it to whole tiles,
``Collective.unpadded``), so that a buffer dropped or reduced twice is still a difference; a buffer of
one row of lanes whose padding nothing records carries up to its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from substrax.census._hlo import arrays
from substrax.census._rows import Part
from substrax.census._text import shorten

Assignment = Any  # _assign.Assignment (which imports this module): parts, items, assigned, taken, notes
__all__ = ["across_slices"]

_BUDGET = 1 << 16
_LANES = 128  # a TPU tile's columns  # placements tried per group of axes: a bound on the search's time


@dataclass(frozen=True)
class _Crossing:
    """One send/recv pair across slices with what feeds it over the slice: ``parts`` (indices into
    the assignment's parts; ``send`` among them), the mesh ``axes`` the all-reduce spans, the
    ``bytes`` it reduces."""

    send: int
    parts: tuple[int, ...]
    axes: frozenset[str]
    bytes: int
    slack: bool = False  # one row of lanes, padded where no ZeroCrop says from what: holds up to ``bytes``


def across_slices(a: Assignment) -> None:
    """Pack the expected all-reduces over a cross-slice axis into the crossings over those axes."""
    crossings = _crossings(a)
    if not crossings:
        return
    cross = {x for c in crossings for x in a.parts[c.send].row.axes or ()}
    groups: dict[frozenset[str], list[int]] = {}
    for i, item in enumerate(a.items):
        if i not in a.assigned and item.kind == "all-reduce" and cross & set(item.axes):
            groups.setdefault(frozenset(item.axes), []).append(i)
    for axes, items in sorted(groups.items(), key=lambda g: -len(g[0])):  # the fed ones first
        free = [c for c in crossings if c.axes == axes and not a.taken & set(c.parts)]
        mine = list({c.send: c for c in reversed(free)}.values())  # one way per send
        placed = _pack([a.items[i].bytes for i in items], [a.items[i].optional for i in items],
                       [c.bytes for c in mine], [c.slack for c in mine])  # fmt: skip
        if placed is None:
            a.notes.append(_refused(a, items, mine))
            continue
        for i, k in zip(items, placed, strict=True):
            if k is not None:
                a.assigned[i] = list(mine[k].parts)
        a.taken.update(j for k in placed if k is not None for j in mine[k].parts)
        a.notes.append(_note(a, items, placed, mine))


def _crossings(a: Assignment) -> list[_Crossing]:
    """Every send of an all-reduce across slices with its recv, alone and with what feeds it."""
    named: dict[str, list[int]] = {}  # a row's name -> its parts with bytes
    for j, p in enumerate(a.parts):
        if p.bytes > 0:
            named.setdefault(p.row.name, []).append(j)
    one = {name: js[0] for name, js in named.items() if len(js) == 1}
    recvs = {a.parts[j].row.rendezvous: j for j in one.values() if a.parts[j].kind == "recv"}
    gathered = {a.parts[j].row.fed_by: j for j in one.values() if a.parts[j].kind == "all-gather"}
    out = []
    for j in one.values():
        send = a.parts[j]
        if send.kind != "send" or send.row.crosses != "all-reduce" or send.row.rendezvous not in recvs:
            continue
        recv = recvs[send.row.rendezvous]
        axes = frozenset(send.row.axes or ())
        out.append(_Crossing(j, (j, recv), axes, *_held(send)))
        back = gathered.get(a.parts[recv].row.name)
        for f in named.get(send.row.fed_by, ()):
            fed = a.parts[f]
            over = axes | set(fed.row.axes or ())
            if fed.row.axes is None or over == axes:
                continue
            if fed.kind == "all-reduce" and fed.bytes == send.bytes:
                out.append(_Crossing(j, (f, j, recv), over, *_held(fed)))
            elif fed.kind == "reduce-scatter" and back is not None and a.parts[back].bytes == fed.bytes:
                out.append(_Crossing(j, (f, j, recv, back), over, fed.bytes))
    return out


def _held(part: Part) -> tuple[int, bool]:
    """What a buffer of a crossing holds: its bytes before the compiler padded it to whole tiles, and
    whether that is at most its bytes instead: a buffer of one row of lanes (``f32[1,1,128]``) whose
    padding nothing records (a scalar loss summed across slices alone, measured on two v5e 16x16)."""
    if part.row.unpadded is not None and len(part.row.parts) == 1:
        return part.row.unpadded, False
    held = arrays(str(part.buffer))
    return part.bytes, len(held) == 1 and math.prod(held[0].shape) <= _LANES


def _pack(
    sizes: Sequence[int], optional: Sequence[bool], bins: Sequence[int], slack: Sequence[bool]
) -> list[int | None] | None:
    """Each item's bin (``None``: an optional item left out), each bin holding no items or items of
    exactly its bytes (a ``slack`` bin: up to them); ``None`` when there is none (or none found
    within ``_BUDGET`` tries)."""
    order = sorted(range(len(sizes)), key=lambda i: (optional[i], -sizes[i]))
    fill, where, budget = [0] * len(bins), [None] * len(sizes), [_BUDGET]
    required = [sum(sizes[i] for i in order[k:] if not optional[i]) for k in range(len(order) + 1)]

    def short() -> int:  # bytes the bins in use still lack (a slack bin: none once it holds any)
        return sum(b - f for b, f, loose in zip(bins, fill, slack, strict=True) if f and not loose)

    def place(k: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return False
        if k == len(order):
            return short() == 0
        if short() > required[k] + sum(sizes[i] for i in order[k:] if optional[i]):
            return False
        i = order[k]
        seen = set()
        for b in range(len(bins)):
            if fill[b] + sizes[i] <= bins[b] and (bins[b], fill[b]) not in seen:
                seen.add((bins[b], fill[b]))
                fill[b], where[i] = fill[b] + sizes[i], b
                if place(k + 1):
                    return True
                fill[b], where[i] = fill[b] - sizes[i], None
        return optional[i] and place(k + 1)

    if len(order) > 500 or not place(0):
        return None
    return list(where)


def _note(a: Assignment, items: list[int], placed: list[int | None], mine: list[_Crossing]) -> str:
    """What crossed the slices, in which buffers, and the padding."""
    used = sorted({k for k in placed if k is not None})
    carried = sum(a.items[i].bytes for i, k in zip(items, placed, strict=True) if k is not None)
    whats = shorten([a.items[i].what for i, k in zip(items, placed, strict=True) if k is not None], 4)
    how = "; ".join(_text(a, mine[k]) for k in used[:4]) + (
        f"; +{len(used) - 4} more" if len(used) > 4 else ""
    )
    moved = sum(a.parts[mine[k].send].bytes for k in used)
    pad = f", padded to whole tiles ({moved:,} B sent)" if moved > carried else ""
    return (
        f"all-reduced across slices over {', '.join(a.items[items[0]].axes)} ({whats}: {carried:,} B) as "
        f"{len(used)} send/recv pair(s) the TPU runtime reduces between slices{pad}: {how}"
    )


def _text(a: Assignment, crossing: _Crossing) -> str:
    parts: list[Part] = [a.parts[j] for j in crossing.parts]
    return " + ".join(f"{p.kind} {p.row.name} ({p.bytes:,} B{_axes(p)})" for p in parts)


def _axes(part: Part) -> str:
    return f" over {','.join(part.row.axes)}" if part.row.axes else ""


def _refused(a: Assignment, items: list[int], mine: list[_Crossing]) -> str:
    want = sum(a.items[i].bytes for i in items if not a.items[i].optional)
    got = sum(c.bytes for c in mine)
    return (
        f"across slices over {', '.join(a.items[items[0]].axes)}: the {len(mine)} send/recv pair(s) reducing "
        f"there ({got:,} B) do not carry the {len(items)} all-reduce(s) expected there ({want:,} B): "
        f"no set of them fills each pair exactly"
    )
