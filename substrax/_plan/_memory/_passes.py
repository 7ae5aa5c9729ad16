"""XLA's passes over the whole program that change what it keeps: the all-reduce combiner and
dead-code elimination."""

from __future__ import annotations

from substrax._plan._memory._program import Op, Program

__all__ = ["combine", "prune"]


def combine(program: Program) -> None:
    """Merge the all-reduces over the same axes that do not depend on each other into one, at
    the last one's place, as XLA's all-reduce combiner does (their operands all live until it)."""
    ops, needs = program.ops, program.needs()
    above = []  # each op's ancestors, as a bit set
    for i in range(len(ops)):
        bits = 0
        for j in needs[i]:
            bits |= above[j] | 1 << j
        above.append(bits)
    groups: dict[tuple[str, str], list[list[int]]] = {}
    for i, key in sorted(program.combinable.items()):
        mine = groups.setdefault(key, [[]])
        if any(above[i] >> j & 1 for j in mine[-1]):
            mine.append([])
        mine[-1].append(i)
    into = {}
    for group in (g for gs in groups.values() for g in gs if len(g) > 1):
        reads = [k for i in group for k in ops[i].reads]
        defined = [k for i in group for k in ops[i].defines]
        ops[group[-1]] = Op(reads, defined)
        into.update(dict.fromkeys(group[:-1]))
    program.ops = [op for i, op in enumerate(ops) if i not in into]


def prune(program: Program, outs: list[int]) -> None:
    """Drop the ops no result depends on, as XLA removes dead code (a gather for a gradient
    nobody takes, its product)."""
    roots, view = program.roots, program.view
    needed = {r for k in outs for r in roots[k] | {k, view.get(k, k)}}
    live = []
    for op in reversed(program.ops):
        if any(k in needed for k in op.defines):
            live.append(op)
            needed.update(r for k in op.reads for r in roots[k] | {k, view.get(k, k)})
    program.ops = live[::-1]
