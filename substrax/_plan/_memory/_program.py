"""The program a jaxpr compiles to, as the estimate models it: values, the buffers kept for
them, and the ops that read and define them, in program order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Op", "Program"]


class Op(NamedTuple):
    """One instruction: the values it reads and defines, and its own temporaries (a loop body's
    peak, a copy of its result)."""

    reads: list[int]
    defines: list[int]
    temporaries: int = 0
    # how the scheduler takes it: "late", a dot whose result is transposed (the folded dot, a new
    # instruction, is its operands' last reader); "turn", a bitcast (an instruction of its own)
    tag: str = ""


class Program:
    """Values (keys) and the ops that define and read them, in program order."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.size: dict[int, int] = {}  # bytes per device of a kept buffer (0: not kept)
        self.whole: dict[int, int] = {}  # the value's bytes as the jaxpr types it
        self.ways: dict[int, int] = {}  # whole / bytes per device
        self.roots: dict[int, frozenset[int]] = {}  # the kept buffers a value is computed from
        self.view: dict[int, int] = {}  # a value that is a kept buffer seen again -> that buffer
        self.in_place: dict[int, bool] = {}  # may take a dying operand's buffer
        self.argument: dict[int, bool] = {}
        self.combinable: dict[int, tuple[str, str]] = {}  # op -> (collective, axes)
        self.written: dict[Any, int] = {}  # a broadcast part (a kernel's: and its shape) -> its buffer
        self.materialized: dict[int, int] = {}  # a fused value -> the buffer it is written to
        self.parameter: dict[int, int] = {}  # an argument -> the parameter XLA reads it from
        self.recomputing = False  # the op being walked recomputes a forward pass under remat
        self.recomputed: set[int] = set()  # the buffers such ops keep (less the parameters they gather)
        self.gathered: set[int] = set()  # all-gathers' results, and their copies
        self.hold_recomputed = False  # a loop body: what it recomputes lives to its end

    def buffer(self, whole: int, ways: int, *, argument: bool = False, in_place: bool = False) -> int:
        """A new kept buffer of ``whole`` bytes split ``ways`` ways."""
        k = len(self.size) + 1
        self.size[k], self.whole[k], self.ways[k] = whole // max(1, ways), whole, ways
        self.roots[k], self.argument[k], self.in_place[k] = frozenset({k}), argument, in_place
        if self.recomputing:
            self.recomputed.add(k)
        return k

    def virtual(self, whole: int, ways: int, reads: Sequence[int], *, view: int | None = None) -> int:
        """A new value kept in no buffer of its own: computed from ``reads``, or ``view`` seen again."""
        k = len(self.size) + 1
        self.size[k], self.whole[k], self.ways[k], self.argument[k] = 0, whole, ways, False
        self.roots[k] = frozenset().union(*(self.roots[r] for r in reads))
        if view is not None and self.kept(view):
            self.view[k] = self.view.get(view, view)
        return k

    def kept(self, k: int) -> bool:
        """Whether ``k`` is a buffer, or one seen again."""
        return self.roots[k] == frozenset({k}) or k in self.view

    def materialize(self, k: int) -> int:
        """``k`` as a buffer of its own, written once, where the first reader that cannot fuse reads it."""
        if self.kept(k):
            return k
        if k not in self.materialized:
            self.materialized[k] = self.buffer(self.whole[k], self.ways[k], in_place=True)
            if self.roots[k] & self.gathered:  # a gathered parameter written out: gathered
                self.gathered.add(self.materialized[k])
                self.recomputed.discard(self.materialized[k])
            self.ops.append(Op([k], [self.materialized[k]]))
        return self.materialized[k]

    def kernel_input(self, k: int, v: Any, shape: tuple[int, ...] | None) -> int:
        """What a kernel reads for ``k``: it as a buffer, or ``shape``'s broadcast of it (XLA writes
        a broadcast once for all the kernels that read it)."""
        if shape is not None:
            key = (k, shape)
            if key not in self.written:
                whole = math.prod(shape) * np.dtype(v.aval.dtype).itemsize
                self.written[key] = self.buffer(whole, self.ways[k])
                self.ops.append(Op([k], [self.written[key]]))
            return self.written[key]
        return k if self.kept(k) or not self.roots[k] else self.materialize(k)

    def constant(self, key: tuple[Any, ...]) -> int:
        """A constant's broadcast (value, shape, dtype), written once, first of all."""
        if key not in self.written:
            self.written[key] = self.buffer(math.prod(key[1]) * np.dtype(key[2]).itemsize, 1)
            self.ops.append(Op([], [self.written[key]]))
        return self.written[key]

    def needs(self) -> list[set[int]]:
        """The ops each op reads the results of (its operands' producers and theirs, through fusion)."""
        producer = {k: i for i, op in enumerate(self.ops) for k in op.defines}
        return [
            {producer[r] for k in op.reads for r in self.roots[k] | {k} if producer.get(r, i) != i}
            for i, op in enumerate(self.ops)
        ]
