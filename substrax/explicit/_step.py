"""The explicit data-parallel step: the same step as ``spmd_train_step``, under ``jax.shard_map``.

Every collective the step runs is written here. Each device sees its shard of the batch;
the loss is ``pmean``-ed over the data axis before ``grad``. The parameters are cast to
varying over the axis first (``to_varying``: no communication), so ``grad`` itself
runs no collective and each device holds its shard's share of the gradient; the step
then reduces it once, in plain sight:

- a replicated parameter's gradient is ``psum``-ed (one all-reduce);
- a split one (``substrax.shard_state``) is ``psum_scatter``-ed (a reduce-scatter):
  each device gets the slice its optimizer state updates. Under FSDP the parameter
  was ``all_gather``-ed right before use; under ZeRO-1 the updated slices are gathered
  back into the replicated parameter after the update.

With ``microbatches=k`` the gradient part runs in a ``lax.scan`` over k slices of each
device's shard and accumulates the local gradients; the reduction above still runs
once, after the loop. ``check_vma=True`` is pinned, since the gradient rule depends on
it (see ``substrax.explicit._grad``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax._collectives import gather_invariant, to_varying
from substrax._layout import optimizer_mirrors, spec_tuple, split_dim_of
from substrax._microbatch import check_microbatches, fold_microbatch_metrics, split_microbatches
from substrax._placement import batch_partition_specs
from substrax._reductions import split_loss_output
from substrax._tree import PyTree, is_array, path_str
from substrax.explicit._grad import data_parallel_value_and_grad, varying_axes
from substrax.explicit._metrics import reduce_metrics_collective
from substrax.mesh import current_mesh
from substrax.spmd._metrics import reduce_metrics

__all__ = ["explicit_train_step", "explicit_value_and_grad"]

M = TypeVar("M", bound=nnx.Module)
BatchSpec = PartitionSpec | NamedSharding | PyTree
Path = tuple[Any, ...]


def _split_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., tuple[Any, Any]]:
    if has_aux:
        return loss_fn
    return lambda model, batch: (loss_fn(model, batch), {})


@dataclasses.dataclass(frozen=True)
class _ParamPlan:
    """How one parameter is held and updated.

    ``gather_dim``: the parameter is stored split on it (FSDP) and gathered before use.
    ``update_dim``: the optimizer updates a slice on it (FSDP and ZeRO-1), so the
    gradient is reduce-scattered on it; ``None``: all-reduced, updated whole.
    """

    gather_dim: int | None
    update_dim: int | None


def check_data_axis_only(tree: Any, data_axis: str, owner: str) -> None:
    """Refuse a variable declared sharded over any mesh axis but ``data_axis``, naming it."""
    for path, variable in nnx.to_flat_state(nnx.state(tree)):
        spec = spec_tuple(variable)
        others = [e for e in spec or () if e is not None and split_dim_of((e,), data_axis) is None]
        if others:
            raise ValueError(
                f"{path_str(tuple(path), owner)} is sharded as {PartitionSpec(*(spec or ()))}, over mesh axis "
                f"{others[0]!r}; the explicit step splits state only over the data axis "
                f"{data_axis!r} (substrax.shard_state). Replicate it over {others[0]!r}, or use "
                f"mode='implicit', where XLA follows any sharding."
            )


def _plans(model: nnx.Module, optimizer: nnx.Optimizer[Any] | None, data_axis: str) -> dict[Path, _ParamPlan]:
    """Each parameter's ``_ParamPlan``, read from the ``out_sharding`` metadata of it and its mirrors."""
    check_data_axis_only(model, data_axis, "model")
    params = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    if optimizer is None:
        mirrors: dict[Path, tuple[Path, ...]] = {p: () for p in params}
        opt_vars: dict[Path, Any] = {}
    else:
        check_data_axis_only(optimizer, data_axis, "optimizer")
        mirrors = optimizer_mirrors(model, optimizer)
        opt_vars = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(optimizer))}
    plans = {}
    for path, variable in params.items():
        gather = split_dim_of(spec_tuple(variable), data_axis)
        dims = {split_dim_of(spec_tuple(opt_vars[m]), data_axis) for m in mirrors.get(path, ())}
        if len(dims) > 1 or (gather is not None and dims and dims != {gather}):
            raise ValueError(
                f"{path_str(path, 'model')} is split on dimension {gather} but its optimizer "
                f"state on {sorted(d for d in dims if d is not None)}; place both with "
                f"substrax.shard_state so they agree."
            )
        update = gather if gather is not None else next(iter(dims), None)
        plans[path] = _ParamPlan(gather, update)
    return plans


