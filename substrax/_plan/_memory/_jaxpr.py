"""Reading a jaxpr: its variables and their bytes, the calls it makes, a scan's slices."""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

__all__ = ["CALLS", "RECOMPUTED", "called", "inline", "nbytes", "sliced", "stacked", "variables"]

# the primitives that call a jaxpr of their own
CALLS = {
    "jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "remat", "remat2", "checkpoint", "shard_map",
}  # fmt: skip
INLINED = CALLS - {"remat", "checkpoint", "shard_map"}  # calls XLA inlines (and fuses across)
RECOMPUTED = "rematted_computation"  # the name jax gives a forward pass recomputed under remat


def variables(vs: Sequence[Any]) -> list[Any]:
    """``vs`` less the literals."""
    return [v for v in vs if not isinstance(v, jcore.Literal)]


def nbytes(aval: Any) -> int:
    """The bytes of a value typed ``aval`` (0 for one without a shape: a token)."""
    shape = getattr(aval, "shape", None)
    return 0 if shape is None else math.prod(shape) * aval.dtype.itemsize  # a key type has one too


def called(eqn: Any) -> Any:
    """The jaxpr a call ``eqn`` runs."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            return getattr(eqn.params[key], "jaxpr", eqn.params[key])
    raise KeyError(f"{eqn.primitive.name} has no jaxpr")


def inline(jaxpr: Any) -> Any:
    """``jaxpr`` with the calls XLA inlines (``jit``, custom derivatives' primal calls) replaced
    by their bodies: XLA fuses across them."""
    if not any(e.primitive.name in INLINED for e in jaxpr.eqns):
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
            if e.primitive.name in INLINED:
                outs = add(called(e), e.invars)
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


def sliced(eqn: Any) -> int:
    """How many of a scan's inputs it slices, one slice per step (its last inputs)."""
    if eqn.primitive.name != "scan":
        return 0
    if "num_consts" in eqn.params:
        return len(eqn.invars) - eqn.params["num_consts"] - eqn.params["num_carry"]
    try:  # jax 0.11-0.12: the inputs' tree, (consts, carry, xs)
        return len(eqn.params["ft_in"].update(list(eqn.invars)).unpack()[-1])
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0  # another jax: its slices not counted


def stacked(eqn: Any) -> int:
    """How many of a scan's results it stacks, one slice per step (its last results)."""
    if eqn.primitive.name != "scan":
        return 0
    if "num_carry" in eqn.params:
        return len(eqn.outvars) - eqn.params["num_carry"]
    try:  # jax 0.11-0.12: the results' tree, (carry, ys)
        return len(eqn.params["ft_out"].update(list(eqn.outvars)).unpack()[-1])
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0  # another jax: made where the scan is
