"""XLA:CPU's rules, as the walk reads them: which values it fuses and which it keeps, the
reductions it runs as YNNPACK kernels, the copies its layouts ask for, the order its scheduler
runs a program in, its buffers' alignment. Each was measured against XLA:CPU's compiled
programs (``tests/test_plan.py``; the planning guide's table)."""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np
from jax import lax
from jax.extend import core as jcore

from substrax._plan._memory._jaxpr import CALLS, variables
from substrax._plan._memory._program import Program

__all__ = [
    "ALIGN", "BITCASTS", "EXPENSIVE", "FUSED", "JOINS", "REDUCES", "REDUCTIONS", "VIEW",
    "Kernels", "constants", "copies", "kernels", "outer", "scattered", "schedule", "unfusible",
]  # fmt: skip

# results that are their operand's buffer seen again
VIEW = {
    "pvary", "reshape", "squeeze", "expand_dims", "sharding_constraint", "copy", "copy_p", "stop_gradient",
    "optimization_barrier", "mesh_cast", "reshard", "device_put",
}  # fmt: skip
# fused results XLA will not compute again for a second reader (it keeps them)
EXPENSIVE = {
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "div", "pow", "sqrt", "rsqrt", "cbrt", "erf",
    "erfc", "erf_inv", "sin", "cos", "tan", "atan2", "rem", "lgamma", "digamma", "asin", "acos", "atan",
    "sinh", "cosh", "asinh", "acosh", "atanh", "logaddexp",
}  # fmt: skip
# results XLA computes inside their reader's loop (fused), kept only where a reader cannot fuse
FUSED = EXPENSIVE | {
    "add", "sub", "mul", "neg", "max", "min", "select_n", "convert_element_type", "broadcast_in_dim",
    "integer_pow", "abs", "sign", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "is_finite",
    "square", "add_any", "iota", "transpose", "concatenate", "slice", "dynamic_slice", "pad", "clamp",
    "floor", "ceil", "round", "one_minus_square", "nextafter", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "rev", "stack", "split", "reduce_precision", "clz", "real",
    "imag", "conj", "complex",
}  # fmt: skip
JOINS = {"concatenate", "pad", "stack"}  # fused results larger than their operands, not broadcasts
REDUCES = {"psum", "psum_invariant"}  # the all-reduces XLA combines
# reductions XLA fuses their operands into (a collective reads them written out)
REDUCTIONS = {
    "reduce", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin",
}  # fmt: skip
BITCASTS = {"reshape", "squeeze", "expand_dims"}  # views XLA writes as an instruction of their own
ALIGN = 64  # bytes: XLA's CPU buffers start at multiples of it
# what XLA's CPU compiler computes inside a reduction's YNNPACK kernel
_KERNEL = {
    "add", "add_any", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "square", "abs", "ceil",
    "floor", "round", "sign", "neg", "exp", "expm1", "log", "log1p", "logistic", "tanh", "erf", "sqrt",
    "rsqrt", "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "pvary",
}  # fmt: skip
_KERNEL_LEAST = 4096  # elements: the least a reduction (or an op a kernel grows over) XLA offloads holds
_SHAPING = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "pvary"}
_SPREAD = {lax.broadcast_in_dim_p, lax.iota_p}  # operands XLA does not count as one more input
_RELAID = {"all_gather": "all_gather_dimension", "reduce_scatter": "scatter_dimension"}

Kernels = dict[int, list[tuple[Any, Any]]]  # a kernel's last op -> its operands, each with a shape or None