def _param_vars(model: nnx.Module) -> dict[Path, nnx.Variable[Any]]:
    return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _set_whole_varying(
    model: nnx.Module, plans: Mapping[Path, _ParamPlan], data_axis: str
) -> dict[Path, Any]:
    """Give every parameter its whole value, varying over ``data_axis``; return what it held."""
    held = {}
    for path, variable in _param_vars(model).items():
        value = held[path] = variable.get_value()
        dim = plans[path].gather_dim
        if dim is not None:
            whole = jax.lax.all_gather(value, data_axis, axis=dim, tiled=True)
        elif data_axis in (varying_axes(value) or ()):
            whole = value
        else:
            whole = to_varying(value, data_axis)
        variable.set_value(whole)
    return held


def _reduce_gradients(grads: nnx.State, plans: Mapping[Path, _ParamPlan], data_axis: str) -> nnx.State:
    """The once-per-step reduction: psum the whole-updated gradients, psum_scatter the split ones."""
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(grads)]
    whole = [i for i, (p, _) in enumerate(flat) if plans[p].update_dim is None]
    summed = jax.lax.psum([flat[i][1].get_value() for i in whole], data_axis) if whole else []
    out = {}
    for i, value in zip(whole, summed, strict=True):
        out[i] = value
    for i, (path, variable) in enumerate(flat):
        dim = plans[path].update_dim
        if dim is not None:
            out[i] = jax.lax.psum_scatter(variable.get_value(), data_axis, scatter_dimension=dim, tiled=True)
    return nnx.from_flat_state([(p, v.replace(out[i])) for i, (p, v) in enumerate(flat)])


def _slice_for_update(value: Any, dim: int, data_axis: str) -> Any:
    """This device's slice of a replicated array along ``dim`` (ZeRO-1's update view)."""
    size = value.shape[dim] // jax.lax.axis_size(data_axis)
    return jax.lax.dynamic_slice_in_dim(value, jax.lax.axis_index(data_axis) * size, size, axis=dim)


def _without_axis(specs: PyTree, axis: str) -> PyTree:
    """``specs`` with ``axis`` dropped from every entry (on a size-1 axis: the same placement)."""

    def drop(spec: PartitionSpec) -> PartitionSpec:
        def entry(e: Any) -> Any:
            if isinstance(e, tuple):
                kept = tuple(a for a in e if a != axis)
                return kept or None
            return None if e == axis else e

        return PartitionSpec(*(entry(e) for e in spec))

    return jax.tree.map(drop, specs, is_leaf=lambda s: isinstance(s, PartitionSpec))


def _reduce_metrics_on_one_device(
    metrics: Mapping[str, Any], reduce: Mapping[str, str | None] | None
) -> dict[str, Any]:
    """What ``reduce_metrics_collective`` gives over a size-1 axis, without a collective."""
    ops = dict(reduce or {})
    out = reduce_metrics(metrics, reduce)
    return {n: v[None] if n in ops and ops[n] is None and is_array(v) else v for n, v in out.items()}


@contextlib.contextmanager
def _per_device_random_streams(model: nnx.Module, data_axis: str) -> Iterator[None]:
    """Give each device its own random bits for one step: fold its index into every key.

    The model's ``nnx.Rngs`` are replicated, so without this every device would draw
    the same dropout mask for its shard. The keys are restored afterwards (only the
    streams' counts advance, equally on every device), so the state stays replicated.
    """
    keys = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.RngKey)]
    saved = [key.get_value() for key in keys]
    index = jax.lax.axis_index(data_axis)
    for key, value in zip(keys, saved, strict=True):
        key.set_value(jax.random.fold_in(value, index))
    try:
        yield
    finally:
        for key, value in zip(keys, saved, strict=True):
            key.set_value(value)


