"""The pairing of ``compare``: each expected buffer to the compiled ones that carry it, pass by pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from substrax._base import scopes
from substrax.census._expected import Expected, ExpectedCollective
from substrax.census._match._kinds import kind_key
from substrax.census._match._shapes import dims, same_shape, shape_distance, shapes_of
from substrax.census._match._slices import across_slices
from substrax.census._rows import Collective, Part
from substrax.census._text import shorten

__all__ = ["Assignment"]

_PHASE_ORDER = {
    "gradients": {"backward": 0, None: 1, "forward": 2},
    "loss": {"forward": 0, None: 1, "backward": 2},
    "metrics": {"forward": 0, None: 1, "backward": 2},
}
_OTHER_ORDER = {None: 0, "forward": 1, "backward": 2}
_SEARCH_LIMIT = 1 << 12  # partial sums kept while looking for a combined buffer
_SEARCH_BUDGET = 1 << 21  # partial sums tried in all, per comparison: a bound on its time
_PIECES = 4  # compiled buffers that may stand for expected ones combined or cut differently


class Assignment:
    """The compiled buffers (``parts``) each expected one (``items``) was paired with: ``assigned``
    (item -> parts), ``rewrites`` (item, part: a scatter or gather compiled as an all-reduce),
    ``model`` (parts taken as the model's own), ``unexpected`` (the rest), ``notes``."""

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
        across_slices(self)  # the all-reduces across TPU slices, as the send/recv pairs that carry them
        self._folded()
        if self.mode == "implicit":
            self._per_layer()
        self._one_to_one()
        self._combined()
        self.rewrites = self._rewritten()
        left = [j for j in range(len(self.parts)) if j not in self.taken]
        self.model = [
            j for j in left if attribute_model and self.model_like(self.parts[j]) and not self._shaped_like(j)
        ]
        self.unexpected = [j for j in left if j not in self.model]

    def order(self) -> list[int]:
        """The items, the ones that must be compiled and are named by scope first, larger first."""
        return sorted(
            range(len(self.items)),
            key=lambda i: (self.items[i].optional, not self.items[i].scopes, -self.items[i].bytes, i),
        )

    def shape_bound(self, item: ExpectedCollective) -> bool:
        """Implicit mode names a parameter only for a buffer of its shape (what the program says)."""
        bound = item.category in ("gradients", "parameters") and bool(dims(item.buffer))
        return self.mode == "implicit" and bound

    def shapes_of(self, part: Part) -> list[str]:
        """The parameters whose shape ``part`` has (``_shapes.shapes_of``)."""
        return shapes_of(self.items, self.mode, part)

    def model_like(self, part: Part) -> bool:
        """The model's own: under no library scope or a layer's, but not where layers declared."""
        if part.row.axes and self.declared_axes & set(part.row.axes):
            return False
        if part.scope == scopes.TENSOR_PARALLEL:
            return not self.declared_axes
        return part.scope is None and part.phase is not None

    def _fits(self, item: ExpectedCollective, part: Part) -> bool:
        return (
            kind_key(item.kind, self.mode) == kind_key(part.kind, self.mode)
            and (not item.scopes or part.scope in item.scopes)
            and (not item.axes or part.row.axes is None or tuple(part.row.axes) == item.axes)
            and (item.shift is None or part.row.axes is None or part.row.shift == item.shift)
        )

    def _take(self, i: int, j: int) -> None:
        self.assigned[i] = [j]
        self.taken.add(j)

    def _per_layer(self) -> None:
        """A stacked parameter ``[L, ...]`` moved one layer per iteration of a loop of ``L``: XLA's
        choice for a stack applied by ``nnx.scan``; its bytes per step are the rule's."""
        for i in self.order():
            item = self.items[i]
            named = dims(item.buffer)
            if item.optional or not self.shape_bound(item) or len(named) < 2 or named[0] < 2:
                continue
            free = [
                j
                for j, p in enumerate(self.parts)
                if j not in self.taken
                and self._fits(item, p)
                and p.row.trip_counts[-1:] == (named[0],)
                and p.bytes * named[0] == item.bytes
                and same_shape(item.buffer, p.buffer, layer=True)
            ]
            if free:
                j = min(free, key=lambda j: self._preference(item, j))
                self._take(i, j)
                if self.parts[j].row.trip_counts == (named[0],):  # the stack's loop alone: once per step
                    self.layered[i] = named[0]
                    self.items[i] = replace(item, in_loop=True)

    def _folded(self) -> None:
        """Two all-reduces of one buffer over disjoint axes compiled as one over both (XLA folds an
        all-reduce of an all-reduce: the GPU compiler a pipeline's sum over ``stage`` of a whole
        gradient with its sum over ``data``): the one buffer carries both, each of its bytes."""
        for j, part in enumerate(self.parts):
            if j in self.taken or part.kind != "all-reduce" or not part.row.axes:
                continue
            pair = self._fold_of(part)
            if pair is not None:
                for i in pair:
                    self._take(i, j)
                a, b = (self.items[i] for i in pair)
                self.notes.append(
                    f"{a.what} over {', '.join(a.axes)} and {b.what} over {', '.join(b.axes)} compiled "
                    f"as one all-reduce over both ({part}): the compiler folds an all-reduce of an all-reduce"
                )

    def _fold_of(self, part: Part) -> tuple[int, int] | None:
        """Two unmatched expected all-reduces of ``part``'s buffer whose axes split ``part``'s."""
        over = set(part.row.axes or ())
        free = [
            i for i, item in enumerate(self.items)
            if i not in self.assigned and item.kind == "all-reduce" and item.buffer == str(part.buffer)
            and item.bytes == part.bytes and item.axes and set(item.axes) < over
        ]  # fmt: skip
        for x in free:
            for y in free:
                ax, ay = set(self.items[x].axes), set(self.items[y].axes)
                if x < y and not ax & ay and ax | ay == over:
                    return x, y
        return None

    def _preference(self, item: ExpectedCollective, j: int) -> tuple[int, int, bool, int]:
        part = self.parts[j]
        if item.phase is not None:
            phase = 0 if part.phase == item.phase else 1
        else:
            phase = _PHASE_ORDER.get(item.category, _OTHER_ORDER).get(part.phase, 3)
        return phase, shape_distance(item.buffer, part.buffer), part.row.in_loop != item.in_loop, j

    def _one_to_one(self) -> None:
        for i in self.order():
            item = self.items[i]
            free = [
                j
                for j, p in enumerate(self.parts)
                if j not in self.taken
                and _same_bytes(item, p)
                and self._fits(item, p)
                and (not self.shape_bound(item) or same_shape(item.buffer, p.buffer))
            ]
            if free:
                j = min(free, key=lambda j: self._preference(item, j))
                self._take(i, j)
                if item.per_run:  # as often as the program's loops run it: its bytes per step
                    part = self.parts[j]
                    self.items[i] = replace(item, bytes=part.bytes_per_step, in_loop=part.row.in_loop)

    def _combined(self) -> None:
        """Buffers XLA combined or cut: one kind and scope's unmatched ones against <= ``_PIECES``."""
        groups: dict[tuple[str, tuple[str | None, ...]], list[int]] = {}
        for i in self.order():
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
                    not self.shape_bound(item)
                    or len(p.buffer.shape) <= 1
                    or any(same_shape(self.items[i].buffer, p.buffer) for i in left)
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

    def _shaped_like(self, j: int) -> bool:
        """A buffer over the axis gradients were reduced on with a parameter's shape: not the model's."""
        part = self.parts[j]
        axes = {self.parts[k].row.axes for i, ks in self.assigned.items() for k in ks
                if self.items[i].category in ("gradients", "parameters")}  # fmt: skip
        return part.row.axes in axes and bool(self.shapes_of(part))

    def _rewritten(self) -> list[tuple[int, int]]:
        """An expected reduce-scatter or all-gather compiled as an all-reduce of its whole buffer.

        The TPU compiler's decomposers do this (census guide, "On a TPU"); each pairing is a
        difference that names the rewrite and what it costs.
        """
        pairs = []
        for i in self.order():
            item = self.items[i]
            if i in self.assigned or item.kind not in ("reduce-scatter", "all-gather"):
                continue
            free = [
                j
                for j, p in enumerate(self.parts)
                if j not in self.taken
                and p.kind == "all-reduce"
                and _same_bytes(item, p)
                and (not item.axes or p.row.axes is None or tuple(p.row.axes) == item.axes)
                and not self.model_like(p)  # a layer's own all-reduce (BatchNorm's psum) is no rewrite
            ]
            if free:
                j = min(free, key=lambda j: (shape_distance(item.buffer, self.parts[j].buffer), j))
                self._take(i, j)
                pairs.append((i, j))
        return pairs


def _same_bytes(item: ExpectedCollective, part: Part) -> bool:
    if item.per_run:  # one run's bytes, in as many loops as it takes (inside the microbatch loop)
        return part.bytes == item.bytes and (part.row.in_loop or not item.in_loop)
    return (part.bytes_per_step if item.in_loop else part.bytes) == item.bytes


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
