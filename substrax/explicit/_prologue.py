"""The opening both explicit gradients share: the mesh, the batch's rows, the parameters' plans, the state."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from substrax._base.specs import spec_axes
from substrax._base.trees import KeyPath, PyTree
from substrax._batch.placement import batch_partition_specs
from substrax._layout import ParamSplit, check_mesh_axes, check_replica_axis, model_roles, parameter_splits
from substrax._shared.microbatch import check_microbatches, split_rows_over
from substrax.explicit._shard import check_layers_take_blocks
from substrax.mesh import current_mesh

__all__ = ["Prologue", "Share", "open_step", "parameter_plans"]


@dataclasses.dataclass(frozen=True)
class Prologue:
    """Where an explicit gradient runs and what it splits, read once before its ``shard_map``.

    Attributes:
      mesh: The mesh.
      data_axis: The mesh axis the state is split over (on a mesh without it, the replica
        axis where the mesh has one: the rows' only axis).
      specs: The batch's partition specs.
      rows: The axes the batch's rows are split over: ``data_axis``, or ``(replica, data)``
        for hybrid sharding, where the loss, the metrics and the gradient are reduced over both.
      replicas: The axes of ``rows`` other than ``data_axis``.
      plans: Each parameter's ``ParamSplit`` over ``data_axis``.
      graphdef: The model's graph, merged again on each device.
      state: The model's state, the ``shard_map``'s first input.
      state_specs: The state's partition specs.
    """

    mesh: Any
    data_axis: str
    specs: PyTree
    rows: str | tuple[str, ...]
    replicas: tuple[str, ...]
    plans: dict[KeyPath, ParamSplit]
    graphdef: Any
    state: nnx.State
    state_specs: PyTree


@dataclasses.dataclass(frozen=True)
class Share:
    """How a device takes its share of the gradient (``local_value_and_grad``, ``pipelined_value_and_grad``).

    Attributes:
      specs: The batch's partition specs.
      rows: The axes the batch's rows are split over; the parameters vary over them.
      microbatches: Microbatches per step.
      one_device: The rows are on one device: nothing varies over ``rows``, no collective runs.
      accumulate_dtype: The dtype the microbatches' gradients are summed in, or None (their own).
    """

    specs: PyTree
    rows: str | tuple[str, ...]
    microbatches: int = 1
    one_device: bool = False
    accumulate_dtype: Any = None


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


def open_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any] | None,
    batch: PyTree,
    *,
    mesh: Any,
    data_axis: str,
    batch_spec: Any,
    replica_axis: str,
    microbatches: int = 1,
    check_replica: bool = True,
) -> Prologue:
    """The ``Prologue`` of a gradient of ``model`` on ``batch``, each argument checked.

    ``check_replica``: refuse a state placed with another ``replica_axis``
    (``check_replica_axis``).

    Raises:
      ValueError: If there is no mesh, two roles share an axis or, on a mesh without
        ``data_axis``, an axis has none (``model_roles``), the batch is split over another
        role's axis (``AxisRoles.check_batch``), the state was placed with
        another replica axis, ``batch_spec`` does not fit the batch, ``microbatches`` does
        not divide the rows per device, or a parameter cannot be split as placed.
    """
    mesh = current_mesh(mesh)
    roles = model_roles(model, mesh, data_axis, replica_axis)  # the roles checked first
    hybrid = roles.rows
    if data_axis not in mesh.axis_names and isinstance(hybrid, str):
        data_axis = hybrid  # a data axis of one device: the replica axis alone splits the rows
    if check_replica:
        check_replica_axis(model, replica_axis, hybrid)
    specs = batch_partition_specs(batch, batch_spec, mesh, hybrid)
    roles.check_batch(specs)
    rows = split_rows_over(specs, data_axis, hybrid)
    check_microbatches(microbatches, batch, specs, mesh, rows)
    plans = parameter_plans(model, optimizer, mesh, data_axis)
    graphdef, state = nnx.split(model)
    return Prologue(
        mesh=mesh,
        data_axis=data_axis,
        specs=specs,
        rows=rows,
        replicas=tuple(a for a in spec_axes(rows) if a != data_axis),
        plans=plans,
        graphdef=graphdef,
        state=state,
        state_specs=nnx.get_partition_spec(state),
    )