def _average_per_device_state(state: nnx.State, specs: Any, data_axis: str) -> nnx.State:
    """Average, over ``data_axis``, any replicated state the step updated from this device's shard.

    Parameters and optimizer state come out equal on every device (or split as
    placed). State a layer updates from the batch it sees (BatchNorm's running
    statistics) differs per device and could not leave ``shard_map`` as replicated;
    the average keeps one model.
    """

    def average(path: tuple[Any, ...], x: jax.Array, spec: PartitionSpec) -> jax.Array:
        axes = varying_axes(x)
        if axes is None or data_axis not in axes or any(e is not None for e in spec):
            return x
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, data_axis)
        owner = ("model", "optimizer")[path[0].key]  # nnx.state((model, optimizer)) keys them 0, 1
        raise ValueError(
            f"{path_str(path[1:], owner)} ({x.dtype}) was updated differently on each device "
            f"and cannot be averaged over {data_axis!r}; compute it from values reduced over "
            f"the axis, or keep it out of the model's state."
        )

    return jax.tree.map_with_path(average, state, specs)


def _value_and_local_grad(
    model: nnx.Module,
    split_loss: Callable[..., tuple[Any, Any]],
    shard: PyTree,
    specs: PyTree,
    *,
    data_axis: str,
    microbatches: int,
    one_device: bool = False,
) -> tuple[jax.Array, Any, nnx.State]:
    """The global loss, this device's metrics and its unreduced share of the gradient.

    ``model``'s parameters must hold their whole values, varying over ``data_axis``.
    With ``microbatches > 1`` a ``lax.scan`` runs ``grad`` on each slice of the shard
    and sums the shares; the metrics gain a leading microbatch axis. ``one_device``:
    the axis has size 1 and nothing varies over it; no collective runs.
    """
    if microbatches == 1:
        if one_device:
            value_and_grad = nnx.value_and_grad(split_loss, has_aux=True)
        else:
            value_and_grad = data_parallel_value_and_grad(split_loss, data_axis, has_aux=True)
        (loss, metrics), grads = value_and_grad(model, shard)
        return loss, metrics, grads
    # In the loop each device differentiates its own share, loss / axis size: what grad of
    # the pmean-ed loss gives with varying parameters, without the per-microbatch pmean.
    # The loss itself is averaged once, after the loop.
    devices = 1 if one_device else jax.lax.axis_size(data_axis)

    def share(m: nnx.Module, piece: PyTree) -> tuple[Any, Any]:
        loss, aux = split_loss_output(split_loss(m, piece), True)
        return loss / devices, aux

    value_and_grad = nnx.value_and_grad(share, has_aux=True)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    slices = split_microbatches(shard, specs, data_axis, microbatches)

    def body(carry: tuple[Any, Any, Any], piece: PyTree) -> tuple[tuple[Any, Any, Any], Any]:
        params, rest, total = carry  # the parameters ride along so they live at the loop's trace level
        m = nnx.merge(graphdef, params, rest)
        (loss, metrics), grads = value_and_grad(m, piece)
        total = jax.tree.map(jnp.add, total, grads)
        return (params, nnx.state(m, nnx.Not(nnx.Param)), total), (loss, metrics)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (_, rest, total), (losses, metrics) = jax.lax.scan(body, (params, rest, zeros), slices)
    nnx.update(model, rest)
    grads = jax.tree.map(lambda g: g / microbatches, total)
    loss = jnp.mean(losses)
    return (loss if one_device else jax.lax.psum(loss, data_axis)), metrics, grads


