"""Reading and writing a variable's placement: its ``out_sharding`` spec, axis by axis, and the split rule."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from substrax._base.roles import STAGE_AXIS, AxisRoles, axis_roles
from substrax._base.specs import spec_axes
from substrax._base.trees import path_str

__all__ = [
    "check_mesh_axes",
    "choose_split_dim",
    "declared_spec",
    "gradient_spec",
    "model_axes",
    "model_roles",
    "optional_axes",
    "spec_tuple",
    "split_dim_of",
    "trimmed",
    "with_axis",
    "without_axis",
]


def declared_spec(variable: nnx.Variable[Any]) -> tuple[Any, ...] | None:
    """A variable's ``out_sharding`` metadata as written, or None when it has none."""
    meta = variable.get_metadata()
    spec = meta.get("out_sharding", meta.get("sharding_names"))
    return None if spec is None else tuple(spec)


def optional_axes(variable: nnx.Variable[Any]) -> tuple[str, ...]:
    """The axes of its spec a mesh may lack (metadata ``optional_axes``): it is then whole over them."""
    return tuple(variable.get_metadata().get("optional_axes") or ())


def model_axes(tree: Any, data_axis: str, stage_axis: str) -> tuple[str, ...]:
    """The mesh axes ``tree``'s layers split over themselves (the model role's axes).

    Each axis a variable's spec or declaration names, but ``data_axis`` and ``stage_axis``
    (where ``shard_state`` puts the layouts' and the pipeline's splits), and each
    ``substrax.nn`` layer's own axis (``optional_axes``), whatever its name.
    """
    axes: dict[str, None] = {}
    for _, variable in nnx.to_flat_state(nnx.state(tree)):
        said = (declared_spec(variable) or ()) + tuple(variable.get_metadata().get("declared_sharding") or ())
        named = (a for e in said for a in spec_axes(e) if a not in (data_axis, stage_axis))
        axes.update(dict.fromkeys((*optional_axes(variable), *named)))
    return tuple(axes)


def model_roles(model: Any, mesh: Any, data_axis: str, replica_axis: str) -> AxisRoles:
    """``axis_roles`` of a step or layout of ``model`` on ``mesh``: its layers' axes (``model_axes``) checked
    against the other roles'; the one place ``shard_state`` and both modes resolve them."""
    axes = None if model is None else model_axes(model, data_axis, STAGE_AXIS)
    return axis_roles(mesh, data_axis, replica_axis, model_axes=axes)


