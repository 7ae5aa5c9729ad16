"""The explicit gradient: each device's share under ``shard_map``, and ``explicit_value_and_grad``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from substrax._base import declared, scopes
from substrax._base.specs import spec_axes
from substrax._base.trees import PyTree
from substrax._batch.leaves import BatchSpec
from substrax._layout import REPLICA_AXIS, ParamSplit, gradient_spec
from substrax._shared.loss import loss_and_metrics
from substrax._shared.microbatch import microbatched, split_microbatches
from substrax._shared.precision import MixedPrecision
from substrax.explicit._grad import data_parallel_value_and_grad
from substrax.explicit._prologue import Share, open_step
from substrax.explicit._shard import (
    cast_like,
    gather_whole_varying,
    param_vars,
    reduce_gradients,
    varying_carry,
)

__all__ = ["BatchSpec", "explicit_value_and_grad", "local_value_and_grad", "with_aux"]

M = TypeVar("M", bound=nnx.Module)


def with_aux(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., tuple[Any, Any]]:
    """``loss_fn`` returning ``(loss, metrics)``, its layers named for ``substrax.nn``'s record."""

    def run(model: nnx.Module, batch: PyTree) -> tuple[Any, Any]:
        with declared.naming(model):
            out = loss_fn(model, batch)
        return out if has_aux else (out, {})

    return run


def local_value_and_grad(
    model: nnx.Module, split_loss: Callable[..., tuple[Any, Any]], shard: PyTree, share: Share
) -> tuple[jax.Array, Any, nnx.State]:
    """The global loss, this device's metrics and its unreduced share of the gradient.

    ``model``'s parameters must hold their whole values, varying over ``share.rows``.
    With ``share.microbatches > 1`` a ``lax.scan`` runs ``grad`` on each slice of the
    shard and sums the shares; the metrics gain a leading microbatch axis.
    """
    rows, microbatches, one_device = share.rows, share.microbatches, share.one_device
    if microbatches == 1:
        if one_device:
            value_and_grad = nnx.value_and_grad(split_loss, has_aux=True)
        else:
            value_and_grad = data_parallel_value_and_grad(split_loss, rows, has_aux=True)
        (loss, metrics), grads = value_and_grad(model, shard)
        return loss, metrics, grads
    # In the loop each device differentiates its own share, loss / axis size: what grad of
    # the pmean-ed loss gives with varying parameters, without the per-microbatch pmean.
    # The loss itself is averaged once, after the loop.
    devices = 1 if one_device else jax.lax.axis_size(rows)

    def own_share(m: nnx.Module, piece: PyTree) -> tuple[Any, Any]:
        loss, aux = loss_and_metrics(split_loss(m, piece), True)
        return loss / devices, aux

    slices = split_microbatches(shard, share.specs, rows, microbatches)
    prepare = None if one_device else functools.partial(varying_carry, data_axis=rows)
    (loss, metrics), grads = microbatched(
        nnx.value_and_grad(own_share, has_aux=True),
        model,
        slices,
        prepare_carry=prepare,
        accumulate_dtype=share.accumulate_dtype,
    )
    if one_device:
        return loss, metrics, grads
    with jax.named_scope(scopes.LOSS):
        return jax.lax.psum(loss, rows), metrics, grads


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
    p = open_step(
        model, None, batch, mesh=mesh, data_axis=data_axis, batch_spec=batch_spec,
        replica_axis=REPLICA_AXIS, check_replica=False,
    )  # fmt: skip
    plans = {q: ParamSplit(plan.gather_dim, None) for q, plan in p.plans.items()}  # every gradient whole
    data_axis, one_device = p.data_axis, not spec_axes(p.rows)  # no row axis (no data axis): no collective

    def per_device(state: nnx.State, shard: PyTree) -> tuple[jax.Array, nnx.State]:
        model = nnx.merge(p.graphdef, state)
        if one_device:  # as the step's _grads_on_one_device: the parameters as held, cast by the policy
            held = {q: v.get_value() for q, v in param_vars(model).items()}
            for v in param_vars(model).values() if precision is not None else ():
                v.set_value(precision.cast_params(v.get_value()))
        else:
            dtype = None if precision is None else precision.param_dtype
            held = gather_whole_varying(model, plans, data_axis, dtype, rows=p.rows)
        run_loss = loss_fn if precision is None else precision.loss_fn(loss_fn, False)
        share = Share(p.specs, p.rows, one_device=one_device)
        loss, _, grads = local_value_and_grad(model, with_aux(run_loss, False), shard, share)
        if precision is not None:
            grads = jax.tree.map(lambda g: g.astype(precision.reduce_dtype), grads)
        if not one_device:
            grads = reduce_gradients(grads, plans, data_axis, replicas=p.replicas)
        return loss, cast_like(grads, held)

    grad_specs = nnx.from_flat_state(
        [(q, gradient_spec(v, None, data_axis)) for q, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    )
    run = jax.shard_map(
        per_device,
        mesh=p.mesh,
        in_specs=(p.state_specs, p.specs),
        out_specs=(PartitionSpec(), grad_specs),
        check_vma=True,
    )
    return run(p.state, batch)
