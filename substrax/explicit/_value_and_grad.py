"""The explicit gradient: each device's share under ``shard_map``, and ``explicit_value_and_grad``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from substrax._base import declared
from substrax._base.specs import spec_axes
from substrax._batch.leaves import BatchSpec
from substrax._batch.placement import batch_partition_specs
from substrax._layout import REPLICA_AXIS, ParamSplit, check_mesh_axes, gradient_spec, parameter_splits
from substrax._base import scopes
from substrax._shared.loss import loss_and_metrics
from substrax._shared.microbatch import microbatched, split_microbatches, split_rows_over
from substrax._shared.precision import MixedPrecision
from substrax._base.trees import KeyPath, PyTree
from substrax.explicit._grad import data_parallel_value_and_grad
from substrax.explicit._shard import (
    cast_like,
    check_layers_take_blocks,
    gather_whole_varying,
    reduce_gradients,
    varying_carry,
)
from substrax.mesh import current_mesh

__all__ = ["BatchSpec", "explicit_value_and_grad", "local_value_and_grad", "parameter_plans", "with_aux"]

M = TypeVar("M", bound=nnx.Module)


def with_aux(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., tuple[Any, Any]]:
    """``loss_fn`` returning ``(loss, metrics)``, its layers named for ``substrax.nn``'s record."""

    def run(model: nnx.Module, batch: PyTree) -> tuple[Any, Any]:
        with declared.naming(model):
            out = loss_fn(model, batch)
        return out if has_aux else (out, {})

    return run


def parameter_plans(
    model: nnx.Module, optimizer: nnx.Optimizer[Any] | None, mesh: Any, data_axis: str
) -> dict[KeyPath, ParamSplit]:
    """Each parameter's ``ParamSplit`` over ``data_axis`` (``substrax._layout.parameter_splits``).

    The gradient is reduce-scattered on ``update_dim`` and all-reduced where it is
    ``None``. The update runs on the global arrays after the ``shard_map``, so this
    choice moves bytes, never values.
    """
    check_mesh_axes(model, mesh, "model")
    check_layers_take_blocks(model, data_axis)
    if optimizer is not None:
        check_mesh_axes(optimizer, mesh, "optimizer")
    return parameter_splits(model, optimizer, data_axis)


def local_value_and_grad(
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
        loss, aux = loss_and_metrics(split_loss(m, piece), True)
        return loss / devices, aux

    slices = split_microbatches(shard, specs, data_axis, microbatches)
    prepare = None if one_device else functools.partial(varying_carry, data_axis=data_axis)
    (loss, metrics), grads = microbatched(
        nnx.value_and_grad(share, has_aux=True),
        model,
        slices,
        prepare_carry=prepare,
        accumulate_dtype=accumulate_dtype,
    )
    if one_device:
        return loss, metrics, grads
    with jax.named_scope(scopes.LOSS):
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
    hybrid = (REPLICA_AXIS, data_axis) if REPLICA_AXIS in mesh.axis_names and REPLICA_AXIS != data_axis else data_axis
    specs = batch_partition_specs(batch, batch_spec, mesh, hybrid)
    rows = split_rows_over(specs, data_axis, hybrid)  # over (replica, data) for hybrid sharding
    replicas = tuple(a for a in spec_axes(rows) if a != data_axis)
    plans = {
        p: ParamSplit(plan.gather_dim, None)
        for p, plan in parameter_plans(model, None, mesh, data_axis).items()
    }
    graphdef, state = nnx.split(model)
    state_specs = nnx.get_partition_spec(state)

    def per_device(state: nnx.State, shard: PyTree) -> tuple[jax.Array, nnx.State]:
        model = nnx.merge(graphdef, state)
        held = gather_whole_varying(
            model, plans, data_axis, None if precision is None else precision.param_dtype, rows=rows
        )
        run_loss = loss_fn if precision is None else precision.loss_fn(loss_fn, False)
        loss, _, grads = local_value_and_grad(
            model, with_aux(run_loss, False), shard, specs, data_axis=rows, microbatches=1
        )
        if precision is not None:
            grads = jax.tree.map(lambda g: g.astype(precision.reduce_dtype), grads)
        grads = reduce_gradients(grads, plans, data_axis, replicas=replicas)
        return loss, cast_like(grads, held)

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