def without_axes(spec: tuple[Any, ...], axes: tuple[str, ...]) -> tuple[Any, ...]:
    """``spec`` with ``axes`` dropped from every entry and trailing ``None`` entries trimmed."""
    entries = []
    for entry in spec:
        kept = tuple(a for a in spec_axes(entry) if a not in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def spec_tuple(variable: nnx.Variable[Any]) -> tuple[Any, ...] | None:
    """A variable's ``out_sharding`` metadata on the mesh set by ``jax.set_mesh``, or None.

    Its ``optional_axes`` that the mesh lacks are dropped (the variable is whole over
    them); with no mesh set, the spec as written (``declared_spec``).
    """
    spec = declared_spec(variable)
    optional = optional_axes(variable)
    if spec is None or not optional:
        return spec
    mesh = jax.sharding.get_abstract_mesh()
    absent = tuple(a for a in optional if not mesh.empty and a not in mesh.axis_names)
    return without_axes(spec, absent) if absent else spec


def split_dim_of(spec: tuple[Any, ...] | None, axis: str) -> int | None:
    """The dimension ``spec`` splits over ``axis``, or None."""
    if spec is None:
        return None
    for dim, entry in enumerate(spec):
        if entry == axis or (isinstance(entry, tuple) and axis in entry):
            return dim
    return None


def without_axis(spec: tuple[Any, ...] | None, ndim: int, axis: str) -> tuple[Any, ...]:
    """``spec`` padded to ``ndim`` entries, with ``axis`` dropped: what the layer itself declared."""
    entries = []
    for entry in tuple(spec or ()) + (None,) * (ndim - len(spec or ())):
        kept = tuple(a for a in spec_axes(entry) if a != axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(entries)


def with_axis(base: tuple[Any, ...], dim: int | None, axis: str) -> tuple[Any, ...]:
    """``base`` with ``axis`` put first on dimension ``dim`` (unchanged when ``dim`` is None)."""
    if dim is None:
        return base
    kept = (axis, *spec_axes(base[dim]))
    return (*base[:dim], kept[0] if len(kept) == 1 else kept, *base[dim + 1 :])


def gradient_spec(variable: nnx.Variable[Any], update_dim: int | None, axis: str) -> PartitionSpec:
    """Where a parameter's reduced gradient lives: its other axes as declared, ``axis`` on ``update_dim``."""
    ndim = np.ndim(variable.get_value())
    return PartitionSpec(*with_axis(without_axis(spec_tuple(variable), ndim, axis), update_dim, axis))


def choose_split_dim(
    shape: tuple[int, ...], axis_size: int, min_size: int, taken: tuple[Any, ...] = ()
) -> int | None:
    """The dimension a parameter of ``shape`` is split on, or None (see the layouts guide).

    ``taken``: the parameter's spec over other axes; a dimension split there is skipped.
    """
    if not shape or math.prod(shape) < min_size:
        return None
    fits = [
        d
        for d, n in enumerate(shape)
        if n % axis_size == 0 and n >= axis_size and (d >= len(taken) or taken[d] is None)
    ]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def check_declared_rank(variable: nnx.Variable[Any], spec: tuple[Any, ...], name: str) -> None:
    """Refuse a layer's declared split with fewer entries than its array's dimensions (a stack's)."""
    ndim = np.ndim(variable.get_value())
    if optional_axes(variable) and spec and len(spec) < ndim:
        raise ValueError(
            f"{name} has {ndim} dimensions but its layer declares a split for {len(spec)} "
            f"({PartitionSpec(*spec)}): it was stacked (nnx.vmap or nnx.scan) without "
            f"transform_metadata={{nnx.PARTITION_NAME: None}}, so the split would land on the wrong "
            f"dimension. Create the stack with nnx.vmap(..., "
            f"transform_metadata={{nnx.PARTITION_NAME: None}}), "
            f"which gives the layer axis its own (unsplit) entry."
        )


def check_mesh_axes(tree: Any, mesh: Any, owner: str) -> None:
    """Fit each variable's spec to ``mesh``, in place; refuse one naming an axis it lacks.

    An ``optional_axes`` axis is dropped (kept as ``declared_sharding``); any other is refused,
    naming the path and the axis. See the tensor-parallelism guide.
    """
    for path, variable in nnx.to_flat_state(nnx.state(tree)):
        spec = declared_spec(variable) or ()
        check_declared_rank(variable, spec, path_str(tuple(path), owner))
        names = [a for e in spec for a in spec_axes(e)]
        missing = tuple(dict.fromkeys(a for a in names if a not in mesh.axis_names))
        if not missing:
            continue
        refused = [a for a in missing if a not in optional_axes(variable)]
        if refused:
            raise ValueError(
                f"{path_str(tuple(path), owner)} is declared sharded as {PartitionSpec(*spec)}, over "
                f"mesh axis {refused[0]!r}, which the mesh {dict(mesh.shape)} lacks. Build the mesh "
                f"with that axis (substrax.mesh.create_device_mesh), or place the state with "
                f"substrax.shard_state on this mesh, which places such a split whole."
            )
        said = variable.get_metadata().get("declared_sharding") or spec
        variable.set_metadata(out_sharding=without_axes(spec, missing), declared_sharding=said)


def trimmed(spec: Any, mesh: Any = None) -> PartitionSpec:
    """``spec`` as jit writes a step's results (equal, so one program): without ``mesh``'s axes
    of size 1 (they split nothing) and without trailing ``None``s."""
    kept = []
    for entry in spec:
        if mesh is not None and isinstance(entry, (str, tuple)):
            names = [n for n in ((entry,) if isinstance(entry, str) else entry) if mesh.shape[n] > 1]
            entry = (names[0] if len(names) == 1 else tuple(names)) if names else None
        kept.append(entry)
    while kept and kept[-1] is None:
        kept.pop()
    return PartitionSpec(*kept)
