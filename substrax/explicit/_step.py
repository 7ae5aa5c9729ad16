"""The explicit data-parallel step: the same step as ``spmd_train_step``, under ``jax.shard_map``.

Every collective of the gradient computation is written here: the loss ``pmean``-ed
before ``grad``, each gradient reduced once (``psum``, or ``psum_scatter`` for split
state), after the microbatch loop; the optimizer update runs after the ``shard_map`` on
the global arrays. See the modes guide, "Explicit: ``substrax.explicit``".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from substrax._base import scopes
from substrax._base.specs import spec_axes
from substrax._base.trees import KeyPath, PyTree
from substrax._layout import (
    STAGE_AXIS,
    UNIT_KEY,
    ParamSplit,
    gradient_spec,
    prefetched_units,
    staged_chunks,
    unit_paths,
)
from substrax._shared.microbatch import fold_microbatch_metrics
from substrax._shared.options import ModeSteps, StepOptions, options_from
from substrax._shared.pipeline import pipeline_of
from substrax._shared.precision import MixedPrecision
from substrax._shared.scatter import platform_of, rows_for
from substrax._shared.update import update_step
from substrax.explicit._metrics import reduce_metrics_collective, reduce_metrics_on_one_device
from substrax.explicit._pipeline import pipelined_value_and_grad
from substrax.explicit._prologue import Prologue, Share, open_step
from substrax.explicit._shard import (
    cast_like,
    check_placement,
    check_reduced_over_other_axes,
    gather_whole_varying,
    param_vars,
    per_device_random_streams,
    reduce_gradients,
    settle_per_device_state,
    without_axis_specs,
)
from substrax.explicit._units import units_running
from substrax.explicit._value_and_grad import (
    BatchSpec,
    explicit_value_and_grad,
    local_value_and_grad,
    with_aux,
)

__all__ = [
    "STEPS",
    "BatchSpec",
    "check_placement",
    "explicit_train_step",
    "explicit_value_and_grad",
    "run_step",
]

M = TypeVar("M", bound=nnx.Module)


def explicit_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    has_aux: bool = False,
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: BatchSpec | None = None,
    reduce: Mapping[str, str | None] | None = None,
    microbatches: int = 1,
    skip_nonfinite: bool = True,
    precision: MixedPrecision | None = None,
) -> jax.Array | tuple[jax.Array, dict[str, Any]]:
    """Execute a data-parallel training step with every collective written out.

    The explicit twin of ``substrax.spmd.spmd_train_step``, called the same way inside
    ``nnx.jit``; each device sees its shard of the batch and the state as placed, and ends
    with the same model in the same layout. BatchNorm statistics are averaged over
    ``data_axis``; random streams draw per device (see the modes guide, "Where the modes
    differ"). The keyword options are ``substrax.make_train_step``'s, documented there.

    Args:
      model: The NNX model to train.
      optimizer: The NNX optimizer for ``model``; updated in place.
      loss_fn: ``(model, shard) -> loss`` on one device's shard (the mean over its
        rows), or, with ``has_aux``, ``(model, shard) -> (loss, metrics)`` with
        ``metrics`` a flat mapping from name to this shard's value.
      batch: The global batch (see ``substrax.spmd.place_batch_on_shards``).

    Returns:
      The global batch's loss, replicated; with ``has_aux``, ``(loss, metrics)``.

    Raises:
      ValueError: If there is no mesh, two roles share an axis or, on a mesh without
        ``data_axis``, an axis has none (batches guide, "Axis roles"), ``batch_spec`` does not
        fit the batch, a leaf cannot be split over its axes, the output does not match
        ``has_aux``, ``reduce`` comes without ``has_aux`` or names a metric not returned or
        an unknown operation, a variable is declared sharded over an axis other than
        ``data_axis``, ``microbatches`` does not divide the rows per device, or replicated
        state other than ``nnx.BatchStat`` comes out different per device; each names the
        axis, leaf, parameter or metric.
    """
    options = options_from(locals())  # the keywords above, checked once
    return run_step(model, optimizer, loss_fn, batch, options)[0]


@dataclasses.dataclass(frozen=True)
class DeviceStep:
    """What each device's share of the step runs with, beside its state and its shard.

    Attributes:
      opening: The step's ``Prologue`` (its plans: ``ParamSplit(None, None)`` when ``data`` has size 1).
      options: The step's options.
      value_and_grad: ``local_value_and_grad``, or ``pipelined_value_and_grad`` for a staged stack.
      split_loss: ``loss_fn`` returning ``(loss, metrics)``, under the precision policy.
      units: The units' paths (``unit_paths``), empty when ``data`` has size 1.
      in_unit: The split parameters of the units, gathered only when their unit runs.
      gather_plans: ``opening.plans`` with the units' parameters left split.
      one_device: The rows are split over one device: no collective runs.
      rest_specs: The partition specs of the state other than ``nnx.Param``.
    """

    opening: Prologue
    options: StepOptions
    value_and_grad: Callable[..., tuple[jax.Array, Any, nnx.State]]
    split_loss: Callable[..., tuple[Any, Any]]
    units: dict[KeyPath, bool]
    in_unit: frozenset[KeyPath]
    gather_plans: dict[KeyPath, ParamSplit]
    one_device: bool
    rest_specs: PyTree


def sharded_value_and_grad(
    model: M,
    optimizer: nnx.Optimizer[M] | None,
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    options: StepOptions,
) -> tuple[jax.Array, Any, nnx.State]:
    """The step's ``shard_map``: ``(loss, metrics, grads)``, each gradient reduced as the layout says
    (``optimizer=None``: every one whole), the model's other state updated in place."""
    o = options
    p = open_step(
        model, optimizer, batch, mesh=o.mesh, data_axis=o.data_axis, batch_spec=o.batch_spec,
        replica_axis=o.replica_axis, microbatches=o.microbatches,
    )  # fmt: skip
    step = _device_step(model, loss_fn, p, o)
    p, data_axis = step.opening, step.opening.data_axis
    # An axis of size 1 needs no collective: the state enters replicated over it (the same
    # placement), so nothing is typed as varying over it and none is emitted. On `data` the
    # batch enters whole too; on `model` the layers hold their whole parameters and run as
    # plain ones (XLA would keep psums over one-device groups).
    state_specs = _without_single_axes(p.state_specs, p.mesh)
    shard_specs = p.specs
    if step.one_device:
        for axis in (data_axis, *p.replicas):
            shard_specs = without_axis_specs(shard_specs, axis)
    grad_specs = nnx.from_flat_state(
        [
            (path, gradient_spec(v, p.plans[tuple(path)].update_dim, data_axis))
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        ]
    )
    run = jax.shard_map(
        functools.partial(per_device, step),
        mesh=p.mesh,
        in_specs=(state_specs, shard_specs),
        out_specs=(step.rest_specs, grad_specs, PartitionSpec(), PartitionSpec()),
        check_vma=True,
    )
    # reduce-scatters in the form the mesh's platform takes (the TrainStep's own jit sets it too)
    platform = platform_of(p.mesh)
    with rows_for(platform) if platform else contextlib.nullcontext():
        rest, grads, loss, metrics = run(p.state, batch)
    nnx.update(model, rest)
    return loss, metrics, grads


