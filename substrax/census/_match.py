"""The matching rule of ``compare``: compiled buffers against expected ones (census guide, "The rule")."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from substrax._base import scopes
from substrax.census._expected import REDUCTIONS, Expected, ExpectedCollective
from substrax.census._hlo import KINDS, Operand
from substrax.census._rows import Collective, Part, buffers_text
from substrax.census._text import short_op, shorten

__all__ = ["Match", "kind_key", "match", "ordered_keys"]

_REDUCTION_KEY = "all-reduce + reduce-scatter"


@dataclass(frozen=True)
class Match:
    """What ``match`` found; ``substrax.census.Comparison`` describes each field."""

    matches: bool
    differences: tuple[str, ...]
    notes: tuple[str, ...]
    expected: Expected
    matched: tuple[tuple[ExpectedCollective, tuple[Part, ...]], ...]
    model: tuple[Part, ...]
    unexpected: tuple[Part, ...]


def match(rows: Sequence[Collective], expected: Expected, *, attribute_model: bool = False) -> Match:
    """Match the buffers of ``rows`` (a census's, in program order) to ``expected``'s."""
    return _Matcher(rows, expected, attribute_model).result()


def kind_key(kind: str, mode: str) -> str:
    """The kind as compared: implicit mode takes all-reduce and reduce-scatter as one."""
    return _REDUCTION_KEY if mode == "implicit" and kind in REDUCTIONS else kind


def ordered_keys(keys: set[str]) -> list[str]:
    """Kinds as ``kind_key`` gives them, in the order of ``KINDS`` (the joined reductions first)."""
    order = [_REDUCTION_KEY, *KINDS]
    return sorted(keys, key=lambda k: order.index(k) if k in order else len(order))


_PHASE_ORDER = {
    "gradients": {"backward": 0, None: 1, "forward": 2},
    "loss": {"forward": 0, None: 1, "backward": 2},
    "metrics": {"forward": 0, None: 1, "backward": 2},
}
_OTHER_ORDER = {None: 0, "forward": 1, "backward": 2}
_SEARCH_LIMIT = 1 << 12  # partial sums kept while looking for a combined buffer
_SEARCH_BUDGET = 1 << 21  # partial sums tried in all, per comparison: a bound on its time
_PIECES = 4  # compiled buffers that may stand for expected ones combined or cut differently


class _Matcher:
    """The matching of ``compare``, step by step."""

    def __init__(self, rows: Sequence[Collective], expected: Expected, attribute_model: bool) -> None:
        self.rows, self.expected, self.mode = list(rows), expected, expected.mode
        self.parts = [p for row in rows for p in row.parts]
        self.items = [i for i in expected.items if i.bytes > 0]
        self.assigned: dict[int, list[int]] = {}  # item -> parts
        self.taken: set[int] = set()
        self.notes: list[str] = []
        self.budget = [_SEARCH_BUDGET]
        # over an axis the layers declare collectives on, every buffer must be one they declared
        self.declared_axes = {a for i in self.items if i.category == "model" for a in i.axes}
        self.layered: dict[int, int] = {}  # item -> layers: moved one layer per iteration of the stack's loop
        if self.mode == "implicit":
            self._per_layer()
        self._one_to_one()
        self._combined()
        self.rewrites = self._rewritten()
        left = [j for j in range(len(self.parts)) if j not in self.taken]
        self.model = [
            j
            for j in left
            if attribute_model and self._model_like(self.parts[j]) and not self._shaped_like(j)
        ]
        self.unexpected = [j for j in left if j not in self.model]

    def _fits(self, item: ExpectedCollective, part: Part) -> bool:
        return (
            kind_key(item.kind, self.mode) == kind_key(part.kind, self.mode)
            and (not item.scopes or part.scope in item.scopes)
            and (not item.axes or part.row.axes is None or tuple(part.row.axes) == item.axes)
            and (item.shift is None or part.row.axes is None or part.row.shift == item.shift)
        )

    def _shape_bound(self, item: ExpectedCollective) -> bool:
        """Implicit mode names a parameter only for a buffer of its shape (what the program says)."""
        bound = item.category in ("gradients", "parameters") and bool(_dims(item.buffer))
        return self.mode == "implicit" and bound

    def _per_layer(self) -> None:
        """A stacked parameter ``[L, ...]`` moved one layer per iteration of a loop of ``L``: XLA's
        choice for a stack applied by ``nnx.scan``; its bytes per step are the rule's."""
        for i in self._order():
            item = self.items[i]
            dims = _dims(item.buffer)
            if item.optional or not self._shape_bound(item) or len(dims) < 2 or dims[0] < 2:
                continue
            free = [
                j
                for j, p in enumerate(self.parts)
                if j not in self.taken
                and self._fits(item, p)
                and p.row.trip_counts[-1:] == (dims[0],)
                and p.bytes * dims[0] == item.bytes
                and _same_shape(item.buffer, p.buffer, layer=True)
            ]
            if free:
                j = min(free, key=lambda j: self._preference(item, j))
                self.assigned[i] = [j]
                self.taken.add(j)
                if self.parts[j].row.trip_counts == (dims[0],):  # the stack's loop alone: once per step
                    self.layered[i] = dims[0]
                    self.items[i] = replace(item, in_loop=True)

    def _preference(self, item: ExpectedCollective, j: int) -> tuple[int, int, bool, int]:
        part = self.parts[j]
        if item.phase is not None:
            phase = 0 if part.phase == item.phase else 1
        else:
            phase = _PHASE_ORDER.get(item.category, _OTHER_ORDER).get(part.phase, 3)
        return phase, _shape_distance(item.buffer, part.buffer), part.row.in_loop != item.in_loop, j

    def _order(self) -> list[int]:
        return sorted(
            range(len(self.items)),
            key=lambda i: (self.items[i].optional, not self.items[i].scopes, -self.items[i].bytes, i),
        )

    def _one_to_one(self) -> None:
        for i in self._order():
            item = self.items[i]
            free = [
                j
                for j, p in enumerate(self.parts)
                if j not in self.taken
                and self._same_bytes(item, p)
                and self._fits(item, p)
                and (not self._shape_bound(item) or _same_shape(item.buffer, p.buffer))
            ]
            if free:
                j = min(free, key=lambda j: self._preference(item, j))
                self.assigned[i] = [j]
                self.taken.add(j)
                if item.per_run:  # as often as the program's loops run it: its bytes per step
                    part = self.parts[j]
                    self.items[i] = replace(item, bytes=part.bytes_per_step, in_loop=part.row.in_loop)

    @staticmethod
    def _same_bytes(item: ExpectedCollective, part: Part) -> bool:
        if item.per_run:  # one run's bytes, in as many loops as it takes (inside the microbatch loop)
            return part.bytes == item.bytes and (part.row.in_loop or not item.in_loop)
        return (part.bytes_per_step if item.in_loop else part.bytes) == item.bytes

    def _combined(self) -> None:
        """Buffers XLA combined or cut: one kind and scope's unmatched ones against <= ``_PIECES``."""
        groups: dict[tuple[str, tuple[str | None, ...]], list[int]] = {}
        for i in self._order():
            item = self.items[i]
            if i not in self.assigned and not item.optional:
                groups.setdefault((kind_key(item.kind, self.mode), item.scopes), []).append(i)
        for left in groups.values():
            item = self.items[left[0]]
            free = [
                j
                for j, p in enumerate(self.parts)
                if j not in self.taken
                and self._fits(item, p)
                and (
                    not self._shape_bound(item)
                    or len(p.buffer.shape) <= 1
                    or any(_same_shape(self.items[i].buffer, p.buffer) for i in left)
                )
            ]
            total = sum(self.items[i].bytes for i in left)
            chosen = _subset_sum([self.parts[j].bytes for j in free], total, self.budget)
            if chosen is None or (len(chosen) == 1 and len(left) == 1):
                continue  # (one to one was tried)
            for i in left:
                self.assigned[i] = [free[k] for k in chosen]
            self.taken.update(free[k] for k in chosen)
            whats = shorten([self.items[i].what for i in left], 4)
            pieces = "; ".join(str(self.parts[free[k]]) for k in chosen)
            self.notes.append(f"{whats} ({total:,} B) compiled combined differently, as {pieces}")

    def _shapes_of(self, part: Part) -> list[str]:
        """The parameters (implicit mode) whose gradient or gathered value has ``part``'s shape, whole or
        one layer of a stack: what its shape says it may be (several when parameters share a shape)."""
        if self.mode != "implicit" or sum(d > 1 for d in part.buffer.shape) < 2:
            return []  # a vector's shape says nothing: a norm's scale and a statistic share it
        names = []
        for item in self.items:
            if item.category not in ("gradients", "parameters") or not _dims(item.buffer):
                continue
            if _same_shape(item.buffer, part.buffer):
                names.append(item.what)
            elif len(_dims(item.buffer)) >= 2 and _same_shape(item.buffer, part.buffer, layer=True):
                names.append(f"one layer of {item.what}")
        return list(dict.fromkeys(names))

    def _shaped_like(self, j: int) -> bool:
        """A buffer over the axis gradients were reduced on with a parameter's shape: not the model's."""
        part = self.parts[j]
        axes = {self.parts[k].row.axes for i, ks in self.assigned.items() for k in ks
                if self.items[i].category in ("gradients", "parameters")}  # fmt: skip
        return part.row.axes in axes and bool(self._shapes_of(part))

    def _rewritten(self) -> list[tuple[int, int]]:
        """An expected reduce-scatter or all-gather compiled as an all-reduce of its whole buffer.

        The TPU compiler's decomposers do this (census guide, "On a TPU"); each pairing is a
        difference that names the rewrite and what it costs.
        """
        pairs = []
        for i in self._order():
            item = self.items[i]
            if i in self.assigned or item.kind not in ("reduce-scatter", "all-gather"):
                continue
            free = [
                j
                for j, p in enumerate(self.parts)
                if j not in self.taken
                and p.kind == "all-reduce"
                and self._same_bytes(item, p)
                and (not item.axes or p.row.axes is None or tuple(p.row.axes) == item.axes)
                and not self._model_like(p)  # a layer's own all-reduce (BatchNorm's psum) is no rewrite
            ]
            if free:
                j = min(free, key=lambda j: (_shape_distance(item.buffer, self.parts[j].buffer), j))
                self.assigned[i] = [j]
                self.taken.add(j)
                pairs.append((i, j))
        return pairs

    def _rewrite_differences(self) -> list[str]:
        out = []
        for i, j in self.rewrites:
            item, part = self.items[i], self.parts[j]
            n = len(part.row.groups[0]) if part.row.groups else 0
            held = f"{item.bytes // n:,} B" if n else "a slice"
            more = f"{item.bytes - item.bytes // n:,} B" if n else "the rest"
            what = "sums the whole gradient and keeps it" if item.kind == "reduce-scatter" else (
                "sums a zero-padded copy of the whole parameter"
            )
            out.append(
                f"{item.kind} compiled as an all-reduce: {item.what} ({item.bytes:,} B) runs as "
                f"{part.buffer} of all-reduce {part.row.name}, the compiler's rewrite of the step's {item.kind}: "
                f"each device {what} ({item.bytes:,} B where the {item.kind} holds {held}: {more} more "
                f"memory per device), and an all-reduce moves about twice the {item.kind}'s bytes over the links"
            )
        return out

    def _model_like(self, part: Part) -> bool:
        """The model's own: under no library scope or a layer's, but not where layers declared."""
        if part.row.axes and self.declared_axes & set(part.row.axes):
            return False
        if part.scope == scopes.TENSOR_PARALLEL:
            return not self.declared_axes
        return part.scope is None and part.phase is not None

    def result(self) -> Match:
        expected, parts = self.expected, self.parts
        differences = self._loop_differences()
        loops = bool(differences)
        differences += self._rewrite_differences() + self._kind_differences()
        notes = list(self.notes) + self._layer_notes()
        for i, item in enumerate(self.items):
            if item.optional and i not in self.assigned:
                notes.append(f"not compiled, optional: {item}" + (f": {item.why}" if item.why else ""))
        if differences and not loops and self._bound_applies():
            notes.append(self._bound_note())
            differences = []
        model_items = [
            ExpectedCollective(
                parts[j].kind,
                f"model: {parts[j].op_name or parts[j].row.name}",
                parts[j].bytes_per_step,
                "model",
                buffer=str(parts[j].buffer),
            )
            for j in self.model
        ]
        matched = tuple(
            (item, tuple(parts[j] for j in self.assigned.get(i, ()))) for i, item in enumerate(self.items)
        )
        matched += tuple((m, (parts[j],)) for m, j in zip(model_items, self.model, strict=True))
        declared = [j for i, js in self.assigned.items() if self.items[i].category == "model" for j in js]
        return Match(
            matches=not differences,
            differences=tuple(differences),
            notes=tuple(notes),
            expected=expected.with_items(model_items) if model_items else expected,
            matched=matched,
            model=tuple(parts[j] for j in sorted({*declared, *self.model})),
            unexpected=tuple(parts[j] for j in self.unexpected),
        )

    def _layer_notes(self) -> list[str]:
        """What was matched one layer per iteration, and which matches the program leaves open."""
        notes = []
        for source, verb in (("gradients", "reduced"), ("parameters", "gathered")):
            layered = [i for i in self.layered if self.items[i].category == source]
            if not layered:
                continue
            loops = sorted({self.layered[i] for i in layered})
            names = shorten([self.items[i].what for i in layered], 4)
            notes.append(
                f"implicit mode: XLA {verb} {len(layered)} stacked parameter(s) one layer per iteration, "
                f"inside a loop of {' or '.join(map(str, loops))} (a scanned stack): {names}; each one "
                f"layer's buffer per iteration, its bytes per step the rule's: accepted"
            )
        shared: dict[tuple[int, ...], dict[str, None]] = {}  # parameters matched by a shape they share
        kinds: dict[tuple[int, ...], dict[str, None]] = {}
        for i, js in self.assigned.items():
            item = self.items[i]
            if self._shape_bound(item) and len(js) == 1:
                part = self.parts[js[0]]
                dims = tuple(sorted(d for d in part.buffer.shape if d != 1))
                shared.setdefault(dims, {})[item.what] = None
                kinds.setdefault(dims, {})[part.kind] = None
        for dims, whats in shared.items():
            if len(whats) > 1:
                shape = "x".join(map(str, dims)) or "scalar"
                notes.append(
                    f"{shorten(list(whats), 4)} have buffers of one shape ({shape}), matched to "
                    f"{' and '.join(kinds[dims])} buffers of that shape by shape alone: which buffer is "
                    f"which parameter's the program does not say"
                )
        return notes

    def _loop_differences(self) -> list[str]:
        rows: list[Collective] = []
        for i, js in self.assigned.items():
            for j in js:
                row = self.parts[j].row
                if row.in_loop and not self.items[i].in_loop and row not in rows:
                    rows.append(row)
        rows += [
            self.parts[j].row
            for j in self.unexpected
            if self.parts[j].row.in_loop and self.parts[j].row not in rows
        ]
        carried: dict[int, list[str]] = {}
        for i, js in self.assigned.items():
            for j in js:
                carried.setdefault(id(self.parts[j].row), []).append(self.items[i].what)
        return [
            _loop_difference(row, self.expected, carried.get(id(row), []))
            for row in sorted(rows, key=self.rows.index)
        ]

    def _kind_differences(self) -> list[str]:
        mode = self.mode
        keys = ordered_keys(
            {kind_key(i.kind, mode) for i in self.items} | {kind_key(p.kind, mode) for p in self.parts}
        )
        out = []
        for key in keys:
            extra = [self.parts[j] for j in self.unexpected if kind_key(self.parts[j].kind, mode) == key]
            missing = [
                item
                for i, item in enumerate(self.items)
                if not item.optional and i not in self.assigned and kind_key(item.kind, mode) == key
            ]
            items = [i for i in self.items if kind_key(i.kind, mode) == key]
            want = sum(i.bytes for i in items if not i.optional)
            model = {id(self.parts[j]) for j in self.model}
            got = sum(
                p.bytes_per_step for p in self.parts if kind_key(p.kind, mode) == key and id(p) not in model
            )
            if extra and not items:
                out.append(
                    f"unexpected {key}: {sum(p.bytes_per_step for p in extra):,} B per step that the "
                    f"{self.expected.layout} layout does not call for: " + _listed(extra) + self._undeclared(extra)
                )
            elif extra:
                surplus = sum(p.bytes_per_step for p in extra)
                shaped = [name for p in extra for name in self._shapes_of(p)]
                counts = (
                    f"compiled {got:,} B per step, expected {want:,} B ({surplus:,} B more)"
                    if got - want == surplus
                    else f"{surplus:,} B per step beyond the buffers matched (compiled {got:,} B per step "
                    f"in all, expected {want:,} B)"
                )
                out.append(
                    f"extra {key}: {counts}; "
                    + (_twice(surplus, items) if self.mode != "implicit" else _again(shaped))
                    + "nothing expected accounts for "
                    + _listed([self._described(p) for p in extra], extra)
                    + self._undeclared(extra)
                )
            if missing:
                named = _listed(missing)
                if not any(kind_key(p.kind, mode) == key for p in self.parts):
                    out.append(
                        f"missing {key}: expected {want:,} B per step, compiled none; not compiled: {named}"
                    )
                elif got < want:
                    out.append(
                        f"too little {key}: compiled {got:,} B per step, expected {want:,} B "
                        f"({want - got:,} B short); not compiled: {named}"
                    )
                else:  # the bytes are there, but not in buffers of these parameters' shapes
                    out.append(
                        f"{key} not compiled as expected: {named} matched no compiled buffer "
                        f"of its shape and bytes, though the step compiles {got:,} B of {key} per step "
                        f"against {want:,} B expected"
                    )
        return out

    def _described(self, part: Part) -> str:
        """A buffer, with the parameters whose shape it has (implicit mode), else as it is."""
        names = self._shapes_of(part)
        if not names:
            return str(part)
        which = " or ".join(names[:4]) + (f" or {len(names) - 4} more" if len(names) > 4 else "")
        return f"{part} (the shape of {which})"

    def _undeclared(self, extra: Sequence[Part]) -> str:
        """What to do about buffers over an axis whose collectives the layers declare."""
        axes = sorted({a for p in extra for a in (p.row.axes or ()) if a in self.declared_axes})
        if not axes:
            return ""
        return (
            f" (over {', '.join(map(repr, axes))} the model's layers declare their collectives and no layer "
            f"declared these; a layer of your own that communicates there declares its collectives with "
            f"substrax.nn.declare_forward and declare_backward)"
        )

    def _bound_applies(self) -> bool:
        sharded_implicit = self.mode == "implicit" and self.expected.layout != "replicated"
        got = sum(p.bytes_per_step for p in self.parts)
        want = sum(i.bytes for i in self.items)
        return sharded_implicit and got <= want

    def _bound_note(self) -> str:
        mode = self.mode
        want: dict[str, int] = {}
        for i in self.items:
            want[kind_key(i.kind, mode)] = want.get(kind_key(i.kind, mode), 0) + i.bytes
        got: dict[str, int] = {}
        for p in self.parts:
            got[kind_key(p.kind, mode)] = got.get(kind_key(p.kind, mode), 0) + p.bytes_per_step
        keys = [k for k in ordered_keys({*want, *got}) if want.get(k, 0) != got.get(k, 0)]
        changes = ", ".join(f"{k} {want.get(k, 0):,} -> {got.get(k, 0):,} B" for k in keys)
        return (
            f"implicit mode: XLA chose its own collectives ({changes}); accepted because the step communicates "
            f"{sum(got.values()):,} B in all, no more than the {sum(want.values()):,} B expected"
        )


def _shape_distance(buffer: str, compiled: Operand) -> int:
    """How far a compiled buffer is from ``buffer``: 0 same, 1 reordered, 2 but unit dims, 3 other."""
    if buffer == str(compiled):
        return 0
    dims = [int(d) for d in re.findall(r"\d+", buffer.partition("[")[2])] if "[" in buffer else None
    if dims is None:
        return 3
    if sorted(dims) == sorted(compiled.shape):
        return 1
    return 2 if sorted(d for d in dims if d != 1) == sorted(d for d in compiled.shape if d != 1) else 3


def _subset_sum(values: Sequence[int], target: int, budget: list[int]) -> tuple[int, ...] | None:
    """Indices of the fewest (<= ``_PIECES``) ``values`` summing to ``target`` in ``budget[0]`` tries."""
    reach: dict[int, tuple[int, ...]] = {0: ()}
    for k, v in enumerate(values):
        if v <= 0 or v > target:
            continue
        budget[0] -= len(reach)
        if budget[0] < 0:
            return None
        for total, chosen in list(reach.items()):
            t = total + v
            if t <= target and len(chosen) < _PIECES and (t not in reach or len(reach[t]) > len(chosen) + 1):
                reach[t] = (*chosen, k)
        if len(reach) > _SEARCH_LIMIT:
            return None
    return reach.get(target) or None


def _loop_difference(row: Collective, expected: Expected, carried: Sequence[str] = ()) -> str:
    runs = f"{row.trip_count} times" if row.trip_count is not None else "an unstated number of times"
    what = f", carrying {shorten(list(carried), 4)}," if carried else ""
    return (
        f"{row.kind} {row.name} ({_row_text(row)}){what} sits inside a while loop and runs {runs} per step; "
        f"the {expected.layout} layout with {expected.microbatches} microbatch(es) expects every "
        f"collective of the step once per step, outside loops"
    )


_LISTED = 4  # buffers a difference names one by one (the rest: Comparison.unexpected, .matched)


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


def _dims(buffer: str) -> tuple[int, ...]:
    """The dimensions an expected buffer's text names (``"f32[2,64]"`` -> ``(2, 64)``), ``()`` if none."""
    inside = buffer.partition("[")[2].rstrip("]")
    return tuple(int(d) for d in inside.split(",") if d.strip().isdigit()) if "[" in buffer else ()


def _same_shape(buffer: str, compiled: Operand, layer: bool = False) -> bool:
    """``compiled`` holds ``buffer``'s elements in some order (size-1 dimensions aside); with ``layer``,
    one layer of it: the shape without its leading (layer) dimension."""
    dims = _dims(buffer)[1:] if layer else _dims(buffer)
    return sorted(d for d in dims if d != 1) == sorted(d for d in compiled.shape if d != 1)
