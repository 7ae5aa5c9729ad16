"""Each mesh axis's role in a step (data, replica, stage, model), resolved and checked in one place.

The batches guide, "Axis roles", says what each role does and what a mesh without one means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from substrax._base.specs import spec_axes
from substrax._base.trees import path_str

__all__ = ["STAGE_AXIS", "AxisRoles", "axis_roles"]

STAGE_AXIS = "stage"
"""The axis a pipeline's stages split over (``shard_state(..., stages=)``)."""


@dataclasses.dataclass(frozen=True)
class AxisRoles:
    """The axes of a step's roles on one mesh; an axis the mesh lacks has one device.

    Attributes:
      shape: The mesh's axes, name to size.
      data: The data axis (``data_axis``): rows split over it, the layouts' state too.
      replica: The replica axis (``replica_axis``): rows split over it too, ``"hsdp"``
        state replicated across it.
      stage: The axis the pipeline's stages split over.
      model: The axes the model's layers split over (their own declarations), or None when
        the model is not known yet.
    """

    shape: dict[str, int]
    data: str
    replica: str
    stage: str = STAGE_AXIS
    model: tuple[str, ...] | None = None

    @property
    def rows(self) -> str | tuple[str, ...]:
        """The axes a batch's rows are split over: ``data``, after ``replica`` where the mesh
        has it (``("replica", "data")``); those the mesh lacks left out (``()``: rows whole)."""
        axes = tuple(a for a in (self.replica, self.data) if a in self.shape)
        return axes[0] if len(axes) == 1 else axes

    def check_batch(self, specs: Any) -> None:
        """Refuse a batch leaf split over the stage axis, or its rows over an axis the model's layers
        split over (``specs``: the batch's tree of ``PartitionSpec``); the ValueError names the leaf."""
        flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))[0]
        for path, spec in flat:
            if any(self.stage in spec_axes(e) for e in spec):
                raise ValueError(
                    f"batch_spec splits {path_str(path, 'batch')} as {spec}, over the pipeline's stage axis "
                    f"{self.stage!r}: every stage runs every microbatch, so no batch is split over it. "
                    f"Split the rows over the data axis, or leave them whole on a mesh without it."
                )
            shared = [a for a in (spec_axes(spec[0]) if len(spec) else ()) if a in (self.model or ())]
            if shared:
                raise ValueError(
                    f"batch_spec splits the rows of {path_str(path, 'batch')} as {spec}, over {shared[0]!r}, "
                    f"the axis the model's layers split over: every device of a layer's group must see the "
                    f"same rows. Split the rows over the data axis, or leave them whole on a mesh without it."
                )


def _checked_name(role: str, name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{role} must be a mesh axis name (a non-empty str); got {name!r}.")
    return name


def _refuse_shared(roles: AxisRoles) -> None:
    """Raise a ValueError naming two roles given one axis."""
    on = f" (mesh {roles.shape})" if roles.shape else ""
    named = [
        (f"data_axis={roles.data!r}", roles.data),
        (f"replica_axis={roles.replica!r}", roles.replica),
        (f"the pipeline's stage axis {roles.stage!r}", roles.stage),
    ]
    named += [(f"the axis the model's layers split over, {a!r},", a) for a in roles.model or ()]
    for i, (first, axis) in enumerate(named):
        for second, other in named[i + 1 :]:
            if axis == other:
                raise ValueError(
                    f"{first} and {second} name the same mesh axis{on}: each role needs an axis of its "
                    f"own (the rows split over the data axis, the pipeline's stages over {roles.stage!r}, "
                    f"a layer's blocks over its model axis, hybrid sharding's replicas over the replica "
                    f"axis). A mesh may leave the data or replica axis out: the rows are then not split "
                    f"over it (an axis of one device). So for an axis the mesh lacks keep the default "
                    f"name (data_axis='data', replica_axis='replica') rather than another role's axis."
                )


def _refuse_unclaimed(roles: AxisRoles) -> None:
    """On a mesh without the data axis, raise naming an axis of several devices no role claims."""
    claimed = {roles.replica, roles.stage, *(roles.model or ())}
    idle = [a for a, n in roles.shape.items() if n > 1 and a not in claimed]
    if idle:
        raise ValueError(
            f"Axis {roles.data!r} is not in the mesh, whose axes are {tuple(roles.shape)}. A mesh may "
            f"leave the data axis out (the rows are then not split), but then its axis {idle[0]!r} "
            f"({roles.shape[idle[0]]} devices) has no role: it is not the replica axis {roles.replica!r}, "
            f"the stage axis {roles.stage!r}, nor an axis the model's layers split over, so every device "
            f"along it would compute the same thing. Pass data_axis={idle[0]!r} to split the rows over "
            f"it, or build the mesh with {roles.data!r}."
        )


def axis_roles(
    mesh: Any,
    data_axis: str = "data",
    replica_axis: str = "replica",
    *,
    model_axes: Iterable[str] | None = None,
) -> AxisRoles:
    """The ``AxisRoles`` of a step on ``mesh``, checked: two roles never share an axis.

    A role whose axis ``mesh`` lacks has one device along it. Without the data axis, every
    axis of several devices must have another role: the replica or stage axis, or one of
    ``model_axes`` (checked only when they are given: an unclaimed axis most likely means a
    misnamed data axis).

    Args:
      mesh: A ``Mesh`` or ``AbstractMesh``.
      data_axis: The data axis's name.
      replica_axis: The replica axis's name.
      model_axes: The axes the model's layers split over, or None (not known yet).

    Raises:
      TypeError: If an axis name is not a non-empty str.
      ValueError: If two roles name the same axis (naming both and the axis), or, with
        ``model_axes``, the mesh lacks the data axis and an axis of it has no role.
    """
    shape = {str(a): int(n) for a, n in dict(getattr(mesh, "shape", {}) or {}).items()}
    roles = AxisRoles(
        shape,
        _checked_name("data_axis", data_axis),
        _checked_name("replica_axis", replica_axis),
        model=None if model_axes is None else tuple(dict.fromkeys(model_axes)),
    )
    _refuse_shared(roles)
    if roles.model is not None and roles.data not in shape:
        _refuse_unclaimed(roles)
    return roles
