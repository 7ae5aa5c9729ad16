"""What each device holds inside the explicit step's ``shard_map``, and what it hands back.

Parameters in as placed, whole and varying inside; gradients reduced once; other state
made one model's again; random streams per device. See the modes guide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax._base import declared, scopes
from substrax._base.specs import spec_axes
from substrax._base.trees import KeyPath, PyTree, path_str
from substrax._layout import STAGE_AXIS, ParamSplit, check_declared_rank, declared_spec, spec_tuple
from substrax._metrics.collectives import to_varying, to_varying_over, varying_axes
from substrax._shared.scatter import from_tiles, tiled, to_tiles
from substrax.explicit._units import gather_grouped, scatter_grouped, varying_other

__all__ = [
    "cast_like",
    "check_layers_take_blocks",
    "check_placement",
    "check_reduced_over_other_axes",
    "fold_in_each",
    "gather_whole_varying",
    "param_vars",
    "per_device_random_streams",
    "reduce_gradients",
    "settle_per_device_state",
    "varying_carry",
    "without_axis_specs",
]


def check_layers_take_blocks(model: nnx.Module, data_axis: str) -> None:
    """Refuse a flax layer whose parameter is split over a mesh axis other than ``data_axis``.

    Inside the step's ``shard_map`` each device holds only its block of such a
    parameter; flax's own layers (``nnx.Linear``, ``nnx.Embed``, ...) compute with whole
    arrays and never communicate, so they would fail on the shapes or, worse, return
    one block's result. ``substrax.nn``'s layers, and a user's own, are written for
    blocks (a result still split at the loss is refused by
    ``check_reduced_over_other_axes``).
    """
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or not type(node).__module__.startswith("flax."):
            continue
        for name, variable in vars(node).items():
            if not isinstance(variable, nnx.Param):
                continue
            spec = spec_tuple(variable) or ()
            # (the pipeline's split of a stack's layer axis: nnx.scan hands each layer whole arrays)
            others = [
                a
                for d, e in enumerate(spec)
                for a in spec_axes(e)
                if a != data_axis and (d, a) != (0, STAGE_AXIS)
            ]
            if others:
                raise ValueError(
                    f"{path_str((*path, name), 'model')} is sharded as {PartitionSpec(*spec)}, over mesh "
                    f"axis {others[0]!r}, but it belongs to a {type(node).__module__.split('.')[0]} "
                    f"{type(node).__name__}, which computes with whole arrays: inside the explicit "
                    f"step's shard_map each device holds only its block of it. Build the layer from "
                    f"substrax.nn (ColumnParallelLinear, RowParallelLinear, ParallelSelfAttention, "
                    f"ParallelEmbedding), or use mode='implicit', where XLA follows any sharding."
                )


def check_placement(model: nnx.Module) -> None:
    """Refuse a variable split on the devices as its ``out_sharding`` metadata does not say (outside jit)."""
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        check_declared_rank(variable, declared_spec(variable) or (), path_str(tuple(path), "model"))
        sharding = getattr(variable.get_value(), "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.is_fully_replicated:
            continue
        declared = spec_tuple(variable)
        said = NamedSharding(sharding.mesh, PartitionSpec(*(declared or ())))
        if declared is None or not said.is_equivalent_to(sharding, variable.get_value().ndim):
            raise ValueError(
                f"{path_str(tuple(path), 'model')} is sharded as {sharding.spec}, but its variable "
                f"does not say so (out_sharding={declared}), and the explicit step reads the "
                f"layout from it. Split the state with substrax.shard_state(model, "
                f"optimizer), replicate the variable (NamedSharding(mesh, PartitionSpec())), "
                f"or use mode='implicit', where XLA follows the parameters' shardings."
            )


def check_reduced_over_other_axes(loss: Any, metrics: Any, data_axis: str) -> None:
    """Refuse a loss or metric that still varies over a mesh axis other than ``data_axis``.

    On a ``(data, model)`` mesh every device of a ``model`` group sees the same rows, so
    the loss must come out the same on each: a value still varying over ``model`` is a
    partial result some layer left unreduced (``check_vma`` types it, so this cannot miss).
    """
    named = [("the loss", loss)] + [
        (f"metric {jax.tree_util.keystr(path)}", v)
        for path, v in jax.tree_util.tree_flatten_with_path(metrics)[0]
    ]
    for name, value in named:
        others = sorted(a for a in varying_axes(value) or () if a not in spec_axes(data_axis))
        if others:
            raise ValueError(
                f"{name} still varies over mesh axis {others[0]!r}: a layer split over "
                f"{others[0]!r} left its partial results unreduced, so each device of a "
                f"{others[0]!r} group would report a different value. End a column-parallel layer "
                f"with a row-parallel one (substrax.nn.RowParallelLinear), or reduce the value with "
                f"jax.lax.psum/all_gather over {others[0]!r}."
            )


def param_vars(model: nnx.Module) -> dict[KeyPath, nnx.Variable[Any]]:
    return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def gather_whole_varying(
    model: nnx.Module,
    plans: Mapping[KeyPath, ParamSplit],
    data_axis: str,
    dtype: Any = None,
    grouped: bool = False,
    rows: str | tuple[str, ...] | None = None,
) -> dict[KeyPath, Any]:
    """Give every parameter its whole value, varying over ``data_axis``; return what it held.

    ``dtype``: cast floating parameters to it first, so a split one is gathered in it.
    ``grouped``: the split ones gathered together (the root unit beside FSDP units: one
    all-gather per dtype and set of other axes), else one all-gather each. ``rows``: the
    axes the batch is split over (with a replica axis, every parameter varies over it
    too, so the gradient is reduced across replicas once, by ``reduce_gradients``).
    """
    held, values, split = {}, {}, []
    for path, variable in param_vars(model).items():
        value = held[path] = variable.get_value()
        if dtype is not None and jnp.issubdtype(value.dtype, jnp.floating):
            value = value.astype(dtype)
        dim = plans[path].gather_dim
        if dim is not None:
            split.append(path)
            if not grouped:
                with jax.named_scope(scopes.GATHER_PARAMS):
                    value = jax.lax.all_gather(value, data_axis, axis=dim, tiled=True)
        elif data_axis not in (varying_axes(value) or ()):
            value = to_varying(value, data_axis)
        values[path] = value
    if grouped and split:
        dims = [plans[p].gather_dim for p in split]
        wholes = gather_grouped([values[p] for p in split], dims, data_axis, scopes.GATHER_PARAMS)
        values.update(zip(split, wholes, strict=True))
    for path, variable in param_vars(model).items():
        variable.set_value(values[path] if rows is None else to_varying_over(values[path], rows))
    return held


def reduce_gradients(
    grads: nnx.State,
    plans: Mapping[KeyPath, ParamSplit],
    data_axis: str,
    done: frozenset[KeyPath] | set[KeyPath] = frozenset(),
    grouped: bool = False,
    replicas: tuple[str, ...] = (),
) -> nnx.State:
    """The once-per-step reduction: psum the whole-updated gradients, psum_scatter the split ones.

    ``done``: paths whose gradient is already reduced over ``data_axis`` (an FSDP unit's,
    in its backward). ``grouped``: the split ones reduce-scattered together (the root
    unit, as ``gather_whole_varying`` gathers them), else one reduce-scatter each.
    ``replicas``: the replica axes of hybrid sharding: the whole gradients are summed over
    them with ``data_axis`` (one all-reduce), and every slice is then summed across them
    in one all-reduce at its slice's size.
    """
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(grads)]
    whole = [i for i, (p, _) in enumerate(flat) if plans[p].update_dim is None and p not in done]
    split = [i for i, (p, _) in enumerate(flat) if plans[p].update_dim is not None and p not in done]
    over = (*replicas, data_axis) if replicas else data_axis
    values = [flat[i][1].get_value() for i in whole]
    flatten = bool(replicas) and tiled() and whole  # on a TPU, across slices: each flat, the barriers
    with jax.named_scope(scopes.GRAD_REDUCE):  # keeping it so (a stacked norm's [2, 256]: the compiler
        if flatten:  # refused its own reduce-scatter of it; census guide, "Across slices")
            values = jax.lax.optimization_barrier([jnp.ravel(v) for v in values])
        summed = jax.lax.psum(values, over) if whole else []
        if flatten:
            summed = jax.lax.optimization_barrier(summed)
    out = {i: v.reshape(flat[i][1].get_value().shape) for i, v in zip(whole, summed, strict=True)}
    out.update({i: v.get_value() for i, (p, v) in enumerate(flat) if p in done})
    if split and (grouped or tiled()):  # on a TPU each its own group, in tiles (_shared.scatter)
        n = jax.lax.axis_size(data_axis)
        values = [flat[i][1].get_value() for i in split]
        dims = [plans[flat[i][0]].update_dim for i in split]
        shapes = [tuple(s // n if d == k else s for k, s in enumerate(v.shape)) for v, d in zip(values, dims)]
        types = [varying_other(v, data_axis) for v in values]
        groups = [list(range(len(split)))] if grouped else [[j] for j in range(len(split))]
        for g in groups:
            reduced = scatter_grouped([values[j] for j in g], [shapes[j] for j in g], [dims[j] for j in g],
                                      data_axis, None, [types[j] for j in g], scopes.GRAD_REDUCE)  # fmt: skip
            out.update(zip([split[j] for j in g], reduced, strict=True))
    else:
        with jax.named_scope(scopes.GRAD_REDUCE):
            for i in split:
                out[i] = jax.lax.psum_scatter(
                    flat[i][1].get_value(),
                    data_axis,
                    scatter_dimension=plans[flat[i][0]].update_dim,
                    tiled=True,
                )
    sliced = sorted({*split, *(i for i, (p, _) in enumerate(flat) if p in done)})
    if replicas and sliced:  # across replicas, once, at the slices' size (on a TPU as whole tiles)
        axis = replicas if len(replicas) > 1 else replicas[0]
        values = [out[i] for i in sliced]
        with jax.named_scope(scopes.GRAD_REDUCE):  # (the barriers keep the TPU compiler from summing
            if tiled():  # the slices in their own shapes, padded in its layout)
                values = jax.lax.optimization_barrier([to_tiles(v) for v in values])
            summed = jax.lax.psum(values, axis)
            if tiled():
                summed = jax.lax.optimization_barrier(summed)
        out.update(
            {i: from_tiles(v, out[i].shape) if tiled() else v for i, v in zip(sliced, summed, strict=True)}
        )
    return nnx.from_flat_state([(p, v.replace(out[i])) for i, (p, v) in enumerate(flat)])


def without_axis_specs(specs: PyTree, axis: str) -> PyTree:
    """``specs`` with ``axis`` dropped from every entry (on a size-1 axis: the same placement)."""

    def drop(spec: PartitionSpec) -> PartitionSpec:
        def entry(e: Any) -> Any:
            if isinstance(e, tuple):
                kept = tuple(a for a in e if a != axis)
                return kept or None
            return None if e == axis else e

        return PartitionSpec(*(entry(e) for e in spec))

    return jax.tree.map(drop, specs, is_leaf=lambda s: isinstance(s, PartitionSpec))


@contextlib.contextmanager
def per_device_random_streams(model: nnx.Module, data_axis: str | tuple[str, ...]) -> Iterator[None]:
    """Fold each device's index into every ``nnx.Rngs`` key for one step; keys restored after.

    A stacked stream (``nnx.split_rngs``: one key per layer) has the index folded into each
    of its keys, so every layer keeps its own stream on every device.
    """
    keys = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.RngKey)]
    saved = [key.get_value() for key in keys]
    index = jax.lax.axis_index(data_axis)
    for key, value in zip(keys, saved, strict=True):
        key.set_value(fold_in_each(value, index))
    try:
        yield
    finally:
        for key, value in zip(keys, saved, strict=True):
            key.set_value(value)


def fold_in_each(keys: jax.Array, data: Any) -> jax.Array:
    """``jax.random.fold_in(key, data)`` for each key of the key array ``keys`` (of any shape)."""
    flat = keys.reshape(-1)
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(flat, data).reshape(keys.shape)


def settle_per_device_state(state: nnx.State, specs: Any, data_axis: str | tuple[str, ...]) -> nnx.State:
    """Average ``nnx.BatchStat`` over ``data_axis``; refuse other replicated state that varies."""

    def settle(path: tuple[Any, ...], variable: nnx.Variable[Any], spec: Any) -> nnx.Variable[Any]:
        value = variable.get_value()
        axes = varying_axes(value)
        over = tuple(a for a in spec_axes(data_axis) if axes is not None and a in axes)
        if not over or any(
            e is not None for e in (spec.get_value() if isinstance(spec, nnx.Variable) else spec)
        ):
            return variable
        if isinstance(variable, nnx.BatchStat) and jnp.issubdtype(value.dtype, jnp.inexact):
            with jax.named_scope(scopes.BATCH_STATS):
                return variable.replace(jax.lax.pmean(value, over if len(over) > 1 else over[0]))
        raise ValueError(
            f"{path_str(path, 'model')} ({type(variable).__name__}, {value.dtype}) came out of the "
            f"step different on each device, and it is replicated: substrax averages only "
            f"nnx.BatchStat state (statistics a layer computes from its shard). Compute it from "
            f"values reduced over {data_axis!r} (jax.lax.pmean), declare it an nnx.BatchStat if "
            f"a per-device average is what it means, or keep it out of the model's state."
        )

    return jax.tree.map_with_path(settle, state, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))


def varying_carry(
    body: Callable[..., Any], carry: Any, piece: PyTree, data_axis: str | tuple[str, ...]
) -> Any:
    """``carry`` with every leaf that ``body`` returns varying over ``data_axis`` cast to varying.

    ``lax.scan`` needs a carry of one type in and out; a BatchNorm without
    ``axis_name`` turns its replicated statistics into per-device ones in the body.
    """
    with declared.silenced():  # a trace for shapes: the loop's own trace collects the declarations
        out = jax.eval_shape(body, carry, piece)[0]
    cast = [
        bool(set(spec_axes(data_axis)) & set(getattr(getattr(o, "manual_axis_type", None), "varying", ())))
        for o in jax.tree.leaves(out)
    ]
    leaves, treedef = jax.tree.flatten(carry)
    return jax.tree.unflatten(
        treedef, [to_varying_over(x, data_axis) if c else x for x, c in zip(leaves, cast, strict=True)]
    )


def cast_like(grads: nnx.State, held: Mapping[KeyPath, Any]) -> nnx.State:
    """``grads`` with each leaf cast to the dtype of the parameter ``held`` at its path."""
    return nnx.from_flat_state(
        [(p, v.replace(v.get_value().astype(held[tuple(p)].dtype))) for p, v in nnx.to_flat_state(grads)]
    )
