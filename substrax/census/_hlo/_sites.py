"""The walk from ``ENTRY`` to every collective: loops with trip counts, calls, async pairs once."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._module import KINDS, Computation, Instruction, Module

_CALLS = re.compile(
    r"\b(?P<key>calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(?P<value>\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT = re.compile(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_MAX_DEPTH = 200


@dataclass(frozen=True)
class Site:
    """A collective instruction where the walk from ``ENTRY`` reaches it (once per call site).

    Attributes:
      kind: one of ``KINDS``.
      instruction: the instruction (a ``-start`` for an asynchronous pair).
      computation: the computation that holds it.
      trip_counts: the trip count of each ``while`` loop around it, outermost first;
        ``None`` where the compiler does not state it; ``()`` outside loops.
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
        for key, callee in _callees(instruction.attrs):
            inner = trips
            if instruction.opcode == "while" and key in ("body", "condition"):
                inner = (*trips, _trip_count(instruction.attrs))
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


def _trip_count(attrs: str) -> int | None:
    match = _TRIP_COUNT.search(attrs)
    return int(match[1]) if match else None
