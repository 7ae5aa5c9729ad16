"""The explicit data-parallel step: the same step as ``spmd_train_step``, under ``jax.shard_map``.

Every collective of the gradient computation is written here. Each device sees its shard of the batch;
the loss is ``pmean``-ed over the data axis before ``grad``. The parameters are cast to
varying over the axis first (``to_varying``: no communication), so ``grad`` itself
runs no collective and each device holds its shard's share of the gradient; the step
then reduces it once, in plain sight:

- a replicated parameter's gradient is ``psum``-ed (one all-reduce);
- a split one (``substrax.shard_state``) is ``psum_scatter``-ed (a reduce-scatter):
  each device gets the slice its optimizer state updates. Under FSDP the parameter
  was ``all_gather``-ed right before use.

The ``shard_map`` ends there: it returns the gradients (split where the state is) and
the model's other state. The optimizer update runs after it, on the global arrays,
under the same jit (``substrax._update``): element-wise math stays on each device's
slice, and XLA adds only what a transformation needs: one scalar per split tensor
(combined into one all-reduce) for
``clip_by_global_norm``'s norm under a split layout, and under ZeRO-1 the all-gather
of the updated slices into the replicated parameters. Each library collective sits
under a ``jax.named_scope`` (``substrax.grad_reduce``, ``substrax.gather_params``,
``substrax.loss``, ``substrax.metrics``, ``substrax.batch_stats``,
``substrax.update``, ``substrax.finite``) that the census reads back.

With ``microbatches=k`` the gradient part runs in a ``lax.scan`` over k slices of each
device's shard and accumulates the local gradients; the reduction above still runs
once, after the loop. ``check_vma=True`` is pinned, since the gradient rule depends on
it (see ``substrax.explicit._grad``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax._collectives import to_varying
from substrax._layout import ParamSplit, gradient_spec, parameter_splits, spec_tuple
from substrax._microbatch import check_microbatches, fold_microbatch_metrics, microbatched, split_microbatches
from substrax._options import StepOptions
from substrax._placement import batch_partition_specs
from substrax._precision import MixedPrecision
from substrax._reductions import split_loss_output
from substrax._tree import PyTree, path_str
from substrax._update import apply_update, state_values
from substrax.explicit._grad import data_parallel_value_and_grad, varying_axes
from substrax.explicit._metrics import reduce_metrics_collective, reduce_metrics_on_one_device
from substrax.mesh import current_mesh

__all__ = ["explicit_train_step", "explicit_value_and_grad"]

M = TypeVar("M", bound=nnx.Module)
BatchSpec = PartitionSpec | NamedSharding | PyTree
Path = tuple[Any, ...]


def _split_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., tuple[Any, Any]]:
    if has_aux:
        return loss_fn
    return lambda model, batch: (loss_fn(model, batch), {})


def check_mesh_axes(tree: Any, mesh: Any, owner: str) -> None:
    """Refuse a variable declared sharded over an axis ``mesh`` lacks, naming it and the axis."""
    for path, variable in nnx.to_flat_state(nnx.state(tree)):
        spec = spec_tuple(variable) or ()
        names = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
        missing = [a for a in names if a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"{path_str(tuple(path), owner)} is declared sharded as {PartitionSpec(*spec)}, over "
                f"mesh axis {missing[0]!r}, which the mesh {dict(mesh.shape)} lacks. Build the mesh "
                f"with that axis (substrax.mesh.create_device_mesh), or drop the annotation."
            )


def check_placement(model: nnx.Module) -> None:
    """Refuse a variable split on the devices in a way its metadata does not say (outside jit).

    The step reads the layout from the variables' ``out_sharding`` metadata, which
    ``substrax.shard_state`` writes; an array placed by hand without it would be read
    as replicated.
    """
    for path, variable in nnx.to_flat_state(nnx.state(model)):
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


def _plans(
    model: nnx.Module, optimizer: nnx.Optimizer[Any] | None, mesh: Any, data_axis: str
) -> dict[Path, ParamSplit]:
    """Each parameter's ``ParamSplit`` over ``data_axis`` (``substrax._layout.parameter_splits``).

    The gradient is reduce-scattered on ``update_dim`` and all-reduced where it is
    ``None``. The update runs on the global arrays after the ``shard_map``, so this
    choice moves bytes, never values.
    """
    check_mesh_axes(model, mesh, "model")
    if optimizer is not None:
        check_mesh_axes(optimizer, mesh, "optimizer")
    return parameter_splits(model, optimizer, data_axis)


def _check_reduced_over_other_axes(loss: Any, metrics: Mapping[str, Any], data_axis: str) -> None:
    """Refuse a loss or metric that still varies over a mesh axis other than ``data_axis``.

    On a ``(data, model)`` mesh every device of a ``model`` group sees the same rows, so
    the loss must come out the same on each: a value still varying over ``model`` is a
    partial result some layer left unreduced (``check_vma`` types it, so this cannot miss).
    """
    for name, value in (("the loss", loss), *((f"metric {k!r}", v) for k, v in metrics.items())):
        others = sorted(a for a in varying_axes(value) or () if a != data_axis)
        if others:
            raise ValueError(
                f"{name} still varies over mesh axis {others[0]!r}: a layer split over "
                f"{others[0]!r} left its partial results unreduced, so each device of a "
                f"{others[0]!r} group would report a different value. End a column-parallel layer "
                f"with a row-parallel one (substrax.nn.RowParallelLinear), or reduce the value with "
                f"jax.lax.psum/all_gather over {others[0]!r}."
            )


def _param_vars(model: nnx.Module) -> dict[Path, nnx.Variable[Any]]:
    return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _set_whole_varying(
    model: nnx.Module, plans: Mapping[Path, ParamSplit], data_axis: str, dtype: Any = None
) -> dict[Path, Any]:
    """Give every parameter its whole value, varying over ``data_axis``; return what it held.

    ``dtype``: cast floating parameters to it first, so a split one is gathered in it.
    """
    held = {}
    for path, variable in _param_vars(model).items():
        value = held[path] = variable.get_value()
        if dtype is not None and jnp.issubdtype(value.dtype, jnp.floating):
            value = value.astype(dtype)
        dim = plans[path].gather_dim
        if dim is not None:
            with jax.named_scope("substrax.gather_params"):
                whole = jax.lax.all_gather(value, data_axis, axis=dim, tiled=True)
        elif data_axis in (varying_axes(value) or ()):
            whole = value
        else:
            whole = to_varying(value, data_axis)
        variable.set_value(whole)
    return held


def _reduce_gradients(grads: nnx.State, plans: Mapping[Path, ParamSplit], data_axis: str) -> nnx.State:
    """The once-per-step reduction: psum the whole-updated gradients, psum_scatter the split ones."""
    flat = [(tuple(p), v) for p, v in nnx.to_flat_state(grads)]
    whole = [i for i, (p, _) in enumerate(flat) if plans[p].update_dim is None]
    with jax.named_scope("substrax.grad_reduce"):
        summed = jax.lax.psum([flat[i][1].get_value() for i in whole], data_axis) if whole else []
        out = dict(zip(whole, summed, strict=True))
        for i, (path, variable) in enumerate(flat):
            dim = plans[path].update_dim
            if dim is not None:
                out[i] = jax.lax.psum_scatter(
                    variable.get_value(), data_axis, scatter_dimension=dim, tiled=True
                )
    return nnx.from_flat_state([(p, v.replace(out[i])) for i, (p, v) in enumerate(flat)])


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


def _settle_per_device_state(state: nnx.State, specs: Any, data_axis: str) -> nnx.State:
    """The model's non-parameter state after the step, made one model's again.

    A layer that updates state from the shard it sees (BatchNorm's running statistics,
    ``nnx.BatchStat``) computes it per device: that, and only that, is averaged over
    ``data_axis`` (one ``pmean``). Any other replicated state that came out varying over
    the axis would be a different model per device, and is refused at trace time by
    path: ``check_vma`` types every value, so the check cannot miss one.
    """

    def settle(path: tuple[Any, ...], variable: nnx.Variable[Any], spec: Any) -> nnx.Variable[Any]:
        value = variable.get_value()
        axes = varying_axes(value)
        if (
            axes is None
            or data_axis not in axes
            or any(e is not None for e in (spec.get_value() if isinstance(spec, nnx.Variable) else spec))
        ):
            return variable
        if isinstance(variable, nnx.BatchStat) and jnp.issubdtype(value.dtype, jnp.inexact):
            with jax.named_scope("substrax.batch_stats"):
                return variable.replace(jax.lax.pmean(value, data_axis))
        raise ValueError(
            f"{path_str(path, 'model')} ({type(variable).__name__}, {value.dtype}) came out of the "
            f"step different on each device, and it is replicated: substrax averages only "
            f"nnx.BatchStat state (statistics a layer computes from its shard). Compute it from "
            f"values reduced over {data_axis!r} (jax.lax.pmean), declare it an nnx.BatchStat if "
            f"a per-device average is what it means, or keep it out of the model's state."
        )

    return jax.tree.map_with_path(settle, state, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _varying_carry(body: Callable[..., Any], carry: Any, piece: PyTree, data_axis: str) -> Any:
    """``carry`` with every leaf that ``body`` returns varying over ``data_axis`` cast to varying.

    ``lax.scan`` needs a carry of one type in and out; a BatchNorm without
    ``axis_name`` turns its replicated statistics into per-device ones in the body.
    """
    out = jax.eval_shape(body, carry, piece)[0]
    cast = [
        data_axis in getattr(getattr(o, "manual_axis_type", None), "varying", ())
        for o in jax.tree.leaves(out)
    ]
    leaves, treedef = jax.tree.flatten(carry)
    return jax.tree.unflatten(
        treedef,
        [
            to_varying(x, data_axis) if c and data_axis not in (varying_axes(x) or ()) else x
            for x, c in zip(leaves, cast, strict=True)
        ],
    )


def _value_and_local_grad(
    model: nnx.Module,
    split_loss: Callable[..., tuple[Any, Any]],
    shard: PyTree,
    specs: PyTree,
    *,
    data_axis: str,
    microbatches: int,
    one_device: bool = False,
    accumulate_dtype: Any = None,
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

    slices = split_microbatches(shard, specs, data_axis, microbatches)
    prepare = None if one_device else functools.partial(_varying_carry, data_axis=data_axis)
    (loss, metrics), grads = microbatched(
        nnx.value_and_grad(share, has_aux=True),
        model,
        slices,
        prepare_carry=prepare,
        accumulate_dtype=accumulate_dtype,
    )
    if one_device:
        return loss, metrics, grads
    with jax.named_scope("substrax.loss"):
        return jax.lax.psum(loss, data_axis), metrics, grads


def explicit_value_and_grad(
    model: M,
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: BatchSpec | None = None,
    precision: MixedPrecision | None = None,
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
      precision: A ``substrax.MixedPrecision`` policy, as ``explicit_train_step`` runs it.

    Returns:
      ``(loss, grads)``: the loss on the global batch and an ``nnx.State`` of gradients
      with respect to ``nnx.Param``, in the parameters' dtype: whole over ``data_axis``,
      split over another axis (``model``) where the parameter is.
    """
    mesh = current_mesh(mesh, required_axes=(data_axis,))
    specs = batch_partition_specs(batch, batch_spec, mesh, data_axis)
    plans = {p: ParamSplit(plan.gather_dim, None) for p, plan in _plans(model, None, mesh, data_axis).items()}
    graphdef, state = nnx.split(model)
    state_specs = nnx.get_partition_spec(state)

    def per_device(state: nnx.State, shard: PyTree) -> tuple[jax.Array, nnx.State]:
        model = nnx.merge(graphdef, state)
        held = _set_whole_varying(
            model, plans, data_axis, None if precision is None else precision.param_dtype
        )
        run_loss = loss_fn if precision is None else precision.loss_fn(loss_fn, False)
        loss, _, grads = _value_and_local_grad(
            model, _split_loss(run_loss, False), shard, specs, data_axis=data_axis, microbatches=1
        )
        if precision is not None:
            grads = jax.tree.map(lambda g: g.astype(precision.reduce_dtype), grads)
        grads = _reduce_gradients(grads, plans, data_axis)
        return loss, nnx.from_flat_state(
            [(p, v.replace(v.get_value().astype(held[tuple(p)].dtype))) for p, v in nnx.to_flat_state(grads)]
        )

    grad_specs = nnx.from_flat_state(
        [(p, gradient_spec(v, None, data_axis)) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    )
    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(state_specs, specs),
        out_specs=(PartitionSpec(), grad_specs),
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
    skip_nonfinite: bool = True,
    precision: MixedPrecision | None = None,
) -> jax.Array | tuple[jax.Array, dict[str, Any]]:
    """Execute a data-parallel training step with every collective written out.

    The explicit twin of ``substrax.spmd.spmd_train_step``, called the same way inside
    ``nnx.jit``. The body runs under ``jax.shard_map`` with ``check_vma=True``: each
    device sees its shard of the batch and the state as placed (replicated, or split
    over ``data_axis`` by ``substrax.shard_state``). The module docstring of
    ``substrax.explicit._step`` lists the collectives each layout runs. Every device
    ends the step with the same model (or its slice of it), in the layout it began.

    The ``shard_map`` covers the forward pass, the backward pass and the gradient
    reduction; the optimizer update then runs on the global arrays (split or not) under
    the same jit, so every optax transformation, ``clip_by_global_norm`` and
    ``adafactor`` included, gives the one-device result (``substrax._update``).

    ``nnx.BatchStat`` state that a layer updates from the shard it sees (BatchNorm's
    running statistics) is averaged over ``data_axis`` after the step, so every device
    keeps the same model; any other replicated state that comes out different per
    device is refused at trace time, by path. Such a layer normalizes with its shard's
    statistics; give ``nnx.BatchNorm`` ``axis_name=data_axis`` to use the global batch's.
    With ``microbatches=k`` it normalizes with each microbatch's statistics and its
    running averages take k updates per step. Random streams (``nnx.Rngs``, as
    ``nnx.Dropout`` uses) get the device's index folded into their keys for the step, so
    each shard draws its own mask, and each microbatch draws its own; the losses then
    differ from the implicit step's, which draws one mask for the global batch.

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
      skip_nonfinite: Skip the update, in the graph, when the loss or a gradient is
        not finite: the model and optimizer keep their values and the step returns
        the non-finite loss (see ``substrax._update``).
      precision: A ``substrax.MixedPrecision`` policy: parameters are cast to its
        ``param_dtype`` before the all-gather (gathers move its bytes), gradients are
        reduced and accumulated in its ``reduce_dtype`` and updated in the parameters'
        own dtype (see ``substrax._precision``).

    Returns:
      The global batch's loss, replicated; with ``has_aux``, ``(loss, metrics)``.

    Raises:
      ValueError: If there is no mesh or it lacks ``data_axis``, if ``batch_spec`` does
        not fit the batch, if a leaf cannot be split over its axes, if ``loss_fn``'s
        output does not match ``has_aux``, if ``reduce`` is given without ``has_aux``,
        names a metric ``loss_fn`` does not return or an unknown operation, if a model
        variable is declared sharded over an axis other than ``data_axis``, if
        ``microbatches`` does not divide the rows per device, or if replicated state
        other than ``nnx.BatchStat`` comes out different per device; each message
        names the axis, leaf, parameter or metric.
    """
    options = StepOptions(
        mesh=mesh,
        data_axis=data_axis,
        batch_spec=batch_spec,
        has_aux=has_aux,
        reduce=reduce,
        microbatches=microbatches,
        skip_nonfinite=skip_nonfinite,
        precision=precision,
    )
    return run_step(model, optimizer, loss_fn, batch, options)