def kernels(jaxpr: Any) -> tuple[Kernels, set[int]]:
    """The reductions XLA's CPU compiler runs as YNNPACK kernels, grown as XLA's library rewriter
    grows them (the last first): over an op feeding it that only it reads, down into the one op
    reading what it computes, merging kernels so met. Keyed by the op whose result the kernel
    writes (its last), with the ops grown over.

    A kernel's operands come each with the shape XLA broadcasts it to first (None: its own); a
    constant it reads written out comes as its ``constants`` key."""
    eqns = jaxpr.eqns
    producer, users = {}, collections.defaultdict(set)
    for i, e in enumerate(eqns):
        producer.update(dict.fromkeys(e.outvars, i))
        for v in variables(e.invars):
            users[v].add(i)
    for v in variables(jaxpr.outvars):
        users[v].add(-1)
    regions, owner = _regions(eqns, producer, users)
    spreads = _spreads(eqns)
    # the ops that read a constant at a shape: one broadcast of it in XLA's program too
    reading = collections.defaultdict(set)
    for j, e in enumerate(eqns):
        for key in constants(e):
            reading[key].add(j)
    found: Kernels = {}
    for last, region in regions.items():
        operands: dict[Any, Any] = {}
        for j in sorted(region):
            shape = eqns[j].outvars[0].aval.shape
            for v in variables(eqns[j].invars):
                if producer.get(v) not in region and operands.get(v) is None:
                    broadcast = eqns[j].primitive.name in _KERNEL - _SHAPING and v.aval.shape != shape
                    shared = broadcast and not spreads[v, shape] <= region
                    operands[v] = shape if shared and math.prod(v.aval.shape) > 1 else None
            for key in constants(eqns[j]):  # a constant another op reads too: written out
                if not reading[key] <= region:
                    operands[key] = key[1]
        found[last] = list(operands.items())
    return found, set(owner) - set(regions)


def _regions(eqns: list[Any], producer: dict[Any, int], users: dict[Any, set[int]]) -> tuple[dict, dict]:
    """Each kernel's ops, keyed by its last (-> its ops), and each op's kernel (-> its last op)."""
    regions: dict[int, set[int]] = {}
    owner: dict[int, int] = {}

    def grows(j: int) -> bool:  # XLA: an op it offloads, arithmetic of 4,096 elements or more (or an operand)
        e = eqns[j]
        large = max(math.prod(getattr(v.aval, "shape", ())) for v in [*e.invars, *e.outvars]) >= _KERNEL_LEAST
        return e.primitive.name in _SHAPING or e.primitive.name in _KERNEL and large or _in_kernel(e)

    for i in reversed(range(len(eqns))):
        if i in owner or not _in_kernel(eqns[i]):
            continue
        region, todo = {i}, collections.deque([i])

        def join(j: int) -> None:
            if j in owner:  # another kernel: merged whole
                region.update(regions.pop(owner[j]))  # noqa: B023 (called inside this iteration)
            elif grows(j):
                region.add(j)  # noqa: B023
                todo.append(j)  # noqa: B023

        while todo:
            m = todo.popleft()
            for v in variables(eqns[m].invars):
                p = producer.get(v)
                if (
                    p is not None
                    and p not in region
                    and all(u in region for w in eqns[p].outvars for u in users[w])
                ):
                    join(p)
            (reader, *more) = {u for w in eqns[m].outvars for u in users[w]} or {-1}
            if not more and reader != -1 and reader not in region:  # the one op reading it (not a result)
                join(reader)
        regions[max(region)] = region
        owner.update(dict.fromkeys(region, max(region)))
    return regions, owner


def _spreads(eqns: list[Any]) -> dict[tuple[Any, Any], set[int]]:
    """The ops that broadcast a value to a shape: one broadcast in XLA's program, which a kernel
    computes inside itself where it alone reads it, else reads written out (a divisor is not
    one: XLA divides by a broadcast by multiplying with the broadcast of its reciprocal)."""
    spreads = collections.defaultdict(set)
    for j, e in enumerate(eqns):
        shape = getattr(e.outvars[0].aval, "shape", ()) if e.outvars else ()
        name = e.primitive.name
        for n, v in enumerate(e.invars):
            if (
                not isinstance(v, jcore.Literal) and v.aval.shape != shape and math.prod(v.aval.shape) > 1
                and (name == "broadcast_in_dim" or name in FUSED - JOINS and (name, n) != ("div", 1))
            ):  # fmt: skip
                spreads[v, shape].add(j)
    return spreads


def constants(eqn: Any) -> list[tuple[Any, ...]]:
    """The constants ``eqn`` reads broadcast to its result's shape, each as (value, shape, dtype):
    XLA writes one broadcast for all that read it (dividing by one, it multiplies by the
    reciprocal's)."""
    name, out = eqn.primitive.name, eqn.outvars[0].aval if eqn.outvars else None
    if not getattr(out, "shape", ()) or name not in FUSED - JOINS:
        return []
    found = []
    for n, v in enumerate(eqn.invars):
        if isinstance(v, jcore.Literal) and (name == "broadcast_in_dim" or np.shape(v.val) == ()):
            value = np.asarray(v.val).item()
            value = 1 / value if (name, n) == ("div", 1) and value else value
            found.append((value, out.shape, np.dtype(out.dtype).name))
    return found


