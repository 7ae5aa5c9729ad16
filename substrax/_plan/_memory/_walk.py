"""The walk: a jaxpr read equation by equation into the program XLA compiles it to (which
values it keeps, copies and fuses, by the compiler's rules), then that program's peak."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from jax.extend import core as jcore

from substrax._plan._memory import _passes
from substrax._plan._memory import xla_cpu as rules  # the compiler modelled (the only one written)
from substrax._plan._memory._heap import Memory, peak
from substrax._plan._memory._jaxpr import (
    CALLS,
    RECOMPUTED,
    called,
    inline,
    nbytes,
    sliced,
    stacked,
    variables,
)
from substrax._plan._memory._program import Op, Program

__all__ = ["Memory", "estimate", "loop_peak"]


def estimate(jaxpr: jcore.ClosedJaxpr, argument_bytes: Sequence[int], *, donated: bool = False) -> Memory:
    """The peak of the program ``jaxpr`` compiles to, given each argument's bytes per device.

    ``donated``: the arguments are donated, so an output of an argument's size is written
    into its buffer (as jax pairs them) and counts nothing more.
    """
    walk = Walk()
    env = {}
    for v, size in zip(jaxpr.jaxpr.invars, argument_bytes, strict=True):
        env[v] = walk.buffer(nbytes(v.aval), nbytes(v.aval) // size if size else 1, argument=True)
        walk.parameter[env[v]] = len(walk.parameter)
    outs = walk.run(jaxpr.jaxpr, env)
    # jax hands an argument returned as it is back without the program
    given = set(jaxpr.jaxpr.invars)
    outs = [walk.materialize(k) for k, v in zip(outs, jaxpr.jaxpr.outvars, strict=True) if v not in given]
    return _peak(walk, outs, list(argument_bytes), donated=donated)


def loop_peak(body: Any, sliced: int = 0) -> int:
    """A loop body's (or branch's) own temporaries: what it keeps beyond its inputs and results.

    A scan's slice of its last ``sliced`` inputs is copied out where a dot or a collective reads it.
    """
    walk = Walk()
    walk.hold_recomputed = any(e.primitive.name in ("remat", "remat2", "checkpoint") for e in body.eqns)
    whole = len(body.invars) - sliced
    state = walk.buffer(0, 1, argument=True)  # the loop's state: one parameter, a tuple
    walk.parameter[state] = 0
    env = {v: state if i < whole else walk.virtual(nbytes(v.aval), 1, [state])
           for i, v in enumerate(body.invars)}  # fmt: skip
    outs = walk.run(body, env)
    return _peak(walk, [walk.materialize(k) for k in outs], [], donated=False).temporaries


def _peak(program: Program, outs: list[int], argument_bytes: list[int], *, donated: bool) -> Memory:
    """The peak of ``program`` returning ``outs``, after XLA's passes and its scheduler."""
    _passes.combine(program)
    _passes.prune(program, outs)
    rules.schedule(program)
    return peak(program, outs, argument_bytes, donated=donated, align=rules.ALIGN)


class _Facts(NamedTuple):
    """What the walk reads off a whole jaxpr before its equations."""

    kernels: rules.Kernels  # the compiler's library kernels, by their last op
    inside: set[int]  # the ops a kernel computes inside itself
    unfusible: set[Any]  # fused values written once for all their readers
    readers: dict[Any, int]  # a value -> how many equations read it
    results: set[Any]  # the jaxpr's results
    into: dict[int, int]  # a sum -> the scatter-add scattered into its other addend


def _facts(jaxpr: Any) -> _Facts:
    kernels, inside = rules.kernels(jaxpr)
    readers: dict[Any, int] = {}
    for e in jaxpr.eqns:
        for v in variables(e.invars):
            readers[v] = readers.get(v, 0) + 1
    unfusible = rules.unfusible(jaxpr, kernels)
    return _Facts(kernels, inside, unfusible, readers, set(jaxpr.outvars), rules.scattered(jaxpr))