# ``explicit_train_step`` with its keywords as one ``StepOptions``: ``(out, applied)``, what
# ``explicit_train_step`` returns and whether the update applied (the mode chooser's entry)
run_step = functools.partial(update_step, sharded_value_and_grad)


def _gradients(
    model: nnx.Module, loss_fn: Callable[..., Any], batch: PyTree, options: StepOptions
) -> nnx.State:
    return sharded_value_and_grad(model, None, loss_fn, batch, options)[2]


STEPS = ModeSteps(run_step, check_placement, _gradients)  # what the chooser and compare_gradients call


def _without_single_axes(specs: PyTree, mesh: Any) -> PyTree:
    """``specs`` without the mesh's axes of size 1."""
    for axis in (a for a, n in mesh.shape.items() if n == 1):
        specs = without_axis_specs(specs, axis)
    return specs


def _device_step(model: nnx.Module, loss_fn: Callable[..., Any], p: Prologue, o: StepOptions) -> DeviceStep:
    """The ``DeviceStep`` of ``model``'s step on ``p``: its gradient function, its units, its plans."""
    value_and_grad: Callable[..., Any] = local_value_and_grad
    stack = pipeline_of(o, p.mesh, model)  # the staged stack's path, or None: no pipeline
    if stack is not None:
        value_and_grad = functools.partial(
            pipelined_value_and_grad,
            schedule=o.schedule,
            stage_axis=STAGE_AXIS,
            stack_path=stack,
            virtual_stages=staged_chunks(model),
        )
    precision = o.precision
    split_loss = with_aux(loss_fn if precision is None else precision.loss_fn(loss_fn, o.has_aux), o.has_aux)
    # nothing split over one device: no gather, no unit (replicas alone)
    single = p.mesh.shape.get(p.data_axis, 1) == 1
    if single:
        p = dataclasses.replace(p, plans={path: ParamSplit(None, None) for path in p.plans})
    units = {} if single else unit_paths(model)
    in_unit = frozenset(  # the split parameters of the units; the rest are gathered and reduced as before
        tuple(path)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if units and v.get_metadata().get(UNIT_KEY)
    )
    # a unit's parameters stay split until the unit runs (substrax.explicit._units)
    gather_plans = {q: ParamSplit(None, None) if q in in_unit else plan for q, plan in p.plans.items()}
    one_device = math.prod(p.mesh.shape[a] for a in spec_axes(p.rows)) == 1
    rest_specs = _without_single_axes(nnx.get_partition_spec(nnx.state(model, nnx.Not(nnx.Param))), p.mesh)
    return DeviceStep(p, o, value_and_grad, split_loss, units, in_unit, gather_plans, one_device, rest_specs)