def unfusible(jaxpr: Any, kernels: Kernels) -> set[Any]:
    """The fused values XLA writes once for all their readers: those a reader cannot fuse (a dot,
    a collective, a kernel) with more than one operand of their rank, holding more elements than
    they do (XLA will not duplicate those into its other readers)."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    blocked = {v for operands in kernels.values() for v, shape in operands if shape is None}
    for i, e in enumerate(jaxpr.eqns):
        name = e.primitive.name
        if i in kernels or name in FUSED or name in VIEW or name in CALLS or outer(e):
            continue
        if name not in REDUCTIONS:
            blocked.update(variables(e.invars))
    found = set()
    for v in blocked:
        e = producer.get(v)
        if e is None or len(e.outvars) != 1 or e.primitive.name not in FUSED or outer(e):
            continue
        rank = _true_rank(v.aval)
        large = [
            x for x in variables(e.invars)
            if _true_rank(x.aval) >= rank and getattr(producer.get(x), "primitive", None) not in _SPREAD
        ]  # fmt: skip
        elements = sum(math.prod(getattr(x.aval, "shape", ())) for x in set(variables(e.invars)))
        if len(large) > 1 and elements > math.prod(v.aval.shape):
            found.add(v)
    return found


def scattered(jaxpr: Any) -> dict[int, int]:
    """The sums of a scatter-add into zeros and another value, each with its scatter-add: XLA
    scatters into the other value instead (its algebraic simplifier's rewrite)."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    readers = collections.defaultdict(set)
    for i, e in enumerate(jaxpr.eqns):
        for v in variables(e.invars):
            readers[v].add(i)
    for v in variables(jaxpr.outvars):
        readers[v].add(-1)

    def zeros(v: Any) -> bool:
        while not isinstance(v, jcore.Literal) and v in producer and producer[v].primitive.name in VIEW:
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


def outer(eqn: Any) -> bool:
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
    if math.prod(eqn.invars[0].aval.shape) < _KERNEL_LEAST:  # XLA's least
        return False
    (x,), (out,) = eqn.invars, eqn.outvars
    if kind == "reduce_sum":
        return x.aval.dtype in (np.float32, np.float64) and out.aval.dtype == x.aval.dtype
    return kind in ("reduce_max", "reduce_min") and np.dtype(x.aval.dtype).kind == "f"


def copies(eqn: Any, out: int) -> tuple[list[int], int]:
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


def schedule(program: Program) -> None:
    """Order the ops breadth first, as XLA's CPU compiler orders a program with collectives:
    an op is queued once the ops it reads have run, an op's readers last first (XLA fuses
    from the program's end, and a fused reader joins its operand's users as it is made). An
    op that writes no buffer of its own takes no turn (a fused value: XLA computes it in its
    reader; a transposed dot result: XLA folds the transpose into the dot), but for a
    reshaped result (XLA's bitcast is an instruction); a dot whose result is transposed goes
    last among its operands' readers (the folded dot is a new instruction, their last user)."""
    ops, roots, needs = program.ops, program.roots, program.needs()
    n = len(ops)
    for i, op in enumerate(ops):  # a parameter is an instruction: n + its number
        needs[i] |= {n + program.parameter[r] for k in op.reads for r in roots[k] if r in program.parameter}
    waiting = [len(x) for x in needs]
    readers: dict[int, list[int]] = {}
    for i, x in enumerate(needs):
        for j in x:
            readers.setdefault(j, []).append(i)
    for rs in readers.values():
        rs.sort(key=lambda i: (ops[i].tag == "late", -i))
    parameters = sorted(set(program.parameter.values()))
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
                op = ops[j]
                fused = all(roots[k] != frozenset({k}) for k in op.defines)
                if not op.temporaries and op.tag != "turn" and fused:
                    now.append(j)
                else:
                    ready.append(j)
        ready.extendleft(reversed(now))
    if len(order) == n:  # (always: the ops form a DAG)
        program.ops = [ops[i] for i in order]