def explicit_value_and_grad(
    model: M,
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: BatchSpec | None = None,
) -> tuple[jax.Array, nnx.State]:
    """The global loss and the gradient of ``model``'s parameters, computed under shard_map.

    The gradient half of ``explicit_train_step``, without the update: what
    ``compare_gradients`` checks against the implicit path and a one-device reference.

    Args:
      model: The NNX model: its parameters replicated, or split over ``data_axis`` by
        ``substrax.shard_state`` (gathered before use).
      loss_fn: ``(model, batch) -> loss``, on one device's shard.
      batch: The global batch.
      mesh: The mesh; ``None`` takes the one set by ``jax.set_mesh``.
      data_axis: The mesh axis the batch is split over.
      batch_spec: How to split the batch (see ``batch_partition_specs``).

    Returns:
      ``(loss, grads)``: the loss on the global batch and an ``nnx.State`` of gradients
      with respect to ``nnx.Param``, whole and replicated.
    """
    mesh = current_mesh(mesh, required_axes=(data_axis,))
    specs = batch_partition_specs(batch, batch_spec, mesh, data_axis)
    plans = {p: _ParamPlan(plan.gather_dim, None) for p, plan in _plans(model, None, data_axis).items()}
    graphdef, state = nnx.split(model)
    state_specs = nnx.get_partition_spec(state)

    def per_device(state: nnx.State, shard: PyTree) -> tuple[jax.Array, nnx.State]:
        model = nnx.merge(graphdef, state)
        _set_whole_varying(model, plans, data_axis)
        loss, _, grads = _value_and_local_grad(
            model, _split_loss(loss_fn, False), shard, specs, data_axis=data_axis, microbatches=1
        )
        return loss, _reduce_gradients(grads, plans, data_axis)

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(state_specs, specs),
        out_specs=(PartitionSpec(), PartitionSpec()),
        check_vma=True,
    )
    return run(state, batch)


