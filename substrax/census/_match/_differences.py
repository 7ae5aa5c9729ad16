"""What an assignment leaves apart, as the differences (and the bound's note) ``compare`` reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from substrax.census._expected import Expected, ExpectedCollective
from substrax.census._match._assign import Assignment
from substrax.census._match._kinds import kind_key, ordered_keys
from substrax.census._rows import Collective, Part, buffers_text
from substrax.census._text import short_op, shorten

__all__ = ["bound_applies", "bound_note", "kind_differences", "loop_differences", "rewrite_differences"]

_LISTED = 4  # buffers a difference names one by one (the rest: Comparison.unexpected, .matched)


def loop_differences(a: Assignment) -> list[str]:
    """Each loop that runs a buffer the step expects once per step (matched or not), and each
    loop whose trip count the program does not show (its bytes per step unknown)."""
    rows: list[Collective] = []
    for i, js in a.assigned.items():
        for j in js:
            row = a.parts[j].row
            if row.in_loop and (not a.items[i].in_loop or row.executions is None) and row not in rows:
                rows.append(row)
    rows += [a.parts[j].row for j in a.unexpected if a.parts[j].row.in_loop and a.parts[j].row not in rows]
    carried: dict[int, list[str]] = {}
    for i, js in a.assigned.items():
        for j in js:
            carried.setdefault(id(a.parts[j].row), []).append(a.items[i].what)
    ordered = sorted(rows, key=a.rows.index)
    return [_loop_difference(row, a.expected, carried.get(id(row), [])) for row in ordered]


def rewrite_differences(a: Assignment) -> list[str]:
    """Each reduce-scatter or all-gather compiled as an all-reduce, and what that costs."""
    out = []
    for i, j in a.rewrites:
        item, part = a.items[i], a.parts[j]
        n = len(part.row.groups[0]) if part.row.groups else 0
        held = f"{item.bytes // n:,} B" if n else "a slice"
        more = f"{item.bytes - item.bytes // n:,} B" if n else "the rest"
        what = (
            "sums the whole gradient and keeps it"
            if item.kind == "reduce-scatter"
            else ("sums a zero-padded copy of the whole parameter")
        )
        out.append(
            f"{item.kind} compiled as an all-reduce: {item.what} ({item.bytes:,} B) runs as "
            f"{part.buffer} of all-reduce {part.row.name}, the compiler's rewrite of the step's {item.kind}: "
            f"each device {what} ({item.bytes:,} B where the {item.kind} holds {held}: {more} more "
            f"memory per device), and an all-reduce moves about twice the {item.kind}'s bytes over the links"
        )
    return out


def kind_differences(a: Assignment) -> list[str]:
    """Per kind: buffers nothing expected accounts for, and expected ones not compiled."""
    mode = a.mode
    keys = ordered_keys({kind_key(i.kind, mode) for i in a.items} | {kind_key(p.kind, mode) for p in a.parts})
    model = {id(a.parts[j]) for j in a.model}
    out = []
    for key in keys:
        items = [i for i in a.items if kind_key(i.kind, mode) == key]
        want = sum(i.bytes for i in items if not i.optional)
        got = sum(p.bytes_per_step for p in a.parts if kind_key(p.kind, mode) == key and id(p) not in model)
        out += _extra(a, key, items, want, got) + _missing(a, key, want, got)
    return out


def _extra(a: Assignment, key: str, items: list[ExpectedCollective], want: int, got: int) -> list[str]:
    """The buffers of kind ``key`` that nothing expected accounts for, as one difference (or none)."""
    extra = [a.parts[j] for j in a.unexpected if kind_key(a.parts[j].kind, a.mode) == key]
    if extra and not items:
        return [
            f"unexpected {key}: {sum(p.bytes_per_step for p in extra):,} B per step that the "
            f"{a.expected.layout} layout does not call for: " + _listed(extra) + _undeclared(a, extra)
        ]
    if not extra:
        return []
    surplus = sum(p.bytes_per_step for p in extra)
    shaped = [name for p in extra for name in a.shapes_of(p)]
    counts = (
        f"compiled {got:,} B per step, expected {want:,} B ({surplus:,} B more)"
        if got - want == surplus
        else f"{surplus:,} B per step beyond the buffers matched (compiled {got:,} B per step "
        f"in all, expected {want:,} B)"
    )
    return [
        f"extra {key}: {counts}; "
        + (_twice(surplus, items) if a.mode != "implicit" else _again(shaped))
        + "nothing expected accounts for "
        + _listed([_described(a, p) for p in extra], extra)
        + _undeclared(a, extra)
    ]


def _missing(a: Assignment, key: str, want: int, got: int) -> list[str]:
    """The expected buffers of kind ``key`` not compiled, as one difference (or none)."""
    missing = [
        item
        for i, item in enumerate(a.items)
        if not item.optional and i not in a.assigned and kind_key(item.kind, a.mode) == key
    ]
    if not missing:
        return []
    named = _listed(missing)
    if not any(kind_key(p.kind, a.mode) == key for p in a.parts):
        return [f"missing {key}: expected {want:,} B per step, compiled none; not compiled: {named}"]
    if got < want:
        return [
            f"too little {key}: compiled {got:,} B per step, expected {want:,} B "
            f"({want - got:,} B short); not compiled: {named}"
        ]
    return [  # the bytes are there, but not in buffers of these parameters' shapes
        f"{key} not compiled as expected: {named} matched no compiled buffer "
        f"of its shape and bytes, though the step compiles {got:,} B of {key} per step "
        f"against {want:,} B expected"
    ]


def bound_applies(a: Assignment) -> bool:
    """Implicit mode over a sharded layout, communicating no more than expected in all."""
    sharded_implicit = a.mode == "implicit" and a.expected.layout != "replicated"
    got = sum(p.bytes_per_step for p in a.parts)
    want = sum(i.bytes for i in a.items)
    return sharded_implicit and got <= want


def bound_note(a: Assignment) -> str:
    """The note that accepts XLA's own collectives under the bound (``bound_applies``)."""
    mode = a.mode
    want: dict[str, int] = {}
    for i in a.items:
        want[kind_key(i.kind, mode)] = want.get(kind_key(i.kind, mode), 0) + i.bytes
    got: dict[str, int] = {}
    for p in a.parts:
        got[kind_key(p.kind, mode)] = got.get(kind_key(p.kind, mode), 0) + p.bytes_per_step
    keys = [k for k in ordered_keys({*want, *got}) if want.get(k, 0) != got.get(k, 0)]
    changes = ", ".join(f"{k} {want.get(k, 0):,} -> {got.get(k, 0):,} B" for k in keys)
    return (
        f"implicit mode: XLA chose its own collectives ({changes}); accepted because the step communicates "
        f"{sum(got.values()):,} B in all, no more than the {sum(want.values()):,} B expected"
    )