def per_device(
    step: DeviceStep, state: nnx.State, shard: PyTree
) -> tuple[nnx.State, nnx.State, jax.Array, dict[str, Any]]:
    """One device's share of the step: ``(rest, grads, loss, metrics)``, each reduced."""
    model = nnx.merge(step.opening.graphdef, state)
    if step.one_device:
        held, (loss, metrics, grads) = _grads_on_one_device(step, model, shard)
    else:
        held, (loss, metrics, grads) = _grads_over_devices(step, model, shard)
    if step.options.precision is not None:  # the update runs in the parameters' own dtype
        grads = cast_like(grads, held)
    rows, reduce = step.opening.rows, step.options.reduce
    check_reduced_over_other_axes(loss, metrics, rows)
    if step.options.microbatches > 1:
        metrics = fold_microbatch_metrics(metrics, reduce)
    if step.one_device:
        metrics = reduce_metrics_on_one_device(metrics, reduce)
    else:
        with jax.named_scope(scopes.METRICS):
            metrics = reduce_metrics_collective(metrics, reduce, rows)
    rest = nnx.state(model, nnx.Not(nnx.Param))
    if not step.one_device:
        rest = settle_per_device_state(rest, step.rest_specs, rows)
    return rest, grads, loss, metrics


def _grads_on_one_device(step: DeviceStep, model: nnx.Module, shard: PyTree) -> tuple[Any, Any]:
    """``(held, (loss, metrics, grads))`` where the rows are on one device: no collective."""
    precision, p = step.options.precision, step.opening
    held = {path: v.get_value() for path, v in param_vars(model).items()}
    if precision is not None:
        for variable in param_vars(model).values():
            variable.set_value(precision.cast_params(variable.get_value()))
    return held, _value_and_grad(step, model, shard, p.rows, one_device=True)


def _grads_over_devices(step: DeviceStep, model: nnx.Module, shard: PyTree) -> tuple[Any, Any]:
    """``(held, (loss, metrics, grads))`` with the parameters gathered and the gradients reduced."""
    precision, p, data_axis = step.options.precision, step.opening, step.opening.data_axis
    param_dtype, reduce_dtype = None if precision is None else precision.param_dtype, _reduce_dtype(precision)
    units = bool(step.units)
    held = gather_whole_varying(  # with units, the rest is the root unit: gathered together
        model, step.gather_plans, data_axis, param_dtype, units, rows=p.rows
    )
    running = units_running(
        model,
        step.units,
        data_axis,
        p.plans,
        step.in_unit,
        param_dtype,
        reduce_dtype,
        prefetched_units(model),
    )
    with per_device_random_streams(model, p.rows), running:
        loss, metrics, grads = _value_and_grad(step, model, shard, p.rows, one_device=False)
    if precision is not None:  # reduced in the policy's dtype
        grads = jax.tree.map(lambda g: g.astype(reduce_dtype), grads)
    grads = reduce_gradients(grads, p.plans, data_axis, done=step.in_unit, grouped=units, replicas=p.replicas)
    return held, (loss, metrics, grads)


def _value_and_grad(
    step: DeviceStep, model: nnx.Module, shard: PyTree, rows: str | tuple[str, ...], *, one_device: bool
) -> tuple[jax.Array, Any, nnx.State]:
    """``step.value_and_grad`` on this device's ``shard``, its rows split over ``rows``."""
    o = step.options
    share = Share(step.opening.specs, rows, o.microbatches, one_device, _reduce_dtype(o.precision))
    return step.value_and_grad(model, step.split_loss, shard, share)


def _reduce_dtype(precision: MixedPrecision | None) -> Any:
    """The dtype the gradients are reduced in: the policy's, or None (their own)."""
    return None if precision is None else precision.reduce_dtype