def run_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    options: StepOptions,
) -> jax.Array | tuple[jax.Array, dict[str, Any]]:
    """``explicit_train_step`` with its keywords as one ``StepOptions``."""
    o = options
    data_axis, microbatches, reduce = o.data_axis, o.microbatches, o.reduce
    mesh = current_mesh(o.mesh, required_axes=(data_axis,))
    specs = batch_partition_specs(batch, o.batch_spec, mesh, data_axis)
    check_microbatches(microbatches, batch, specs, mesh, data_axis)
    plans = _plans(model, optimizer, mesh, data_axis)
    before = state_values((model, optimizer)) if o.skip_nonfinite else None
    graphdef, state = nnx.split(model)
    state_specs = nnx.get_partition_spec(state)
    rest_specs = nnx.get_partition_spec(nnx.state(model, nnx.Not(nnx.Param)))
    precision = o.precision
    reduce_dtype = None if precision is None else precision.reduce_dtype
    split_loss = _split_loss(
        loss_fn if precision is None else precision.loss_fn(loss_fn, o.has_aux), o.has_aux
    )
    # A data axis of size 1 needs no collective: nothing is typed as varying over it (the
    # batch and state enter replicated, which is the same placement), so none is emitted.
    one_device = mesh.shape[data_axis] == 1
    if one_device:
        state_specs = _without_axis(state_specs, data_axis)
        rest_specs = _without_axis(rest_specs, data_axis)
        plans = {p: ParamSplit(None, None) for p in plans}
    shard_specs = _without_axis(specs, data_axis) if one_device else specs
    grad_specs = nnx.from_flat_state(
        [
            (p, gradient_spec(v, plans[tuple(p)].update_dim, data_axis))
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        ]
    )

    def per_device(state: nnx.State, shard: PyTree) -> tuple[nnx.State, nnx.State, jax.Array, dict[str, Any]]:
        model = nnx.merge(graphdef, state)
        if one_device:
            held = {p: v.get_value() for p, v in _param_vars(model).items()}
            if precision is not None:
                for variable in _param_vars(model).values():
                    variable.set_value(precision.cast_params(variable.get_value()))
            loss, metrics, grads = _value_and_local_grad(
                model,
                split_loss,
                shard,
                specs,
                data_axis=data_axis,
                microbatches=microbatches,
                one_device=True,
                accumulate_dtype=reduce_dtype,
            )
        else:
            held = _set_whole_varying(
                model, plans, data_axis, None if precision is None else precision.param_dtype
            )
            with _per_device_random_streams(model, data_axis):
                loss, metrics, grads = _value_and_local_grad(
                    model,
                    split_loss,
                    shard,
                    specs,
                    data_axis=data_axis,
                    microbatches=microbatches,
                    accumulate_dtype=reduce_dtype,
                )
            if precision is not None:  # reduced in the policy's dtype
                grads = jax.tree.map(lambda g: g.astype(reduce_dtype), grads)
            grads = _reduce_gradients(grads, plans, data_axis)
        if precision is not None:  # the update runs in the parameters' own dtype
            grads = nnx.from_flat_state(
                [
                    (p, v.replace(v.get_value().astype(held[tuple(p)].dtype)))
                    for p, v in nnx.to_flat_state(grads)
                ]
            )
        _check_reduced_over_other_axes(loss, metrics, data_axis)
        if microbatches > 1:
            metrics = fold_microbatch_metrics(metrics, reduce)
        if one_device:
            metrics = reduce_metrics_on_one_device(metrics, reduce)
        else:
            with jax.named_scope("substrax.metrics"):
                metrics = reduce_metrics_collective(metrics, reduce, data_axis)
        rest = nnx.state(model, nnx.Not(nnx.Param))
        if not one_device:
            rest = _settle_per_device_state(rest, rest_specs, data_axis)
        return rest, grads, loss, metrics

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(state_specs, shard_specs),
        out_specs=(rest_specs, grad_specs, PartitionSpec(), PartitionSpec()),
        check_vma=True,
    )
    rest, grads, loss, metrics = run(state, batch)
    nnx.update(model, rest)
    apply_update(model, optimizer, grads, loss, before)
    return (loss, metrics) if o.has_aux else loss
