"""A step's peak memory per device, from its trace: a liveness walk over the jaxpr.

A model of what XLA keeps (which values it materializes, copies, combines and in which
order), not its buffer assignment: see the planning guide for the rules and how close it comes.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

__all__ = ["Memory", "estimate"]

# results that are their operand's buffer seen again
_VIEW = {
    "pvary", "reshape", "squeeze", "expand_dims", "sharding_constraint", "copy", "copy_p", "stop_gradient",
    "optimization_barrier", "mesh_cast", "reshard", "device_put",
}  # fmt: skip
# fused results XLA will not compute again for a second reader (it keeps them)
_EXPENSIVE = {
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "div", "pow", "sqrt", "rsqrt", "cbrt", "erf",
    "erfc", "erf_inv", "sin", "cos", "tan", "atan2", "rem", "lgamma", "digamma", "asin", "acos", "atan", "sinh",
    "cosh", "asinh", "acosh", "atanh", "logaddexp",
}  # fmt: skip
# results XLA computes inside their reader's loop (fused), kept only where a reader cannot fuse
_FUSED = _EXPENSIVE | {
    "add", "sub", "mul", "neg", "max", "min", "select_n", "convert_element_type", "broadcast_in_dim",
    "integer_pow", "abs", "sign", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "is_finite",
    "square", "add_any", "iota", "transpose", "concatenate", "slice", "dynamic_slice", "pad", "clamp", "floor",
    "ceil", "round", "one_minus_square", "nextafter", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "rev", "stack", "split", "reduce_precision", "clz", "real",
    "imag", "conj", "complex",
}  # fmt: skip
_JOINS = {"concatenate", "pad", "stack"}  # fused results larger than their operands, not broadcasts
_REDUCES = {"psum", "psum_invariant"}
_CALLS = {
    "jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "remat", "checkpoint", "shard_map",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device of one compiled step, as ``memory_analysis()`` counts them."""

    arguments: int
    outputs: int  # less those written into donated arguments
    temporaries: int  # at their peak; the step's peak is the three's sum


