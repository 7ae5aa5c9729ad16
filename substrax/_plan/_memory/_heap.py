"""The peak of a scheduled program: each buffer's lifetime, the buffers XLA shares (an in-place
chain, an output written into a donated argument, a temporary inside an output's buffer before
it is written), and the heap XLA's buffer assigner packs the rest into."""

from __future__ import annotations

import dataclasses

import numpy as np

from substrax._plan._memory._program import Program

__all__ = ["Buffer", "Memory", "heap_size", "peak"]


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device of one compiled step, as ``memory_analysis()`` counts them."""

    arguments: int
    outputs: int  # less those written into donated arguments
    temporaries: int  # at their peak; the step's peak is the three's sum


@dataclasses.dataclass
class Buffer:
    """A buffer: the ops it lives from and to (``last`` = the op count: to the end), its bytes,
    whether it holds a result."""

    first: int
    last: int
    size: int
    output: bool = False


@dataclasses.dataclass
class _Output:
    """A result's buffer: where it is first written, its bytes, the temporaries it holds before."""

    first: int
    size: int
    lodgers: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def takes(self, b: Buffer) -> bool:
        return (
            self.size >= b.size and self.first >= b.last
            and all(last < b.first or first > b.last for first, last in self.lodgers)
        )  # fmt: skip


def peak(
    program: Program, outs: list[int], argument_bytes: list[int], *, donated: bool, align: int
) -> Memory:
    """The memory of ``program`` (combined, pruned, scheduled) returning ``outs``; ``donated``:
    an output of an argument's size is written into that argument's buffer. ``align``: the bytes
    a heap buffer starts at a multiple of."""
    output = {program.view.get(k, k) for k in outs}
    paired = _donated(program, outs, list(argument_bytes) if donated else [])
    buffers = _buffers(program, _last_reads(program), output, paired)
    results = [_Output(b.first, b.size) for b in buffers if b.output]
    heap = []
    for b in sorted((b for b in buffers if not b.output), key=lambda b: -b.size):
        fits = [o for o in results if o.takes(b)]
        if fits:
            min(fits, key=lambda o: o.size).lodgers.append((b.first, b.last))
        else:
            heap.append(b)
    heap += [Buffer(i, i, op.temporaries) for i, op in enumerate(program.ops) if op.temporaries]
    return Memory(sum(argument_bytes), sum(o.size for o in results), heap_size(heap, align))


def _last_reads(program: Program) -> dict[int, int]:
    """Each buffer's last reader."""
    last: dict[int, int] = {}
    for i, op in enumerate(program.ops):
        for r in op.reads:
            for root in program.roots[r]:
                last[root] = i
    if program.hold_recomputed:  # XLA keeps the recomputed forward's values to the body's end
        last.update((k, len(program.ops) - 1) for k in program.recomputed if k in last)
    return last


def _donated(program: Program, outs: list[int], free: list[int]) -> set[int]:
    """The outputs jax writes into a donated argument of their size (``free``, each once): those
    buffers hold nothing else."""
    paired = set()
    for k in outs:
        k = program.view.get(k, k)
        if k not in paired and not program.argument[k] and program.size[k] in free:
            free.remove(program.size[k])
            paired.add(k)
    return paired


def _buffers(program: Program, last: dict[int, int], output: set[int], paired: set[int]) -> list[Buffer]:
    """The buffers the program writes, less ``paired``: an elementwise result takes a dying
    operand's buffer of its size (one chain, one buffer)."""
    roots, size = program.roots, program.size
    chain: dict[int, int] = {}
    taken: set[int] = set()
    first: dict[int, int] = {}
    for i, op in enumerate(program.ops):
        dying = [r for k in op.reads for r in roots[k] if last.get(r) == i and not program.argument[r]]
        for k in op.defines:
            if roots[k] != frozenset({k}) or not size[k]:
                continue
            if k in first:  # made before (a scan's stacked result): one buffer
                continue
            first[k] = i
            if not program.in_place[k] or k in paired:
                continue
            for r in dying:
                if r not in taken and r not in output and size[r] == size[k]:
                    taken.add(r)
                    chain[k] = chain.get(r, r)
                    break
    n = len(program.ops)
    buffers: dict[int, Buffer] = {}
    for k, i in first.items():
        if k in paired:
            continue
        b = buffers.setdefault(chain.get(k, k), Buffer(n, -1, 0))
        b.first, b.size = min(b.first, i), max(b.size, size[k])
        b.last = max(b.last, n if k in output else last.get(k, i))
        b.output = b.output or k in output
    return list(buffers.values())


def heap_size(buffers: list[Buffer], align: int) -> int:
    """The size of the heap XLA's buffer assigner packs ``buffers`` into, each at a multiple of
    ``align``: the largest first, each at the smallest gap left by those alive at the same time
    that fits it, else above them (a global decreasing-size best fit)."""
    buffers = sorted(buffers, key=lambda b: (-b.size, b.first - b.last, b.first))
    count = len(buffers)
    first, last, offset, size = (np.zeros(count, np.int64) for _ in range(4))
    top = 0
    for i, b in enumerate(buffers):
        bytes_ = -(-b.size // align) * align
        alive = (first[:i] <= b.last) & (last[:i] >= b.first)
        lo, hi = offset[:i][alive], offset[:i][alive] + size[:i][alive]
        order = np.argsort(lo, kind="stable")
        lo, ends = lo[order], np.maximum.accumulate(hi[order]) if len(order) else hi
        starts = np.concatenate(([0], ends[:-1]))
        gaps = lo - starts
        fits = np.flatnonzero(gaps >= bytes_)
        at = int(starts[fits[np.argmin(gaps[fits])]]) if len(fits) else int(ends[-1]) if len(ends) else 0
        first[i], last[i], offset[i], size[i] = b.first, b.last, at, bytes_
        top = max(top, at + bytes_)
    return top
