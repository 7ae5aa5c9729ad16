"""The compiled schedule, walked: each operation in the order the compiler left it, on one clock.

Compute runs one operation after another, each for ``_ops.seconds`` of its cost. A collective
runs on its link (``_links``), one at a time per link: a synchronous one stops the compute until
it ends; an asynchronous one (a ``-start`` and its ``-done``; a send or recv and its ``-done``)
starts where its start stands and stops the compute only at its done, for what is left of it; a
collective the TPU compiler fused into a computation (its asynchronous collective fusion) runs
beside that fusion's own compute. A ``while`` body runs its trip count (``census.trip_count``)
times, a ``conditional`` its longest branch, a ``call`` its callee, in place.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from substrax.census import operand_name, trip_count
from substrax.timeline._links import collective_seconds, link_of
from substrax.timeline._ops import Cost, instruction_cost, seconds
from substrax.timeline._targets import Target

__all__ = ["Event", "Span", "walk"]

MAX_EVENTS = 20_000
"""Events a timeline keeps: a loop's iterations past them are one event (``as before``)."""

_CALLEES = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation|"
                      r"branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")  # fmt: skip
_DEPTH = 64


@dataclasses.dataclass(frozen=True)
class Event:
    """One span of the predicted step.

    Attributes:
      name: The instruction (``fusion.12``, ``all-gather.3``), or a loop's summary.
      lane: ``"compute"``, or the link a collective runs on (``"ici"``, ``"dcn"``, ``"nvlink"``,
        ``"network"``; a recv's ``"... in"``).
      start: Seconds from the step's start.
      seconds: How long it runs.
      kind: ``"compute"``, ``"loop"`` (iterations summarized), or the collective's kind.
      exposed: Of a collective: the seconds the compute waited on it.
      op_name: The JAX operation it came from.
      bytes: Of a collective: its bytes (census); of compute: the bytes it moves.
      flops: Of compute: its FLOPs.
    """

    name: str
    lane: str
    start: float
    seconds: float
    kind: str = "compute"
    exposed: float = 0.0
    op_name: str = ""
    bytes: float = 0.0
    flops: float = 0.0