def estimate(jaxpr: jcore.ClosedJaxpr, argument_bytes: Sequence[int], *, donated: bool = False) -> Memory:
    """The peak of the program ``jaxpr`` compiles to, given each argument's bytes per device.

    ``donated``: the arguments are donated, so an output of an argument's size is written
    into its buffer (as jax pairs them) and counts nothing more.
    """
    walk = _Walk()
    env = {}
    for v, size in zip(jaxpr.jaxpr.invars, argument_bytes, strict=True):
        env[v] = walk.buffer(_bytes(v.aval), _bytes(v.aval) // size if size else 1, argument=True)
    outs = walk.run(jaxpr.jaxpr, env)
    # jax hands an argument returned as it is back without the program
    given = set(jaxpr.jaxpr.invars)
    outs = [walk.materialize(k) for k, v in zip(outs, jaxpr.jaxpr.outvars, strict=True) if v not in given]
    return walk.peak(outs, donated, list(argument_bytes))


def _bytes(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return 0 if shape is None else math.prod(shape) * np.dtype(aval.dtype).itemsize


def _called(eqn: Any) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            return getattr(eqn.params[key], "jaxpr", eqn.params[key])
    raise KeyError(f"{eqn.primitive.name} has no jaxpr")


class _Walk:
    """Values (keys) and the ops that define and read them, in program order."""

    def __init__(self) -> None:
        self.ops: list[tuple[list[int], list[int], int]] = []  # reads, defines, a loop body's own peak
        self.size: dict[int, int] = {}  # bytes per device of a kept buffer (0: not kept)
        self.whole: dict[int, int] = {}  # the value's bytes as the jaxpr types it
        self.ways: dict[int, int] = {}  # whole / bytes per device
        self.roots: dict[int, frozenset[int]] = {}  # the kept buffers a value is computed from
        self.view: dict[int, int] = {}  # a value that is a kept buffer seen again -> that buffer
        self.in_place: dict[int, bool] = {}  # may take a dying operand's buffer
        self.argument: dict[int, bool] = {}
        self.combinable: dict[int, tuple[str, str]] = {}  # op -> (collective, axes)
        self.spread: dict[int, frozenset[int]] = {}  # a fused value -> its broadcast parts
        self.written: dict[int, int] = {}  # a broadcast part -> its buffer
        self.eager: set[int] = set()  # ops placed as soon as their operands are

    def buffer(self, whole: int, ways: int, *, argument: bool = False, in_place: bool = False) -> int:
        k = len(self.size) + 1
        self.size[k], self.whole[k], self.ways[k] = whole // max(1, ways), whole, ways
        self.roots[k], self.argument[k], self.in_place[k] = frozenset({k}), argument, in_place
        return k

    def virtual(self, whole: int, ways: int, reads: Sequence[int], *, view: int | None = None) -> int:
        k = len(self.size) + 1
        self.size[k], self.whole[k], self.ways[k], self.argument[k] = 0, whole, ways, False
        self.roots[k] = frozenset().union(*(self.roots[r] for r in reads))
        if view is not None and self.kept(view):
            self.view[k] = self.view.get(view, view)
        return k

    def kept(self, k: int) -> bool:
        return self.roots[k] == frozenset({k}) or k in self.view

    def materialize(self, k: int) -> int:
        """``k`` as a buffer of its own, written where a reader that cannot fuse reads it."""
        if self.kept(k):
            return k
        new = self.buffer(self.whole[k], self.ways[k], in_place=True)
        self.ops.append(([k], [new], 0))
        return new

    def run(self, jaxpr: Any, env: dict[Any, int]) -> list[int]:
        for v in jaxpr.constvars:  # constants live in the program, not in its buffers
            env.setdefault(v, self.virtual(0, 1, []))
        readers: dict[Any, int] = {}
        for e in jaxpr.eqns:
            for v in e.invars:
                if not isinstance(v, jcore.Literal):
                    readers[v] = readers.get(v, 0) + 1
        for e in jaxpr.eqns:
            name = e.primitive.name
            vars_in = [v for v in e.invars if not isinstance(v, jcore.Literal)]
            reads = [env[v] for v in vars_in]
            if name in _CALLS:
                self._call(e, env)
                continue
            shape = getattr(e.outvars[0].aval, "shape", ())
            same = [
                self.ways[k]
                for k, v in zip(reads, vars_in, strict=True)
                if getattr(v.aval, "shape", None) == shape
            ]
            ways = max(same, default=1)  # a result is split as its operands of its shape are
            if name in _VIEW and reads:
                if name == "sharding_constraint":
                    ways = max(
                        1, math.prod(shape) // max(1, math.prod(e.params["sharding"].shard_shape(shape)))
                    )
                    if ways < self.ways[reads[0]]:  # gathered: a buffer of its own
                        k = self.buffer(_bytes(e.outvars[0].aval), ways)
                        self.ops.append(([self.materialize(reads[0])], [k], 0))
                        env[e.outvars[0]] = k
                        continue
                for i, v in enumerate(e.outvars):
                    r = reads[min(i, len(reads) - 1)]
                    env[v] = self.virtual(
                        _bytes(v.aval), ways if name == "sharding_constraint" else self.ways[r], [r], view=r
                    )
                    self.spread[env[v]] = self.spread.get(r, frozenset())
                continue
            fused = name in _FUSED
            reduction = name == "reduce" or name.startswith("reduce_") or name in ("argmax", "argmin")
            if not fused and not reduction:  # a reduction reads its operands' loops, fused
                reads = [self.materialize(k) for k in reads]
            inner = _copies(
                e, [self.whole[k] // self.ways[k] for k in reads], _bytes(e.outvars[0].aval) // ways
            )
            for sub in jcore.jaxprs_in_params(e.params):
                inner = max(inner, _loop_peak(getattr(sub, "jaxpr", sub), _sliced(e)))
            defined = []
            if reduction:  # XLA writes out the broadcasts its reduction kernel reads, early
                parts = sorted({b for k in reads for b in self.spread.get(k, ())})
                for b in parts:
                    if b not in self.written:
                        self.written[b] = self.buffer(self.whole[b], self.ways[b])
                        self.eager.add(len(self.ops))
                        self.ops.append(([b], [self.written[b]], 0))
                reads = reads + [self.written[b] for b in parts]
            for v in e.outvars:
                if isinstance(v, jcore.DropVar):
                    continue
                if not fused or name in _EXPENSIVE and readers.get(v, 0) > 1:
                    k = self.buffer(_bytes(v.aval), ways, in_place=fused)
                else:
                    k = self.virtual(
                        _bytes(v.aval), ways, reads, view=reads[0] if name == "transpose" else None
                    )
                    # a broadcast (an elementwise op's size-1 dimensions too) of a value, not of a
                    # constant (XLA folds those), or the broadcasts it reads
                    if (reads or name == "iota") and name not in _JOINS and all(
                        self.whole[r] < self.whole[k] or r in self.spread.get(r, ()) for r in reads
                    ):
                        self.spread[k] = frozenset({k})
                    else:
                        self.spread[k] = frozenset().union(*(self.spread.get(r, ()) for r in reads))
                env[v] = k
                defined.append(k)
            if name in _REDUCES:  # XLA combines the all-reduces that do not depend on each other
                self.combinable[len(self.ops)] = (name, str(e.params.get("axes", e.params.get("axis_name"))))
            self.ops.append((reads, defined, inner))
        return [self.virtual(0, 1, []) if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]

    def _call(self, e: Any, env: dict[Any, int]) -> None:
        body = _called(e)
        shard_map = e.primitive.name == "shard_map"
        inner = {}
        for sv, v in zip(body.invars, e.invars, strict=True):
            if isinstance(v, jcore.Literal):
                inner[sv] = self.virtual(0, 1, [])
            elif shard_map:  # the same buffer, typed per device
                inner[sv] = self.virtual(_bytes(sv.aval), 1, [env[v]], view=env[v])
            else:
                inner[sv] = env[v]
        for v, sv, k in zip(e.outvars, body.outvars, self.run(body, inner), strict=True):
            if shard_map:
                ways = max(1, _bytes(v.aval) // max(1, _bytes(sv.aval)))
                env[v] = self.virtual(_bytes(v.aval), ways, [k], view=k)
            else:
                env[v] = k

    def _needs(self) -> list[set[int]]:
        """The ops each op reads the results of (its operands' producers and theirs, through fusion)."""
        producer = {k: i for i, (_, defined, _) in enumerate(self.ops) for k in defined}
        return [
            {producer[r] for k in reads for r in self.roots[k] | {k} if producer.get(r, i) != i}
            for i, (reads, _, _) in enumerate(self.ops)
        ]

    def combine(self) -> None:
        """Merge the all-reduces over the same axes that do not depend on each other into one, at
        the last one's place, as XLA's all-reduce combiner does (their operands all live until it)."""
        needs = self._needs()
        above = []  # each op's ancestors, as a bit set
        for i in range(len(self.ops)):
            bits = 0
            for j in needs[i]:
                bits |= above[j] | 1 << j
            above.append(bits)
        groups: dict[tuple[str, str], list[list[int]]] = {}
        for i, key in sorted(self.combinable.items()):
            mine = groups.setdefault(key, [[]])
            if any(above[i] >> j & 1 for j in mine[-1]):
                mine.append([])
            mine[-1].append(i)
        into = {}
        for group in (g for gs in groups.values() for g in gs if len(g) > 1):
            reads = [k for i in group for k in self.ops[i][0]]
            defined = [k for i in group for k in self.ops[i][1]]
            self.ops[group[-1]] = (reads, defined, 0)
            into.update(dict.fromkeys(group[:-1]))
        self.ops = [op for i, op in enumerate(self.ops) if i not in into]

    def schedule(self) -> None:
        """Reorder the ops as a memory-minded list scheduler would (XLA's does): of the ops whose
        inputs are ready, the one that frees the most bytes net of what it writes goes first."""
        needs = self._needs()
        bases = [{r for k in reads for r in self.roots[k]} for reads, _, _ in self.ops]
        readers: dict[int, set[int]] = {}  # a buffer -> the ops not yet scheduled that read it
        for i, base in enumerate(bases):
            for r in base:
                readers.setdefault(r, set()).add(i)
        waiting = [len(x) for x in needs]
        users: dict[int, list[int]] = {}
        for i, x in enumerate(needs):
            for j in x:
                users.setdefault(j, []).append(i)

        def gain(i: int) -> int:
            if i in self.eager:  # a written broadcast: first of the ready ops, as XLA places it
                return 1 << 62
            _, defined, inner = self.ops[i]
            freed = sum(self.size[r] for r in bases[i] if len(readers[r]) == 1 and not self.argument[r])
            return freed - sum(self.size[k] for k in defined) - inner

        ready = [(-gain(i), i) for i, w in enumerate(waiting) if not w]
        heapq.heapify(ready)
        order: list[int] = []
        done: set[int] = set()
        while ready:  # a gain only grows (as readers are scheduled): a stale entry is pushed again
            g, i = heapq.heappop(ready)
            if i in done:
                continue
            if -g != gain(i):
                heapq.heappush(ready, (-gain(i), i))
                continue
            done.add(i)
            order.append(i)
            for r in bases[i]:
                readers[r].discard(i)
                if len(readers[r]) == 1 and (j := next(iter(readers[r]))) not in done and not waiting[j]:
                    heapq.heappush(ready, (-gain(j), j))
            for j in users.get(i, []):
                waiting[j] -= 1
                if not waiting[j]:
                    heapq.heappush(ready, (-gain(j), j))
        if len(order) == len(self.ops):  # (always: the ops form a DAG)
            self.ops = [self.ops[i] for i in order]

    def peak(self, outs: list[int], donated: bool, argument_bytes: list[int]) -> Memory:
        self.combine()
        self.schedule()
        n = len(self.ops)
        last: dict[int, int] = {}
        for i, (reads, _, _) in enumerate(self.ops):
            for r in reads:
                for root in self.roots[r]:
                    last[root] = i
        output = {self.view.get(k, k) for k in outs}
        # jax writes an output into a donated argument of its size: that buffer holds nothing else
        free = list(argument_bytes) if donated else []
        paired = set()
        for k in outs:
            k = self.view.get(k, k)
            if k not in paired and not self.argument[k] and self.size[k] in free:
                free.remove(self.size[k])
                paired.add(k)
        # an elementwise result takes a dying operand's buffer of its size (one chain, one buffer)
        chain: dict[int, int] = {}
        taken: set[int] = set()
        first: dict[int, int] = {}
        for i, (reads, defined, _) in enumerate(self.ops):
            dying = [r for k in reads for r in self.roots[k] if last.get(r) == i and not self.argument[r]]
            for k in defined:
                if self.roots[k] != frozenset({k}) or not self.size[k]:
                    continue
                first[k] = i
                if not self.in_place[k] or k in paired:
                    continue
                for r in dying:
                    if r not in taken and r not in output and self.size[r] == self.size[k]:
                        taken.add(r)
                        chain[k] = chain.get(r, r)
                        break
        buffers: dict[int, list[Any]] = {}
        for k, i in first.items():
            if k in paired:
                continue
            b = buffers.setdefault(chain.get(k, k), [n, -1, 0, False])
            b[0], b[2] = min(b[0], i), max(b[2], self.size[k])
            b[1] = max(b[1], n if k in output else last.get(k, i))
            b[3] = b[3] or k in output
        allocations = [[a, size, []] for a, _, size, out in buffers.values() if out]
        outputs = sum(size for _, size, _ in allocations)
        heap = []
        for a, b, size, _ in sorted((x for x in buffers.values() if not x[3]), key=lambda x: -x[2]):
            fits = [
                o for o in allocations if o[1] >= size and o[0] >= b and all(y < a or x > b for x, y in o[2])
            ]
            if fits:
                min(fits, key=lambda o: o[1])[2].append((a, b))
            else:
                heap.append((a, b, size))
        delta = [0] * (n + 2)
        for a, b, size in heap:
            delta[a] += size
            delta[b + 1] -= size
        live = temporaries = 0
        for i, (_, _, inner) in enumerate(self.ops):
            live += delta[i]
            temporaries = max(temporaries, live + inner)
        return Memory(sum(argument_bytes), outputs, temporaries)


def _copies(eqn: Any, sizes: list[int], out: int) -> int:
    """Bytes of the copies XLA makes around a dot or a convolution to lay its operands (and a
    convolution's result) out as its kernel wants: a dot contracting the left's last dimension
    and the right's first after the batch, a convolution in NHWC, HWIO, NHWC order."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, rc), (_, rb) = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.ndim
        wanted = [
            tuple(lc) == tuple(range(lhs - len(lc), lhs)),
            tuple(rc) == tuple(range(len(rb), len(rb) + len(rc))),
        ]
        return sum(size for size, ok in zip(sizes, wanted, strict=True) if not ok)
    if name == "conv_general_dilated":
        lhs, rhs, result = eqn.params["dimension_numbers"]
        n = len(lhs)
        spatial = tuple(range(1, n - 1))
        copies = sizes[0] if tuple(lhs) != (0, n - 1, *spatial) else 0
        copies += sizes[1] if tuple(rhs) != (n - 1, n - 2, *range(n - 2)) else 0
        return copies + (out if tuple(result) != (0, n - 1, *spatial) else 0)
    return 0


def _sliced(eqn: Any) -> int:
    """How many of a scan's inputs it slices, one slice per step (its last inputs)."""
    if eqn.primitive.name != "scan":
        return 0
    if "num_consts" in eqn.params:
        return len(eqn.invars) - eqn.params["num_consts"] - eqn.params["num_carry"]
    try:  # jax 0.11-0.12: the inputs' tree, (consts, carry, xs)
        return len(eqn.params["ft_in"].update(list(eqn.invars)).unpack()[-1])
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0  # another jax: its slices not counted


def _loop_peak(body: Any, sliced: int = 0) -> int:
    """A loop body's (or branch's) own temporaries: what it keeps beyond its inputs and results.

    A scan's slice of its last ``sliced`` inputs is copied out where a dot or a collective reads it.
    """
    walk = _Walk()
    whole = len(body.invars) - sliced
    env = {v: walk.buffer(0, 1, argument=True) if i < whole else walk.virtual(_bytes(v.aval), 1, [])
           for i, v in enumerate(body.invars)}  # fmt: skip
    outs = walk.run(body, env)
    return walk.peak([walk.materialize(k) for k in outs], False, []).temporaries