def _described(a: Assignment, part: Part) -> str:
    """A buffer, with the parameters whose shape it has (implicit mode), else as it is."""
    names = a.shapes_of(part)
    if not names:
        return str(part)
    which = " or ".join(names[:4]) + (f" or {len(names) - 4} more" if len(names) > 4 else "")
    return f"{part} (the shape of {which})"


def _undeclared(a: Assignment, extra: Sequence[Part]) -> str:
    """What to do about buffers over an axis whose collectives the layers declare."""
    axes = sorted({x for p in extra for x in (p.row.axes or ()) if x in a.declared_axes})
    if not axes:
        return ""
    return (
        f" (over {', '.join(map(repr, axes))} the model's layers declare their collectives and no layer "
        f"declared these; a layer of your own that communicates there declares its collectives with "
        f"substrax.nn.declare_forward and declare_backward)"
    )


def _loop_difference(row: Collective, expected: Expected, carried: Sequence[str] = ()) -> str:
    what = f", carrying {shorten(list(carried), 4)}," if carried else ""
    if row.trip_count is None:
        return (
            f"{row.kind} {row.name} ({_row_text(row)}){what} sits inside a while loop whose trip count "
            f"the program does not show: its bytes per step are not known (counted once)"
        )
    runs = f"{row.trip_count} times"
    return (
        f"{row.kind} {row.name} ({_row_text(row)}){what} sits inside a while loop and runs {runs} per step; "
        f"the {expected.layout} layout with {expected.microbatches} microbatch(es) expects every "
        f"collective of the step once per step, outside loops"
    )


def _listed(things: Sequence[Any], sized: Sequence[Any] | None = None) -> str:
    """The buffers, each named, up to ``_LISTED`` of them (then how many more, and their bytes);
    ``sized``: the buffers ``things`` describe, when ``things`` are their texts."""
    shown = "; ".join(map(str, things[:_LISTED]))
    rest = (things if sized is None else sized)[_LISTED:]
    if not rest:
        return shown
    size = sum(getattr(t, "bytes_per_step", getattr(t, "bytes", 0)) for t in rest)
    return f"{shown}; and {len(rest)} more ({size:,} B; Comparison.unexpected and .matched list them all)"


def _twice(surplus: int, items: list[ExpectedCollective]) -> str:
    leaves = [i for i in items if i.category == "gradients"]
    if leaves and surplus == sum(i.bytes for i in leaves):
        return "the surplus is every parameter's gradient once more (gradients reduced twice?); "
    same = [i.what for i in items if i.bytes == surplus]
    return f"the surplus is the size of {shorten(same, 3)} (reduced twice?); " if same else ""


def _again(shaped: list[str]) -> str:
    """What the shapes of the surplus buffers say (implicit mode): only what they say."""
    if not shaped:
        return ""
    names = list(dict.fromkeys(shaped))
    return f"the surplus has the shape of {shorten(names, 3)} (moved more than once?); "


def _row_text(row: Collective) -> str:
    where = f" from {short_op(row.op_name)}" if row.op_name else ""
    return f"{row.kind} {row.name} [{buffers_text(row)}, {row.bytes:,} B]{where}"