@dataclasses.dataclass
class Span:
    """A computation walked: its length, its totals, its events (times from its own start)."""

    duration: float = 0.0
    compute: float = 0.0
    communication: float = 0.0
    exposed: float = 0.0
    flops: float = 0.0
    events: list[Event] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def absorb(self, other: Span, at: float, times: int = 1, name: str = "") -> None:
        """Add ``other`` (what ``name`` runs) ``times`` in a row from ``at``: its totals, and its events
        while ``MAX_EVENTS`` allows (the rest one event)."""
        for field in ("compute", "communication", "exposed", "flops"):
            setattr(self, field, getattr(self, field) + times * getattr(other, field))
        self.notes += [n for n in other.notes if n not in self.notes]
        shown = min(times, max(0, (MAX_EVENTS - len(self.events)) // max(1, len(other.events))))
        for k in range(shown):
            self.events += [
                dataclasses.replace(e, start=e.start + at + k * other.duration) for e in other.events
            ]
        if shown < times and other.events:
            left = f"{name}: iterations {shown + 1}-{times}, as before" if times > 1 else f"{name}: not drawn"
            self.events.append(Event(left, "compute", at + shown * other.duration,
                                     (times - shown) * other.duration, "loop"))  # fmt: skip


def walk(module: Any, rows: Mapping[tuple[str, str], Any], links: Mapping[str, str], target: Target,
         devices: int | None) -> Span:  # fmt: skip
    """The program ``module`` walked from ``ENTRY``: ``rows`` are its census rows by (computation,
    instruction), ``links`` each mesh axis's link kind."""
    within = "ici" if target.name.startswith("v") else "nvlink"
    return _Walker(module, rows, links, target, devices, within).computation(module.entry, 0)


class _Walker:
    def __init__(self, module: Any, rows: Mapping[tuple[str, str], Any], links: Mapping[str, str],
                 target: Target, devices: int | None, within: str) -> None:  # fmt: skip
        self.module, self.rows, self.links, self.target = module, rows, links, target
        self.devices, self.within = devices, within
        self.held: dict[str, list[Any]] = {}
        for (computation, _), row in rows.items():
            self.held.setdefault(computation, []).append(row)

    def computation(self, name: str, depth: int) -> Span:
        """``name`` walked from its first instruction, on a clock of its own."""
        span, comp = Span(), self.module.computations.get(name)
        if comp is None or depth > _DEPTH:
            return span
        free: dict[str, float] = {}  # each link: when it is next free
        pending: dict[str, tuple[int, float]] = {}  # an asynchronous start: (its event, its end)
        for ins in comp.instructions:
            op = ins.opcode
            row = self.rows.get((comp.name, ins.name))
            if op in ("while", "call", "conditional"):
                self._nested(span, comp, ins, depth)
            elif row is not None:
                self._collective(span, row, ins, free, pending)
            elif op.endswith("-done") or op == "async-update":
                self._done(span, ins, pending)
            elif self._fused_rows(ins):
                self._fused(span, comp, ins, free)
            else:
                self._compute(span, comp, ins)
        return span

    def _nested(self, span: Span, comp: Any, ins: Any, depth: int) -> None:
        """A loop (its body, its trip count times), a call, or a conditional's longest branch."""
        called = dict(_callees(ins.attrs))
        if ins.opcode == "while":
            trips = trip_count(self.module, ins, comp)
            if trips is None:
                span.notes.append(
                    f"{ins.name}: a loop whose trip count the program does not show, counted once"
                )
            inner = self.computation(called.get("body", [""])[0], depth + 1)
            times = 1 if trips is None else trips
        else:
            branches = [self.computation(c, depth + 1) for cs in called.values() for c in cs]
            inner = max(branches, key=lambda s: s.duration, default=Span())
            times = 1
        span.absorb(inner, span.duration, times, ins.name)
        span.duration += times * inner.duration

    def _collective(self, span: Span, row: Any, ins: Any, free: dict, pending: dict) -> None:
        link = link_of(row, self.links, self.within)
        lane = f"{link} in" if row.kind == "recv" else link
        length = collective_seconds(row, self.target.link(link), self.devices)
        begin = max(span.duration, free.get(lane, 0.0))
        free[lane] = begin + length
        span.communication += length
        span.events.append(Event(ins.name, lane, begin, length, row.kind, 0.0, row.op_name, row.bytes))
        if ins.opcode.endswith("-start") or row.kind in ("send", "recv"):
            pending[ins.name] = (len(span.events) - 1, begin + length)
        else:
            self._wait(span, len(span.events) - 1, begin + length)

    def _done(self, span: Span, ins: Any, pending: dict) -> None:
        started = pending.pop(operand_name(ins.operands[0]) if ins.operands else "", None)
        if started is not None:
            self._wait(span, *started)

    def _wait(self, span: Span, index: int, end: float) -> None:
        """The compute waits for event ``index`` to end at ``end``: the wait is exposed."""
        wait = max(0.0, end - span.duration)
        if wait > 0:
            event = span.events[index]
            span.events[index] = dataclasses.replace(event, exposed=event.exposed + wait)
            span.exposed += wait
            span.duration += wait

    def _fused_rows(self, ins: Any) -> list[Any]:
        """The census rows inside what ``ins`` calls (a fusion's computation, nested ones too)."""
        found, names = [], [c for cs in dict(_callees(ins.attrs)).values() for c in cs]
        while names:
            name = names.pop()
            found += self.held.get(name, [])
            inner = self.module.computations.get(name)
            names += [c for i in (inner.instructions if inner else ()) if i.opcode == "fusion"
                      for cs in dict(_callees(i.attrs)).values() for c in cs]  # fmt: skip
        return found

    def _fused(self, span: Span, comp: Any, ins: Any, free: dict) -> None:
        """A fusion running collectives beside its own compute: the longer of the two."""
        start = span.duration
        self._compute(span, comp, ins)
        for row in self._fused_rows(ins):
            link = link_of(row, self.links, self.within)
            length = collective_seconds(row, self.target.link(link), self.devices)
            begin = max(start, free.get(link, 0.0))
            free[link] = begin + length
            span.communication += length
            span.events.append(Event(row.name, link, begin, length, row.kind, 0.0, row.op_name, row.bytes))
            self._wait(span, len(span.events) - 1, begin + length)

    def _compute(self, span: Span, comp: Any, ins: Any) -> float:
        cost = instruction_cost(self.module, comp, ins)
        if cost == Cost():
            return 0.0
        length = seconds(cost, self.target)
        span.events.append(Event(ins.name, "compute", span.duration, length, "compute", 0.0,
                                 _op_name(ins.attrs), cost.bytes, cost.flops))  # fmt: skip
        span.compute += length
        span.flops += cost.flops
        span.duration += length
        return length


def _callees(attrs: str) -> list[tuple[str, list[str]]]:
    return [(m.group(1), re.findall(r"%?([\w.\-]+)", m.group(2))) for m in _CALLEES.finditer(attrs)]


def _op_name(attrs: str) -> str:
    found = re.search(r'op_name="((?:[^"\\]|\\.)*)"', attrs)
    return found.group(1) if found else ""
