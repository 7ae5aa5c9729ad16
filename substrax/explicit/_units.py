"""FSDP units in the explicit step: a unit's split parameters gathered just in time, then released.

``run_unit`` is a custom VJP, under the scope ``substrax.unit``; see the layouts guide, "Units".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.custom_derivatives import SymbolicZero

from substrax._base import declared, scopes
from substrax._base.hooks import UNIT_HOOK
from substrax._base.trees import KeyPath, merged, node_at, path_str, picked
from substrax._layout import note_layers
from substrax._metrics.collectives import varying_axes, zeros_of_type
from substrax._shared.scatter import scatter_rows
from substrax.explicit._prefetch import prefetched_layers

__all__ = ["gather_grouped", "run_unit", "scatter_grouped", "units_running", "varying_other"]


_WRAPPED: dict[type, type] = {}


def _unit_class(cls: type) -> type:
    """``cls`` with its ``__call__`` run through ``run_unit`` (FSDP2's class swap)."""
    if cls not in _WRAPPED:

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            return run_unit(self, cls.__call__, args, kwargs)

        _WRAPPED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _WRAPPED[cls]


@contextlib.contextmanager
def units_running(model: nnx.Module, units: dict[KeyPath, bool], data_axis: str, plans: dict[KeyPath, Any],
                  split: set[KeyPath], param_dtype: Any = None, reduce_dtype: Any = None,
                  prefetch: set[KeyPath] = frozenset()) -> Iterator[None]:  # fmt: skip
    """Inside the step's ``shard_map``: every unit of ``model`` (a merged copy) runs through ``run_unit``.

    ``split``: the units' parameters that stay split until their unit runs; ``prefetch``:
    the units that ``substrax.nn.scan_layers`` runs one layer ahead (``_UnitRun.scan``).
    """
    swapped = []
    for path, reshard in units.items():
        node = node_at(model, path)
        run = _UnitRun(path, reshard, data_axis, plans, split, param_dtype, reduce_dtype)
        run.prefetch, run.call = path in prefetch, type(node).__call__
        for rel, variable in nnx.to_flat_state(nnx.state(node, nnx.Param)):
            if tuple(rel) in run.dims:
                run.shapes[tuple(rel)] = tuple(variable.get_value().shape)
        object.__setattr__(node, UNIT_HOOK, run)
        swapped.append((node, type(node)))
        object.__setattr__(node, "__class__", _unit_class(type(node)))
    try:
        yield
    finally:
        for node, cls in swapped:
            object.__setattr__(node, "__class__", cls)
            vars(node).pop(UNIT_HOOK, None)


class _UnitRun:
    def __init__(self, path: KeyPath, reshard: bool, axis: str, plans: dict[KeyPath, Any],
                 split: set[KeyPath], param_dtype: Any, reduce_dtype: Any) -> None:  # fmt: skip
        self.path, self.reshard, self.axis = path, reshard, axis
        self.dims = {p[len(path) :]: plans[p].gather_dim for p in split if p[: len(path)] == path}
        self.shapes: dict[KeyPath, tuple[int, ...]] = {}  # each split parameter's local shape, as placed
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.prefetch, self.call = False, None  # set by units_running

    def cast(self, xs: list[Any]) -> list[Any]:
        """``xs`` in the policy's ``param_dtype`` (the floating ones), as gathered."""
        if self.param_dtype is None:
            return xs
        return [x.astype(self.param_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs]

    def scan(
        self, module: nnx.Module, x: jax.Array, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> jax.Array:
        """``substrax.nn.scan_layers(module, x, *args, **kwargs)`` with ``prefetch``: layer i+1
        gathered while layer i runs (``substrax.explicit._prefetch``)."""
        graphdef, state = nnx.split(module)
        flat = list(nnx.to_flat_state(state))
        name = path_str(self.path, "model")
        for p, v in flat:
            if not isinstance(v, nnx.Param):
                raise ValueError(
                    f"FSDP unit {name} (prefetch=True) runs layers of parameters only; its "
                    f"{path_str(tuple(p), 'unit')} is an {type(v).__name__}. Place it with "
                    f"prefetch=False (scan_layers then runs nnx.scan)."
                )
        if not flat:
            raise ValueError(f"FSDP unit {name} (prefetch=True) holds no parameters to run.")
        layers = int(flat[0][1].get_value().shape[0])
        note_layers(self.path, layers)
        split_at = [i for i, (p, _) in enumerate(flat) if self.dims.get(tuple(p)) is not None]
        other_at = [i for i in range(len(flat)) if i not in set(split_at)]
        shards = [flat[i][1].get_value() for i in split_at]
        dims = [
            self.dim_of(tuple(flat[i][0]), tuple(s.shape[1:])) for i, s in zip(split_at, shards, strict=True)
        ]
        shapes = [tuple(s.shape[1:]) for s in shards]
        types = [varying_other(s, self.axis) for s in shards]
        in_arrays, rebuild = _array_args(args, kwargs)

        def apply(wholes: list[Any], others: list[Any], h: jax.Array, arrays: list[Any]) -> jax.Array:
            a, k = rebuild(arrays)
            return self.call(_merged_module(graphdef, flat, split_at, wholes, other_at, others), h, *a, **k)

        def gather(layer_shards: list[Any], anchor: Any) -> list[Any]:
            return gather_grouped(self.cast([_after(s, anchor) for s in layer_shards]), dims, self.axis)

        def scatter(grads: list[Any]) -> list[Any]:
            return scatter_grouped(grads, shapes, dims, self.axis, self.reduce_dtype, types)

        others = [flat[i][1].get_value() for i in other_at]
        return prefetched_layers(apply, gather, scatter, shards, others, x, in_arrays, layers)

    def dim_of(self, rel: KeyPath, shape: tuple[int, ...]) -> int:
        """The split dimension of the parameter at ``rel`` whose value (or one layer of it) has ``shape``.

        Inside ``nnx.scan`` over a stacked unit each call sees one layer: the placed
        shape without its leading (layer) axis, and the split dimension one lower.
        """
        placed, dim = self.shapes[rel], self.dims[rel]
        if shape == placed:
            return dim
        if shape == placed[1:] and dim > 0:
            note_layers(self.path, placed[0])  # for the census: gathered per layer, inside a loop
            return dim - 1
        raise ValueError(
            f"FSDP unit {path_str(self.path, 'model')}: its parameter {path_str(rel, 'unit')} has "
            f"local shape {placed} but the unit was called with {shape}. A stacked unit may be "
            f"applied whole or one layer at a time by nnx.scan over its leading axis (in_axes=0); "
            f"scan over axis 0, or name the layer module inside the stack as the unit."
        )


def _after(x: jax.Array, anchor: Any) -> jax.Array:
    """``x``, computed once ``anchor`` exists (by a leaf varying over no axis ``x`` does not)."""
    axes = varying_other(x, "")
    leaves = [
        a for a in jax.tree.leaves(anchor)
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact) and varying_other(a, "") <= axes
    ]  # fmt: skip
    if not leaves:
        return x
    first = jnp.ravel(leaves[0])[0]
    return x + (first * 0).astype(x.dtype)


def _groups(xs: list[jax.Array], types: list[Any]) -> list[list[int]]:
    """``xs``'s indices by ``types``: a buffer per dtype and set of other axes (``check_vma``)."""
    keys = [(x.dtype, t) for x, t in zip(xs, types, strict=True)]
    return [[i for i, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)]


def varying_other(x: jax.Array, axis: str) -> frozenset[str]:
    """The mesh axes other than ``axis`` that ``x`` varies over."""
    return (varying_axes(x) or frozenset()) - {axis}


def gather_grouped(
    shards: list[jax.Array], dims: list[int], axis: str, scope: str = scopes.UNIT
) -> list[jax.Array]:
    """Whole values of ``shards`` (split on ``dims`` over ``axis``): one all-gather per ``_groups`` group."""
    n = jax.lax.axis_size(axis)
    out: list[Any] = [None] * len(shards)
    for idx in _groups(shards, [varying_other(s, axis) for s in shards]):
        flat = jnp.concatenate([jnp.ravel(shards[i]) for i in idx])
        with jax.named_scope(scope):
            stacked = jax.lax.all_gather(flat, axis, axis=0, tiled=False)  # (n, total)
        at = 0
        for i in idx:
            shard, d = shards[i], dims[i]
            size = math.prod(shard.shape)
            piece = stacked[:, at : at + size].reshape(n, *shard.shape)
            at += size
            whole = jnp.moveaxis(piece, 0, d)
            out[i] = whole.reshape(*shard.shape[:d], n * shard.shape[d], *shard.shape[d + 1 :])
    return out


def scatter_grouped(grads: list[jax.Array], shapes: list[tuple[int, ...]], dims: list[int], axis: str,
                    dtype: Any, types: list[Any], scope: str = scopes.UNIT) -> list[jax.Array]:  # fmt: skip
    """The transpose of ``gather_grouped``: each whole gradient reduce-scattered to a shard of
    ``shapes``, one buffer per group (``types``: the other axes each one varies over)."""
    n = jax.lax.axis_size(axis)
    out: list[Any] = [None] * len(grads)
    moved = [g if dtype is None else g.astype(dtype) for g in grads]
    for idx in _groups(moved, types):
        rows = []
        for i in idx:
            g, d, shape = moved[i], dims[i], shapes[i]
            split = g.reshape(*shape[:d], n, shape[d], *shape[d + 1 :])
            rows.append(jnp.moveaxis(split, d, 0).reshape(n, -1))
        for i, flat in zip(idx, scatter_rows(rows, axis, scope), strict=True):
            out[i] = flat.reshape(shapes[i])
    return out


def _array_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[jax.Array], Any]:
    """The arrays among a call's arguments, and ``rebuild(arrays) -> (args, kwargs)`` with the rest
    as given."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    def rebuild(arrays: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        new = list(leaves)
        for i, a in zip(at, arrays, strict=True):
            new[i] = a
        return jax.tree.unflatten(tree, new)

    return [leaves[i] for i in at], rebuild


def _merged_module(graphdef: Any, flat: list[Any], split_at: list[int], wholes: list[Any],
                   other_at: list[int], others: list[Any]) -> nnx.Module:  # fmt: skip
    """The module of ``graphdef`` over ``flat``'s variables, valued ``wholes`` at ``split_at`` and
    ``others`` at ``other_at``."""
    values: list[Any] = [None] * len(flat)
    for i, value in [*zip(split_at, wholes, strict=True), *zip(other_at, others, strict=True)]:
        values[i] = value
    return nnx.merge(
        graphdef, nnx.from_flat_state([(p, v.replace(x)) for (p, v), x in zip(flat, values, strict=True)])
    )


def _retraced(traced: list[Any]) -> int:
    """Forget what a unit call's last trace recorded (``traced``); the recorder's length now, -1: none."""
    records = declared.recorder()
    if records is None:
        return -1
    if traced:
        records[:] = [r for r in records if all(r is not q for q in traced)]
        traced.clear()
    return len(records)


def _traced(traced: list[Any], start: int) -> None:
    """Keep in ``traced`` what the trace begun at ``start`` recorded."""
    records = declared.recorder()
    if records is not None and start >= 0:
        traced.extend(records[start:])


def run_unit(module: nnx.Module, call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``module`` (a unit) on ``args``, its split parameters gathered just in time (layouts guide)."""
    run: _UnitRun = vars(module)[UNIT_HOOK]
    if run.prefetch:
        raise ValueError(
            f"FSDP unit {path_str(run.path, 'model')} was placed with prefetch=True but called "
            f"directly (or inside nnx.scan): prefetch "
            f"gathers the next layer of a stacked unit that substrax.nn.scan_layers runs. Run the "
            f"stack with substrax.nn.scan_layers(stack, x), or place it with prefetch=False."
        )
    c = _UnitCall(module, run, call, args, kwargs)
    unit = jax.custom_vjp(c.primal)
    unit.defvjp(c.forward, c.backward, symbolic_zeros=True)
    out, rest = unit(c.shards, c.others, c.in_arrays)
    rest_at = [i for i in c.other_at if not isinstance(c.flat[i][1], nnx.Param)]
    for i, value in zip(rest_at, rest, strict=True):
        c.flat[i][1].set_value(value)
    nnx.update(module, nnx.from_flat_state(c.flat))
    return out


class _UnitCall:
    """One call of a unit: its state as the split parameters (``shards``) and the rest (``others``),
    and the custom VJP's rules, which gather the shards just in time and reduce-scatter their gradient."""

    def __init__(self, module: nnx.Module, run: _UnitRun, call: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:  # fmt: skip
        self.run, self.call = run, call
        self.graphdef, state = nnx.split(module)
        self.flat = flat = list(nnx.to_flat_state(state))
        self.split_at = split_at = [
            i
            for i, (p, v) in enumerate(flat)
            if isinstance(v, nnx.Param) and run.dims.get(tuple(p)) is not None
        ]
        self.other_at = [i for i in range(len(flat)) if i not in set(split_at)]
        self.shards = shards = [flat[i][1].get_value() for i in split_at]
        self.dims = [
            run.dim_of(tuple(flat[i][0]), tuple(s.shape)) for i, s in zip(split_at, shards, strict=True)
        ]
        self.shapes = [tuple(s.shape) for s in shards]
        self.shard_dtypes = [s.dtype for s in shards]
        self.shard_types = [varying_other(s, run.axis) for s in shards]
        self.others = [flat[i][1].get_value() for i in self.other_at]
        self.in_arrays, self.rebuild = _array_args(args, kwargs)
        # What this call's latest trace recorded: jax traces the primal alone where the unit is not
        # differentiated (a pipeline's forward slot), ``forward`` alone under AD, both where AD
        # follows a staged trace (a scan's body), ``forward`` twice for a scan's tangents: each trace
        # records the layers' collectives anew, in place of the last one's.
        self.traced: list[Any] = []
        self.layout: dict[str, Any] = {}  # a trace's static facts: the residuals' layout, what is perturbed

    def apply(self, wholes: list[Any], others: list[Any], arrays: list[Any]) -> tuple[Any, list[Any]]:
        """The unit's call on its whole parameters: ``(out, the state other than nnx.Param after)``."""
        m = _merged_module(self.graphdef, self.flat, self.split_at, wholes, self.other_at, others)
        a, k = self.rebuild(arrays)
        out = self.call(m, *a, **k)
        after = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(m))]
        return out, [after[i] for i in self.other_at if not isinstance(self.flat[i][1], nnx.Param)]

    def gathered(self, shards: list[Any], anchor: Any) -> list[Any]:
        """The whole parameters of ``shards``, gathered after ``anchor`` is computed."""
        return gather_grouped(self.run.cast([_after(s, anchor) for s in shards]), self.dims, self.run.axis)

    def primal(self, shards: list[Any], others: list[Any], arrays: list[Any]) -> tuple[Any, list[Any]]:
        start = _retraced(self.traced)
        out = self.apply(self.gathered(shards, arrays), others, arrays)
        _traced(self.traced, start)
        return out

    def forward(self, shards: list[Any], others: list[Any], arrays: list[Any]) -> tuple[Any, Any]:
        start = _retraced(self.traced)
        try:
            return self._forward(shards, others, arrays)
        finally:
            _traced(self.traced, start)

    def _forward(self, shards: list[Any], others: list[Any], arrays: list[Any]) -> tuple[Any, Any]:
        # each input arrives as CustomVJPPrimal(value, perturbed) (symbolic_zeros=True): the VJP
        # is taken with respect to the perturbed ones only, so a unit whose input needs no
        # gradient (the batch) transposes nothing of that path, as AD without a unit would not
        layout = self.layout
        shards = [p.value for p in shards]
        layout["others"] = [p.perturbed for p in others]
        layout["arrays"] = [p.perturbed for p in arrays]
        o_vals, a_vals = [p.value for p in others], [p.value for p in arrays]

        def call(w: list[Any], o: list[Any], a: list[Any]) -> tuple[Any, list[Any]]:
            return self.apply(w, merged(o_vals, layout["others"], o), merged(a_vals, layout["arrays"], a))

        wholes = self.gathered(shards, a_vals)
        o_in, a_in = picked(o_vals, layout["others"]), picked(a_vals, layout["arrays"])
        out, vjp = jax.vjp(call, wholes, o_in, a_in)
        layout["out"] = [jax.typeof(x) for x in jax.tree.leaves(out)]
        if not self.run.reshard:
            return out, (shards, vjp)
        ids = {id(w): i for i, w in enumerate(wholes)}
        leaves, layout["tree"] = jax.tree.flatten(vjp)
        layout["where"] = where = [ids.get(id(x), -1) for x in leaves]
        return out, (shards, [None if w >= 0 else x for x, w in zip(leaves, where)])

    def backward(self, res: Any, ct: Any) -> tuple[Any, Any, Any]:
        shards, vjp = res
        layout = self.layout
        leaves, tree = jax.tree.flatten(ct, is_leaf=lambda c: isinstance(c, SymbolicZero))
        ct = jax.tree.unflatten(tree, [zeros_of_type(a) if isinstance(c, SymbolicZero) else c
                                       for c, a in zip(leaves, layout["out"], strict=True)])  # fmt: skip
        if self.run.reshard:  # the parameters again, once the cotangent exists
            tree, where = layout["tree"], layout["where"]
            wholes = self.gathered(shards, ct)
            vjp = jax.tree.unflatten(tree, [wholes[w] if w >= 0 else x for x, w in zip(vjp, where)])
        d_wholes, d_others, d_arrays = vjp(ct)
        d_shards = scatter_grouped(d_wholes, self.shapes, self.dims, self.run.axis, self.run.reduce_dtype,
                                   self.shard_types)  # fmt: skip
        d_shards = [g.astype(dt) for g, dt in zip(d_shards, self.shard_dtypes, strict=True)]
        return (
            d_shards,
            merged([None] * len(layout["others"]), layout["others"], d_others),
            merged([None] * len(layout["arrays"]), layout["arrays"], d_arrays),
        )