class Walk(Program):
    """A program written by walking a jaxpr."""

    def __init__(self) -> None:
        super().__init__()
        self.spread: dict[int, frozenset[int]] = {}  # a fused value -> its broadcast parts
        self.dot: dict[int, int] = {}  # a dot's result -> the dot's op
        self.bitcast: dict[int, int] = {}  # a reshaped view -> the op that reshapes it

    def run(self, jaxpr: Any, env: dict[Any, int]) -> list[int]:
        """Walk ``jaxpr`` with its inputs' values in ``env``; its results' values."""
        jaxpr = inline(jaxpr)
        for v in jaxpr.constvars:  # constants live in the program, not in its buffers
            env.setdefault(v, self.virtual(0, 1, []))
        facts = _facts(jaxpr)
        for i, e in enumerate(jaxpr.eqns):
            name = e.primitive.name
            self.recomputing = name != "all_gather" and RECOMPUTED in str(e.source_info.name_stack)
            vars_in = variables(e.invars)
            reads = [env[v] for v in vars_in]
            if i in facts.into.values():  # scattered into what its sum adds, there (below)
                parts = [self.materialize(env[v]) for v in variables(e.invars[1:])]
                env[e.outvars[0]] = self.virtual(nbytes(e.outvars[0].aval), 1, parts)
            elif name in CALLS:
                self._call(e, env)
            elif name in rules.VIEW and not reads:  # a view of a literal: a constant XLA folds
                for v in e.outvars:
                    env[v] = self.virtual(0, 1, [])
            elif name in rules.VIEW and i not in facts.kernels:
                self._view(e, env, reads)
            elif not e.outvars:  # nothing written (a loop's or cond's with no results)
                continue
            else:
                shape = getattr(e.outvars[0].aval, "shape", ())
                same = [
                    self.ways[k]
                    for k, v in zip(reads, vars_in, strict=True)
                    if getattr(v.aval, "shape", None) == shape
                ]
                ways = max(same, default=1)  # a result is split as its operands of its shape are
                self._op(i, e, env, reads, ways, facts, jaxpr)
        return [self.virtual(0, 1, []) if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]

    def _call(self, e: Any, env: dict[Any, int]) -> None:
        """A call: its body walked in place (a ``shard_map``'s values typed per device)."""
        body = called(e)
        shard_map = e.primitive.name == "shard_map"
        inner = {}
        for sv, v in zip(body.invars, e.invars, strict=True):
            if isinstance(v, jcore.Literal):
                inner[sv] = self.virtual(0, 1, [])
            elif shard_map:  # the same buffer, typed per device
                inner[sv] = self.virtual(nbytes(sv.aval), 1, [env[v]], view=env[v])
            else:
                inner[sv] = env[v]
        for v, sv, k in zip(e.outvars, body.outvars, self.run(body, inner), strict=True):
            if shard_map:
                ways = max(1, nbytes(v.aval) // max(1, nbytes(sv.aval)))
                env[v] = self.virtual(nbytes(v.aval), ways, [k], view=k)
            else:
                env[v] = k

    def _view(self, e: Any, env: dict[Any, int], reads: list[int]) -> None:
        """A view: its operand's buffer seen again (a sharding constraint that gathers: a copy;
        a reshape: XLA's bitcast, an instruction of its own)."""
        name = e.primitive.name
        ways = 0
        if name == "sharding_constraint":
            shape = e.outvars[0].aval.shape
            ways = max(1, math.prod(shape) // max(1, math.prod(e.params["sharding"].shard_shape(shape))))
            if ways < self.ways[reads[0]]:  # gathered: a buffer of its own
                k = self.buffer(nbytes(e.outvars[0].aval), ways)
                self.ops.append(Op([self.materialize(reads[0])], [k]))
                env[e.outvars[0]] = k
                return
        for j, v in enumerate(e.outvars):
            r = reads[min(j, len(reads) - 1)]
            env[v] = self.virtual(nbytes(v.aval), ways or self.ways[r], [r], view=r)
            self.spread[env[v]] = self.spread.get(r, frozenset())
            if name in rules.BITCASTS and self.kept(r) and not self.argument[self.view.get(r, r)]:
                if r in self.bitcast:  # XLA folds a bitcast of a bitcast into one
                    turn = self.ops[self.bitcast[r]]
                    self.ops[self.bitcast[r]] = Op(turn.reads, [*turn.defines, env[v]], 0, "turn")
                else:  # XLA's bitcast: an instruction
                    self.ops.append(Op([r], [env[v]], 0, "turn"))
                self.bitcast[env[v]] = self.bitcast.get(r, len(self.ops) - 1)

    def _op(
        self, i: int, e: Any, env: dict[Any, int], reads: list[int], ways: int, facts: _Facts, jaxpr: Any
    ) -> None:
        """Any other equation: what it reads written out, its copies, its results kept or fused."""
        name = e.primitive.name
        fused = i not in facts.kernels and (name in rules.FUSED or i in facts.inside or rules.outer(e))
        reduction = not fused and name in rules.REDUCTIONS
        if i in facts.kernels:  # a kernel reads what it does not compute itself, written out
            reads = [
                self.constant(v) if isinstance(v, tuple) else self.kernel_input(env[v], v, shape)
                for v, shape in facts.kernels[i]
            ]
        elif i in facts.into:  # the scatter, into the other addend: a buffer of its own beside it
            fused = False
            scattered = env[jaxpr.eqns[facts.into[i]].outvars[0]]
            reads = [k if k == scattered else self.materialize(k) for k in reads]
        elif not fused and not reduction:  # a reduction reads its operands' loops, fused
            reads = [self.materialize(k) for k in reads]
        copied, inner = rules.copies(e, nbytes(e.outvars[0].aval) // ways)
        for j in copied:  # a copy of an operand, written as soon as its operand is
            k = self.buffer(self.whole[reads[j]], self.ways[reads[j]])
            self.ops.append(Op([reads[j]], [k]))
            reads[j] = k
        for sub in jcore.jaxprs_in_params(e.params):
            inner = max(inner, loop_peak(getattr(sub, "jaxpr", sub), sliced(e)))
        if reduction and i not in facts.kernels:  # XLA writes out the broadcasts its reduction reads, early
            reads = reads + self._broadcasts(reads)
        defined = self._results(e, env, reads, ways, fused, facts)
        if name in rules.REDUCES:  # XLA combines the all-reduces that do not depend on each other
            self.combinable[len(self.ops)] = (name, str(e.params.get("axes", e.params.get("axis_name"))))
        if name == "transpose":  # XLA folds it into the dot, a new instruction: its operands' last user
            for k in reads:
                if k in self.dot:
                    self.ops[self.dot[k]] = self.ops[self.dot[k]]._replace(tag="late")
        if name == "dot_general":
            self.dot.update(dict.fromkeys(defined, len(self.ops)))
        if name == "all_gather":
            self.gathered.update(defined)
        self.ops.append(Op(reads, defined, inner))

    def _broadcasts(self, reads: list[int]) -> list[int]:
        """The broadcasts ``reads`` are computed from, each written out once."""
        parts = sorted({b for k in reads for b in self.spread.get(k, ())})
        for b in parts:
            if b not in self.written:
                self.written[b] = self.buffer(self.whole[b], self.ways[b])
                self.ops.append(Op([b], [self.written[b]]))
        return [self.written[b] for b in parts]

    def _results(
        self, e: Any, env: dict[Any, int], reads: list[int], ways: int, fused: bool, facts: _Facts
    ) -> list[int]:
        """The values ``e`` defines: each kept in a buffer, or fused into its readers."""
        name, defined = e.primitive.name, []
        stacks = e.outvars[len(e.outvars) - stacked(e) :]
        for v in e.outvars:
            if isinstance(v, jcore.DropVar):
                continue
            if v in stacks and not facts.readers.get(v) and v not in facts.results:  # XLA drops it
                env[v] = self.virtual(0, 1, [])
                continue
            if v in stacks:  # a scan's stacked result: its buffer of zeros is made first of all
                k = self.buffer(nbytes(v.aval), ways)
                self.ops.append(Op([], [k]))
            elif not fused or name in rules.EXPENSIVE and facts.readers.get(v, 0) > 1 or v in facts.unfusible:
                k = self.buffer(nbytes(v.aval), ways, in_place=fused)
            else:
                k = self._fused(name, nbytes(v.aval), ways, reads)
            env[v] = k
            defined.append(k)
        return defined

    def _fused(self, name: str, whole: int, ways: int, reads: list[int]) -> int:
        """A fused result, kept in no buffer, with the broadcasts it is computed from."""
        k = self.virtual(whole, ways, reads, view=reads[0] if name == "transpose" else None)
        # a broadcast (an elementwise op's size-1 dimensions too) of a value, not of a constant
        # (XLA folds those), or the broadcasts it reads
        if (
            (reads or name == "iota")
            and name not in rules.JOINS
            and all(self.whole[r] < self.whole[k] or r in self.spread.get(r, ()) for r in reads)
        ):
            self.spread[k] = frozenset({k})
        else:
            self.spread[k] = frozenset().union(*(self.spread.get(r, ()) for r in reads))
        return k
