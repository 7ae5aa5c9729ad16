"""A step's peak memory per device, from its trace: a liveness walk over the jaxpr.

A model of what XLA keeps (which values it materializes, copies and combines), in the order
XLA's CPU scheduler runs them, packed as its buffer assigner packs them: its rules are
XLA:CPU's, measured against it. Other compilers (a TPU's) keep other buffers: there
``substrax.plan`` compiles each configuration instead. See the planning guide for the rules
and how close it comes.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax
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
# reductions XLA fuses their operands into (a collective reads them written out)
_REDUCTIONS = {
    "reduce", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin",
}  # fmt: skip
# what XLA's CPU compiler computes inside a reduction's YNNPACK kernel
_KERNEL = {
    "add", "add_any", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "square", "abs", "ceil",
    "floor", "round", "sign", "neg", "exp", "expm1", "log", "log1p", "logistic", "tanh", "erf", "sqrt",
    "rsqrt", "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "pvary",
}  # fmt: skip
_SHAPING = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "pvary"}
_SPREAD = {lax.broadcast_in_dim_p, lax.iota_p}  # operands XLA does not count as one more input
_BITCASTS = {"reshape", "squeeze", "expand_dims"}  # views XLA writes as an instruction of their own
_RELAID = {"all_gather": "all_gather_dimension", "reduce_scatter": "scatter_dimension"}
_ALIGN = 64  # bytes: XLA's CPU buffers start at multiples of it
_CALLS = {
    "jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "remat", "remat2", "checkpoint", "shard_map",
}  # fmt: skip
_RECOMPUTED = "rematted_computation"  # the name jax gives a forward pass recomputed under remat


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
        walk.parameter[env[v]] = len(walk.parameter)
    outs = walk.run(jaxpr.jaxpr, env)
    # jax hands an argument returned as it is back without the program
    given = set(jaxpr.jaxpr.invars)
    outs = [walk.materialize(k) for k, v in zip(outs, jaxpr.jaxpr.outvars, strict=True) if v not in given]
    return walk.peak(outs, donated, list(argument_bytes))


def _kernels(jaxpr: Any) -> tuple[dict[int, list[tuple[Any, Any]]], set[int]]:
    """The reductions XLA's CPU compiler runs as YNNPACK kernels, grown as XLA's library rewriter
    grows them (the last first): over an op feeding it that only it reads, down into the one op
    reading what it computes, merging kernels so met. Keyed by the op whose result the kernel
    writes (its last), with the ops grown over.

    A kernel's operands come each with the shape XLA broadcasts it to first (None: its own); a
    constant it reads written out comes as its ``_constants`` key."""
    eqns = jaxpr.eqns
    producer, users = {}, collections.defaultdict(set)
    for i, e in enumerate(eqns):
        producer.update(dict.fromkeys(e.outvars, i))
        for v in _vars(e.invars):
            users[v].add(i)
    for v in _vars(jaxpr.outvars):
        users[v].add(-1)
    regions: dict[int, set[int]] = {}  # a kernel's last op -> its ops
    owner: dict[int, int] = {}  # an op -> its kernel's last op

    def grows(j: int) -> bool:  # XLA: an op it offloads, arithmetic of 4,096 elements or more (or an operand)
        e = eqns[j]
        large = max(math.prod(getattr(v.aval, "shape", ())) for v in [*e.invars, *e.outvars]) >= 4096
        return e.primitive.name in _SHAPING or e.primitive.name in _KERNEL and large or _in_kernel(e)

    for i in reversed(range(len(eqns))):
        if i in owner or not _in_kernel(eqns[i]):
            continue
        region, todo = {i}, collections.deque([i])

        def join(j: int) -> None:
            if j in owner:  # another kernel: merged whole
                region.update(regions.pop(owner[j]))
            elif grows(j):
                region.add(j)
                todo.append(j)

        while todo:
            m = todo.popleft()
            for v in _vars(eqns[m].invars):
                p = producer.get(v)
                if p is not None and p not in region and all(
                    u in region for w in eqns[p].outvars for u in users[w]
                ):
                    join(p)
            (reader, *more) = {u for w in eqns[m].outvars for u in users[w]} or {-1}
            if not more and reader != -1 and reader not in region:  # the one op reading it (not a result)
                join(reader)
        regions[max(region)] = region
        owner.update(dict.fromkeys(region, max(region)))
    # the ops that broadcast a value to a shape: one broadcast in XLA's program, which a kernel
    # computes inside itself where it alone reads it, else reads written out (a divisor is not
    # one: XLA divides by a broadcast by multiplying with the broadcast of its reciprocal)
    spreads = collections.defaultdict(set)
    for j, e in enumerate(eqns):
        shape = getattr(e.outvars[0].aval, "shape", ()) if e.outvars else ()
        name = e.primitive.name
        for n, v in enumerate(e.invars):
            if (
                not isinstance(v, jcore.Literal) and v.aval.shape != shape and math.prod(v.aval.shape) > 1
                and (name == "broadcast_in_dim" or name in _FUSED - _JOINS and (name, n) != ("div", 1))
            ):  # fmt: skip
                spreads[v, shape].add(j)
    # the ops that read a constant at a shape: one broadcast of it in XLA's program too
    constants = collections.defaultdict(set)
    for j, e in enumerate(eqns):
        for key in _constants(e):
            constants[key].add(j)
    kernels: dict[int, list[tuple[Any, Any]]] = {}
    for last, region in regions.items():
        operands: dict[Any, Any] = {}
        for j in sorted(region):
            shape = eqns[j].outvars[0].aval.shape
            for v in _vars(eqns[j].invars):
                if producer.get(v) not in region and operands.get(v) is None:
                    broadcast = eqns[j].primitive.name in _KERNEL - _SHAPING and v.aval.shape != shape
                    shared = broadcast and not spreads[v, shape] <= region
                    operands[v] = shape if shared and math.prod(v.aval.shape) > 1 else None
            for key in _constants(eqns[j]):  # a constant another op reads too: written out
                if not constants[key] <= region:
                    operands[key] = key[1]
        kernels[last] = list(operands.items())
    return kernels, set(owner) - set(regions)


def _constants(eqn: Any) -> list[tuple[Any, ...]]:
    """The constants ``eqn`` reads broadcast to its result's shape, each as (value, shape, dtype):
    XLA writes one broadcast for all that read it (dividing by one, it multiplies by the
    reciprocal's)."""
    name, out = eqn.primitive.name, eqn.outvars[0].aval if eqn.outvars else None
    if not getattr(out, "shape", ()) or name not in _FUSED - _JOINS:
        return []
    found = []
    for n, v in enumerate(eqn.invars):
        if isinstance(v, jcore.Literal) and (name == "broadcast_in_dim" or np.shape(v.val) == ()):
            value = np.asarray(v.val).item()
            value = 1 / value if (name, n) == ("div", 1) and value else value
            found.append((value, out.shape, np.dtype(out.dtype).name))
    return found


def _unfusible(jaxpr: Any, kernels: dict[int, list[tuple[Any, Any]]]) -> set[Any]:
    """The fused values XLA writes once for all their readers: those a reader cannot fuse (a dot,
    a collective, a kernel) with more than one operand of their rank, holding more elements than
    they do (XLA will not duplicate those into its other readers)."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    blocked = {v for operands in kernels.values() for v, shape in operands if shape is None}
    for i, e in enumerate(jaxpr.eqns):
        name = e.primitive.name
        if i in kernels or name in _FUSED or name in _VIEW or name in _CALLS or _outer(e):
            continue
        if name not in _REDUCTIONS:
            blocked.update(_vars(e.invars))
    found = set()
    for v in blocked:
        e = producer.get(v)
        if e is None or len(e.outvars) != 1 or e.primitive.name not in _FUSED or _outer(e):
            continue
        rank = _true_rank(v.aval)
        large = [
            x for x in _vars(e.invars)
            if _true_rank(x.aval) >= rank and getattr(producer.get(x), "primitive", None) not in _SPREAD
        ]  # fmt: skip
        elements = sum(math.prod(getattr(x.aval, "shape", ())) for x in set(_vars(e.invars)))
        if len(large) > 1 and elements > math.prod(v.aval.shape):
            found.add(v)
    return found


def _scattered(jaxpr: Any) -> dict[int, int]:
    """The sums of a scatter-add into zeros and another value, each with its scatter-add: XLA
    scatters into the other value instead (its algebraic simplifier's rewrite)."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    readers = collections.defaultdict(set)
    for i, e in enumerate(jaxpr.eqns):
        for v in _vars(e.invars):
            readers[v].add(i)
    for v in _vars(jaxpr.outvars):
        readers[v].add(-1)

    def zeros(v: Any) -> bool:
        while not isinstance(v, jcore.Literal) and v in producer and producer[v].primitive.name in _VIEW:
            v = producer[v].invars[0]
        made = None if isinstance(v, jcore.Literal) else producer.get(v)
        if made is not None and made.primitive is lax.broadcast_in_dim_p:
            v = made.invars[0]
        return isinstance(v, jcore.Literal) and not np.any(v.val)

    into = {}
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive.name == "scatter-add" and len(readers[e.outvars[0]]) == 1 and zeros(e.invars[0]):
            (j,) = readers[e.outvars[0]]
            add = jaxpr.eqns[j] if j >= 0 else None
            shape = e.outvars[0].aval.shape
            if add and add.primitive.name in ("add", "add_any"):
                if all(v.aval.shape == shape for v in add.invars):
                    into[j] = i
    return into


def _true_rank(aval: Any) -> int:
    return sum(d > 1 for d in getattr(aval, "shape", ()))


_INLINED = _CALLS - {"remat", "checkpoint", "shard_map"}  # calls XLA inlines (and fuses across)


def _inline(jaxpr: Any) -> Any:
    """``jaxpr`` with the calls XLA inlines (``jit``, custom derivatives' primal calls) replaced
    by their bodies: XLA fuses across them."""
    if not any(e.primitive.name in _INLINED for e in jaxpr.eqns):
        return jaxpr
    eqns: list[Any] = []
    constvars = list(jaxpr.constvars)
    subst: dict[Any, Any] = {}

    def get(v: Any) -> Any:
        return v if isinstance(v, jcore.Literal) else subst.get(v, v)

    def add(body: Any, invars: Sequence[Any]) -> list[Any]:
        for bv, v in zip(body.invars, invars, strict=True):
            subst[bv] = get(v)
        constvars.extend(body.constvars)
        for e in body.eqns:
            if e.primitive.name in _INLINED:
                outs = add(_called(e), e.invars)
                for ov, v in zip(e.outvars, outs, strict=True):
                    if not isinstance(ov, jcore.DropVar):
                        subst[ov] = v
            else:  # fresh names: a body called twice is inlined twice
                outvars = [v if isinstance(v, jcore.DropVar) else jcore.Var(v.aval) for v in e.outvars]
                subst.update((v, w) for v, w in zip(e.outvars, outvars, strict=True) if v is not w)
                eqns.append(e.replace(invars=[get(v) for v in e.invars], outvars=outvars))
        return [get(v) for v in body.outvars]

    outvars = add(jaxpr, jaxpr.invars)
    return types.SimpleNamespace(invars=jaxpr.invars, constvars=constvars, eqns=eqns, outvars=outvars)


def _vars(vs: Sequence[Any]) -> list[Any]:
    return [v for v in vs if not isinstance(v, jcore.Literal)]


def _outer(eqn: Any) -> bool:
    """Whether ``eqn`` is a dot that contracts nothing: XLA multiplies broadcasts, fused."""
    if eqn.primitive.name != "dot_general":
        return False
    (contract, _), _ = eqn.params["dimension_numbers"]
    return math.prod(eqn.invars[0].aval.shape[d] for d in contract) == 1


def _in_kernel(eqn: Any) -> bool:
    """Whether XLA's CPU compiler runs the reduction ``eqn`` as a YNNPACK kernel."""
    kind = eqn.primitive.name
    if kind not in ("reduce_sum", "reduce_max", "reduce_min") or len(eqn.invars) != 1:
        return False
    if math.prod(eqn.invars[0].aval.shape) < 4096:  # XLA's least
        return False
    (x,), (out,) = eqn.invars, eqn.outvars
    if kind == "reduce_sum":
        return x.aval.dtype in (np.float32, np.float64) and out.aval.dtype == x.aval.dtype
    return kind in ("reduce_max", "reduce_min") and np.dtype(x.aval.dtype).kind == "f"


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
        # reads, defines, the op's own temporaries (a loop body's peak, a copy), "late" or ""
        self.ops: list[tuple[list[int], list[int], int, str]] = []
        self.size: dict[int, int] = {}  # bytes per device of a kept buffer (0: not kept)
        self.whole: dict[int, int] = {}  # the value's bytes as the jaxpr types it
        self.ways: dict[int, int] = {}  # whole / bytes per device
        self.roots: dict[int, frozenset[int]] = {}  # the kept buffers a value is computed from
        self.view: dict[int, int] = {}  # a value that is a kept buffer seen again -> that buffer
        self.in_place: dict[int, bool] = {}  # may take a dying operand's buffer
        self.argument: dict[int, bool] = {}
        self.combinable: dict[int, tuple[str, str]] = {}  # op -> (collective, axes)
        self.spread: dict[int, frozenset[int]] = {}  # a fused value -> its broadcast parts
        self.written: dict[Any, int] = {}  # a broadcast part (a kernel's: and its shape) -> its buffer
        self.materialized: dict[int, int] = {}  # a fused value -> the buffer it is written to
        self.dot: dict[int, int] = {}  # a dot's result -> the dot's op
        self.bitcast: dict[int, int] = {}  # a reshaped view -> the op that reshapes it
        self.parameter: dict[int, int] = {}  # an argument -> the parameter XLA reads it from
        self.recomputing = False  # the op being walked recomputes a forward pass under remat
        self.recomputed: set[int] = set()  # the buffers such ops keep (less the parameters they gather)
        self.gathered: set[int] = set()  # all-gathers' results, and their copies
        self.hold_recomputed = False  # a loop body: what it recomputes lives to its end (``_loop_peak``)

    def buffer(self, whole: int, ways: int, *, argument: bool = False, in_place: bool = False) -> int:
        k = len(self.size) + 1
        self.size[k], self.whole[k], self.ways[k] = whole // max(1, ways), whole, ways
        self.roots[k], self.argument[k], self.in_place[k] = frozenset({k}), argument, in_place
        if self.recomputing:
            self.recomputed.add(k)
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
        """``k`` as a buffer of its own, written once, where the first reader that cannot fuse reads it."""
        if self.kept(k):
            return k
        if k not in self.materialized:
            self.materialized[k] = self.buffer(self.whole[k], self.ways[k], in_place=True)
            if self.roots[k] & self.gathered:  # a gathered parameter written out: gathered
                self.gathered.add(self.materialized[k])
                self.recomputed.discard(self.materialized[k])
            self.ops.append(([k], [self.materialized[k]], 0, ""))
        return self.materialized[k]

    def kernel_input(self, k: int, v: Any, shape: tuple[int, ...] | None) -> int:
        """What a kernel reads for ``k``: it as a buffer, or ``shape``'s broadcast of it (XLA writes
        a broadcast once for all the kernels that read it)."""
        if shape is not None:
            key = (k, shape)
            if key not in self.written:
                whole = math.prod(shape) * np.dtype(v.aval.dtype).itemsize
                self.written[key] = self.buffer(whole, self.ways[k])
                self.ops.append(([k], [self.written[key]], 0, ""))
            return self.written[key]
        return k if self.kept(k) or not self.roots[k] else self.materialize(k)

    def constant(self, key: tuple[Any, ...]) -> int:
        """A constant's broadcast (value, shape, dtype), written once, first of all."""
        if key not in self.written:
            self.written[key] = self.buffer(math.prod(key[1]) * np.dtype(key[2]).itemsize, 1)
            self.ops.append(([], [self.written[key]], 0, ""))
        return self.written[key]

    def run(self, jaxpr: Any, env: dict[Any, int]) -> list[int]:
        jaxpr = _inline(jaxpr)
        for v in jaxpr.constvars:  # constants live in the program, not in its buffers
            env.setdefault(v, self.virtual(0, 1, []))
        kernels, inside = _kernels(jaxpr)
        unfusible = _unfusible(jaxpr, kernels)
        readers: dict[Any, int] = {}
        results = set(jaxpr.outvars)
        for e in jaxpr.eqns:
            for v in e.invars:
                if not isinstance(v, jcore.Literal):
                    readers[v] = readers.get(v, 0) + 1
        into = _scattered(jaxpr)
        for i, e in enumerate(jaxpr.eqns):
            name = e.primitive.name
            self.recomputing = name != "all_gather" and _RECOMPUTED in str(e.source_info.name_stack)
            vars_in = [v for v in e.invars if not isinstance(v, jcore.Literal)]
            reads = [env[v] for v in vars_in]
            if i in into.values():  # scattered into what its sum adds, there (below)
                parts = [self.materialize(env[v]) for v in _vars(e.invars[1:])]
                env[e.outvars[0]] = self.virtual(_bytes(e.outvars[0].aval), 1, parts)
                continue
            if name in _CALLS:
                self._call(e, env)
                continue
            if not e.outvars:  # nothing written (a loop's or cond's with no results)
                continue
            shape = getattr(e.outvars[0].aval, "shape", ())
            same = [
                self.ways[k]
                for k, v in zip(reads, vars_in, strict=True)
                if getattr(v.aval, "shape", None) == shape
            ]
            ways = max(same, default=1)  # a result is split as its operands of its shape are
            if name in _VIEW and not reads:  # a view of a literal: a constant XLA folds
                for v in e.outvars:
                    env[v] = self.virtual(0, 1, [])
                continue
            if name in _VIEW and i not in kernels:
                if name == "sharding_constraint":
                    ways = max(
                        1, math.prod(shape) // max(1, math.prod(e.params["sharding"].shard_shape(shape)))
                    )
                    if ways < self.ways[reads[0]]:  # gathered: a buffer of its own
                        k = self.buffer(_bytes(e.outvars[0].aval), ways)
                        self.ops.append(([self.materialize(reads[0])], [k], 0, ""))
                        env[e.outvars[0]] = k
                        continue
                for j, v in enumerate(e.outvars):
                    r = reads[min(j, len(reads) - 1)]
                    env[v] = self.virtual(
                        _bytes(v.aval), ways if name == "sharding_constraint" else self.ways[r], [r], view=r
                    )
                    self.spread[env[v]] = self.spread.get(r, frozenset())
                    if name in _BITCASTS and self.kept(r) and not self.argument[self.view.get(r, r)]:
                        if r in self.bitcast:  # XLA folds a bitcast of a bitcast into one
                            turn = self.bitcast[r]
                            self.ops[turn] = (self.ops[turn][0], [*self.ops[turn][1], env[v]], 0, "turn")
                        else:  # XLA's bitcast: an instruction
                            self.ops.append(([r], [env[v]], 0, "turn"))
                        self.bitcast[env[v]] = self.bitcast.get(r, len(self.ops) - 1)
                continue
            fused = i not in kernels and (name in _FUSED or i in inside or _outer(e))
            reduction = not fused and name in _REDUCTIONS
            if i in kernels:  # a kernel reads what it does not compute itself, written out
                reads = [
                    self.constant(v) if isinstance(v, tuple) else self.kernel_input(env[v], v, shape)
                    for v, shape in kernels[i]
                ]
            elif i in into:  # the scatter, into the other addend: a buffer of its own beside it
                fused = False
                scattered = env[jaxpr.eqns[into[i]].outvars[0]]
                reads = [k if k == scattered else self.materialize(k) for k in reads]
            elif not fused and not reduction:  # a reduction reads its operands' loops, fused
                reads = [self.materialize(k) for k in reads]
            copied, inner = _copies(e, _bytes(e.outvars[0].aval) // ways)
            for j in copied:  # a copy of an operand, written as soon as its operand is
                k = self.buffer(self.whole[reads[j]], self.ways[reads[j]])
                self.ops.append(([reads[j]], [k], 0, ""))
                reads[j] = k
            for sub in jcore.jaxprs_in_params(e.params):
                inner = max(inner, _loop_peak(getattr(sub, "jaxpr", sub), _sliced(e)))
            defined = []
            if reduction and i not in kernels:  # XLA writes out the broadcasts its reduction reads, early
                parts = sorted({b for k in reads for b in self.spread.get(k, ())})
                for b in parts:
                    if b not in self.written:
                        self.written[b] = self.buffer(self.whole[b], self.ways[b])
                        self.ops.append(([b], [self.written[b]], 0, ""))
                reads = reads + [self.written[b] for b in parts]
            stacked = e.outvars[len(e.outvars) - _stacked(e):]
            for v in e.outvars:
                if isinstance(v, jcore.DropVar):
                    continue
                if v in stacked and not readers.get(v) and v not in results:  # XLA drops it
                    env[v] = self.virtual(0, 1, [])
                    continue
                if v in stacked:  # a scan's stacked result: its buffer of zeros is made first of all
                    k = self.buffer(_bytes(v.aval), ways)
                    self.ops.append(([], [k], 0, ""))
                elif not fused or name in _EXPENSIVE and readers.get(v, 0) > 1 or v in unfusible:
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
            if name == "transpose":  # XLA folds it into the dot, a new instruction: its operands' last user
                for k in reads:
                    if k in self.dot:
                        self.ops[self.dot[k]] = (*self.ops[self.dot[k]][:3], "late")
            if name == "dot_general":
                self.dot.update(dict.fromkeys(defined, len(self.ops)))
            if name == "all_gather":
                self.gathered.update(defined)
            self.ops.append((reads, defined, inner, ""))
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
        producer = {k: i for i, op in enumerate(self.ops) for k in op[1]}
        return [
            {producer[r] for k in op[0] for r in self.roots[k] | {k} if producer.get(r, i) != i}
            for i, op in enumerate(self.ops)
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
            self.ops[group[-1]] = (reads, defined, 0, "")
            into.update(dict.fromkeys(group[:-1]))
        self.ops = [op for i, op in enumerate(self.ops) if i not in into]

    def schedule(self) -> None:
        """Order the ops breadth first, as XLA's CPU compiler orders a program with collectives:
        an op is queued once the ops it reads have run, an op's readers last first (XLA fuses
        from the program's end, and a fused reader joins its operand's users as it is made). An
        op that writes no buffer of its own takes no turn (a fused value: XLA computes it in its
        reader; a transposed dot result: XLA folds the transpose into the dot), but for a
        reshaped result (XLA's bitcast is an instruction); a dot whose result is transposed goes
        last among its operands' readers (the folded dot is a new instruction, their last user)."""
        needs = self._needs()
        n = len(self.ops)
        for i, op in enumerate(self.ops):  # a parameter is an instruction: n + its number
            needs[i] |= {n + self.parameter[r] for k in op[0] for r in self.roots[k] if r in self.parameter}
        waiting = [len(x) for x in needs]
        readers: dict[int, list[int]] = {}
        for i, x in enumerate(needs):
            for j in x:
                readers.setdefault(j, []).append(i)
        for j, rs in readers.items():
            rs.sort(key=lambda i: (self.ops[i][3] == "late", -i))
        parameters = sorted(set(self.parameter.values()))
        ready = collections.deque([i for i, w in enumerate(waiting) if not w] + [n + p for p in parameters])
        order = []
        while ready:
            i = ready.popleft()
            if i < n:
                order.append(i)
            now = []  # fused readers made ready: computed at once, in the readers' order
            for j in readers.get(i, []):
                waiting[j] -= 1
                if not waiting[j]:
                    _, defined, inner, tag = self.ops[j]
                    if not inner and tag != "turn" and all(self.roots[k] != frozenset({k}) for k in defined):
                        now.append(j)
                    else:
                        ready.append(j)
            ready.extendleft(reversed(now))
        if len(order) == len(self.ops):  # (always: the ops form a DAG)
            self.ops = [self.ops[i] for i in order]

    def prune(self, outs: list[int]) -> None:
        """Drop the ops no result depends on, as XLA removes dead code (a gather for a
        gradient nobody takes, its product)."""
        needed = {r for k in outs for r in self.roots[k] | {k, self.view.get(k, k)}}
        live = []
        for op in reversed(self.ops):
            if any(k in needed for k in op[1]):
                live.append(op)
                needed.update(r for k in op[0] for r in self.roots[k] | {k, self.view.get(k, k)})
        self.ops = live[::-1]

    def peak(self, outs: list[int], donated: bool, argument_bytes: list[int]) -> Memory:
        self.combine()
        self.prune(outs)
        self.schedule()
        n = len(self.ops)
        last: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            for r in op[0]:
                for root in self.roots[r]:
                    last[root] = i
        if self.hold_recomputed:  # XLA keeps the recomputed forward's values to the body's end
            last.update((k, n - 1) for k in self.recomputed if k in last)
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
        for i, (reads, defined, _, _) in enumerate(self.ops):
            dying = [r for k in reads for r in self.roots[k] if last.get(r) == i and not self.argument[r]]
            for k in defined:
                if self.roots[k] != frozenset({k}) or not self.size[k]:
                    continue
                if k in first:  # made before (a scan's stacked result): one buffer
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
        heap += [(i, i, op[2]) for i, op in enumerate(self.ops) if op[2]]
        return Memory(sum(argument_bytes), outputs, _heap_size(heap))


def _heap_size(intervals: list[tuple[int, int, int]]) -> int:
    """The size of the heap XLA's buffer assigner packs ``intervals`` (first op, last op, bytes)
    into: the largest first, each at the smallest gap left by those alive at the same time that
    fits it, else above them (a global decreasing-size best fit)."""
    intervals = sorted(intervals, key=lambda x: (-x[2], x[0] - x[1], x[0]))
    count = len(intervals)
    first, last, offset, size = (np.zeros(count, np.int64) for _ in range(4))
    top = 0
    for i, (a, b, bytes_) in enumerate(intervals):
        bytes_ = -(-bytes_ // _ALIGN) * _ALIGN
        alive = (first[:i] <= b) & (last[:i] >= a)
        lo, hi = offset[:i][alive], offset[:i][alive] + size[:i][alive]
        order = np.argsort(lo, kind="stable")
        lo, ends = lo[order], np.maximum.accumulate(hi[order]) if len(order) else hi
        starts = np.concatenate(([0], ends[:-1]))
        gaps = lo - starts
        fits = np.flatnonzero(gaps >= bytes_)
        at = int(starts[fits[np.argmin(gaps[fits])]]) if len(fits) else int(ends[-1]) if len(ends) else 0
        first[i], last[i], offset[i], size[i] = a, b, at, bytes_
        top = max(top, at + bytes_)
    return top


def _copies(eqn: Any, out: int) -> tuple[list[int], int]:
    """The operands XLA copies to lay a convolution's operands out as its kernel wants them (NHWC,
    HWIO), and the bytes of the copy of its result (to NHWC). A dot reads its operands as they lie."""
    name = eqn.primitive.name
    if name in _RELAID:  # XLA lays the gathered (scattered) dimension out major, copying both ways
        shape = eqn.invars[0].aval.shape
        return ([0], out) if math.prod(shape[: eqn.params[_RELAID[name]]]) > 1 else ([], 0)
    if name != "conv_general_dilated":
        return [], 0
    lhs, rhs, result = eqn.params["dimension_numbers"]
    n = len(lhs)
    spatial = tuple(range(1, n - 1))
    copied = [0] if tuple(lhs) != (0, n - 1, *spatial) else []
    copied += [1] if tuple(rhs) != (n - 1, n - 2, *range(n - 2)) else []
    return copied, out if tuple(result) != (0, n - 1, *spatial) else 0


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


def _stacked(eqn: Any) -> int:
    """How many of a scan's results it stacks, one slice per step (its last results)."""
    if eqn.primitive.name != "scan":
        return 0
    if "num_carry" in eqn.params:
        return len(eqn.outvars) - eqn.params["num_carry"]
    try:  # jax 0.11-0.12: the results' tree, (carry, ys)
        return len(eqn.params["ft_out"].update(list(eqn.outvars)).unpack()[-1])
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0  # another jax: made where the scan is


def _loop_peak(body: Any, sliced: int = 0) -> int:
    """A loop body's (or branch's) own temporaries: what it keeps beyond its inputs and results.

    A scan's slice of its last ``sliced`` inputs is copied out where a dot or a collective reads it.
    """
    walk = _Walk()
    walk.hold_recomputed = any(e.primitive.name in ("remat", "remat2", "checkpoint") for e in body.eqns)
    whole = len(body.invars) - sliced
    state = walk.buffer(0, 1, argument=True)  # the loop's state: one parameter, a tuple
    walk.parameter[state] = 0
    env = {v: state if i < whole else walk.virtual(_bytes(v.aval), 1, [state])
           for i, v in enumerate(body.invars)}  # fmt: skip
    outs = walk.run(body, env)
    return walk.peak([walk.materialize(k) for k in outs], False, []).temporaries