def explicit_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: BatchSpec | None = None,
    has_aux: bool = False,
    reduce: Mapping[str, str | None] | None = None,
    microbatches: int = 1,
) -> jax.Array | tuple[jax.Array, dict[str, Any]]:
    """Execute a data-parallel training step with every collective written out.

    The explicit twin of ``substrax.spmd.spmd_train_step``, called the same way inside
    ``nnx.jit``. The body runs under ``jax.shard_map`` with ``check_vma=True``: each
    device sees its shard of the batch and the state as placed (replicated, or split
    over ``data_axis`` by ``substrax.shard_state``). The module docstring of
    ``substrax.explicit._step`` lists the collectives each layout runs. Every device
    ends the step with the same model (or its slice of it), in the layout it began.

    Non-parameter state that a layer updates from the shard it sees, such as
    BatchNorm's running statistics, is averaged over ``data_axis`` after the step, so
    every device keeps the same model. Such a layer normalizes with its shard's
    statistics; give ``nnx.BatchNorm`` ``axis_name=data_axis`` to use the global batch's.
    With ``microbatches=k`` it normalizes with each microbatch's statistics and its
    running averages take k updates per step. Random streams (``nnx.Rngs``, as
    ``nnx.Dropout`` uses) get the device's index folded into their keys for the step, so
    each shard draws its own mask, and each microbatch draws its own; the losses then
    differ from the implicit step's, which draws one mask for the global batch.

    With split state the optimizer runs on each device's slices: an element-wise
    transformation (``adam``, ``adamw``, ``sgd``, momentum) gives the replicated
    result; one that reads the whole gradient (``clip_by_global_norm``) would see only
    the slice.

    Args:
      model: The NNX model to train.
      optimizer: The NNX optimizer for ``model``; updated in place.
      loss_fn: ``(model, shard) -> loss`` on one device's shard (the mean over its
        rows), or, with ``has_aux``, ``(model, shard) -> (loss, metrics)`` with
        ``metrics`` a flat mapping from name to this shard's value.
      batch: The global batch (see ``substrax.spmd.place_batch_on_shards``).
      mesh: The mesh; ``None`` takes the one set by ``jax.set_mesh``.
      data_axis: The mesh axis the batch is split over; the loss is averaged over it.
        Other mesh axes (a ``model`` axis, say) see the same shard on every device.
      batch_spec: How ``shard_map`` splits the batch: one ``PartitionSpec``, or a pytree
        prefix of ``batch`` of ``PartitionSpec`` or ``NamedSharding`` leaves (the prefix
        convention of ``place_batch_on_shards``). Default: every leaf on ``data_axis``.
      has_aux: Whether ``loss_fn`` returns ``(loss, metrics)``.
      reduce: With ``has_aux``, metric name to ``"mean"``, ``"sum"``, ``"max"``,
        ``"min"``, ``"gather"`` (the per-example values of the global batch, in order)
        or ``None`` (the per-device values stacked on a leading device axis; with
        microbatches, then a microbatch axis). Unlisted metrics get ``"mean"``. See
        ``reduce_metrics_collective``.
      microbatches: Split each device's shard into this many equal microbatches (rows
        in order) and accumulate their gradients locally: the step holds one
        full-size gradient per device (under FSDP, the whole parameters too) and
        reduces it once.

    Returns:
      The global batch's loss, replicated; with ``has_aux``, ``(loss, metrics)``.

    Raises:
      ValueError: If there is no mesh or it lacks ``data_axis``, if ``batch_spec`` does
        not fit the batch, if a leaf cannot be split over its axes, if ``loss_fn``'s
        output does not match ``has_aux``, if ``reduce`` is given without ``has_aux``,
        names a metric ``loss_fn`` does not return or an unknown operation, if a
        variable is declared sharded over an axis other than ``data_axis``, or if
        ``microbatches`` does not divide the rows per device; each message names the
        axis, leaf, parameter or metric.
    """
    if reduce is not None and not has_aux:
        raise ValueError("reduce= says how to reduce metrics, which loss_fn returns only with has_aux=True.")
    check_microbatches(microbatches)
    mesh = current_mesh(mesh, required_axes=(data_axis,))
    specs = batch_partition_specs(batch, batch_spec, mesh, data_axis)
    check_microbatches(microbatches, batch, specs, mesh, data_axis)
    plans = _plans(model, optimizer, data_axis)
    graphdef, state = nnx.split((model, optimizer))
    state_specs = nnx.get_partition_spec(state)
    split_loss = _split_loss(loss_fn, has_aux)
    # A data axis of size 1 needs no collective: nothing is typed as varying over it (the
    # batch and state enter replicated, which is the same placement), so none is emitted.
    one_device = mesh.shape[data_axis] == 1
    if one_device:
        state_specs = _without_axis(state_specs, data_axis)
        plans = {p: _ParamPlan(None, None) for p in plans}
    shard_specs = _without_axis(specs, data_axis) if one_device else specs

    def per_device(state: nnx.State, shard: PyTree) -> tuple[nnx.State, jax.Array, dict[str, Any]]:
        model, optimizer = nnx.merge(graphdef, state)
        if one_device:
            held = {p: v.get_value() for p, v in _param_vars(model).items()}
            loss, metrics, grads = _value_and_local_grad(
                model,
                split_loss,
                shard,
                specs,
                data_axis=data_axis,
                microbatches=microbatches,
                one_device=True,
            )
        else:
            held = _set_whole_varying(model, plans, data_axis)
            with _per_device_random_streams(model, data_axis):
                loss, metrics, grads = _value_and_local_grad(
                    model, split_loss, shard, specs, data_axis=data_axis, microbatches=microbatches
                )
            grads = _reduce_gradients(grads, plans, data_axis)
        for path, variable in _param_vars(model).items():  # the values the optimizer updates
            plan = plans[path]
            value = held[path]
            if plan.update_dim is not None and plan.gather_dim is None:
                value = _slice_for_update(value, plan.update_dim, data_axis)
            variable.set_value(value)
        optimizer.update(model, grads)
        for path, variable in _param_vars(model).items():  # ZeRO-1: gather the updated slices
            plan = plans[path]
            if plan.update_dim is not None and plan.gather_dim is None:
                variable.set_value(
                    gather_invariant(variable.get_value(), data_axis, axis=plan.update_dim, tiled=True)
                )
        if microbatches > 1:
            metrics = fold_microbatch_metrics(metrics, reduce)
        if one_device:
            metrics = _reduce_metrics_on_one_device(metrics, reduce)
        else:
            metrics = reduce_metrics_collective(metrics, reduce, data_axis)
        new_state = _average_per_device_state(nnx.state((model, optimizer)), state_specs, data_axis)
        return new_state, loss, metrics

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(state_specs, shard_specs),
        out_specs=(state_specs, PartitionSpec(), PartitionSpec()),
        check_vma=True,
    )
    new_state, loss, metrics = run(state, batch)
    nnx.update((model, optimizer), new_state)
    return (loss, metrics) if has_aux else loss
