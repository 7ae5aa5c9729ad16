"""The walk from ``ENTRY`` to every collective: loops with their trip counts, calls, async pairs once."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._loops import trip_count
from ._module import KINDS, Computation, Instruction, Module

_CALLS = re.compile(
    r"\b(?P<key>calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(?P<value>\{[^}]*\}|%?[\w.\-]+)"
)
_MAX_DEPTH = 200


@dataclass(frozen=True)
class Site:
    """A collective instruction where the walk from ``ENTRY`` reaches it (once per call site).

    Attributes:
      kind: one of ``KINDS``.
      instruction: the instruction (a ``-start`` for an asynchronous pair).
      computation: the computation that holds it.
      trip_counts: the trip count of each ``while`` loop around it, outermost first;
        ``None`` where neither the compiler states it nor the loop shows it (``trip_count``);
        ``()`` outside loops.
    """

    kind: str
    instruction: Instruction
    computation: Computation
    trip_counts: tuple[int | None, ...]


def collective_sites(module: Module) -> list[Site]:
    """Every collective instruction reached from ``ENTRY``, in program order."""
    sites: list[Site] = []
    _walk(module, module.entry, (), sites, depth=0)
    return sites


def _walk(module: Module, name: str, trips: tuple[int | None, ...], sites: list[Site], depth: int) -> None:
    computation = module.computations.get(name)
    if computation is None or depth > _MAX_DEPTH:
        return
    for instruction in computation.instructions:
        kind = _kind(instruction.opcode)
        if kind is not None:
            sites.append(Site(kind, instruction, computation, trips))
        if instruction.opcode.endswith("-done") or instruction.opcode == "async-update":
            continue  # the -start that began it already led to the computation it runs
        looped = instruction.opcode == "while"
        count = trip_count(module, instruction, computation) if looped else None
        for key, callee in _callees(instruction.attrs):
            inner = (*trips, count) if looped and key in ("body", "condition") else trips
            _walk(module, callee, inner, sites, depth + 1)


def _kind(opcode: str) -> str | None:
    if opcode.endswith("-done"):
        return None
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


def _callees(attrs: str) -> list[tuple[str, str]]:
    return [
        (m["key"], callee)
        for m in _CALLS.finditer(attrs)
        for callee in re.findall(r"%?([\w.\-]+)", m["value"])
    ]
