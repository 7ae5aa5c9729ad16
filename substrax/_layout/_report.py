"""What a layout is: which leaf of the state lies where, read back from the variables' metadata."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from substrax._base.specs import spec_axes
from substrax._base.trees import adopt_assigned_arrays, path_str
from substrax._layout._owners import flat_state
from substrax._layout._specs import spec_tuple, split_dim_of, without_axis
from substrax.mesh import current_mesh, mesh_in_effect

__all__ = [
    "LAYOUTS",
    "REPLICA_AXIS",
    "REPLICA_KEY",
    "Layout",
    "LayoutKind",
    "LeafPlacement",
    "LeftWhole",
    "check_replica_axis",
    "layout_of",
    "replica_axis_of",
]

LayoutKind = Literal["replicated", "zero1", "fsdp", "hsdp"]
LAYOUTS: tuple[LayoutKind, ...] = ("replicated", "zero1", "fsdp", "hsdp")
REPLICA_AXIS = "replica"  # hybrid sharding's outer axis, by default (shard_state, the steps)
REPLICA_KEY = "hsdp_replica_axis"  # a parameter's metadata: the replica axis shard_state placed it with


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """Where one array of the state lives.

    Attributes:
      owner: ``"model"`` or ``"optimizer"``.
      path: The leaf's path, as ``model['hidden']['kernel']``.
      shape: Its global shape.
      dtype: Its dtype's name.
      split_dim: The dimension split over the data axis, or ``None`` when replicated.
      axis_size: The data axis's size.
      other_splits: ``(dim, axis, size)`` per split over another mesh axis (a layer's).
      data_axis: The data axis's name.
    """

    owner: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    split_dim: int | None
    axis_size: int
    other_splits: tuple[tuple[int, str, int], ...] = ()
    data_axis: str = "data"

    @property
    def nbytes(self) -> int:
        """The whole array's bytes."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def bytes_per_device(self) -> int:
        """What one device holds of it."""
        ways = math.prod(n for _, _, n in self.other_splits)
        return self.nbytes // ways if self.split_dim is None else self.nbytes // ways // self.axis_size

    def where(self, by_axis: bool = False) -> str:
        """``replicated``, ``split on dim 0`` (over the data axis), or each split as ``dim 0 over 'data'``
        (with ``by_axis``, or when split over another axis too)."""
        if not self.other_splits and not by_axis:
            return "replicated" if self.split_dim is None else f"split on dim {self.split_dim}"
        splits = sorted(
            [(self.split_dim, self.data_axis)] * (self.split_dim is not None)
            + [(d, a) for d, a, _ in self.other_splits]
        )
        return "; ".join(f"dim {d} over {a!r}" for d, a in splits) or "replicated"


@dataclasses.dataclass(frozen=True)
class LeftWhole:
    """A parameter a splitting layout left whole on every device, and why.

    Attributes:
      path: The parameter's path, as ``model['hidden']['kernel']``.
      shape: Its shape.
      reason: ``"small"`` (fewer than ``min_size`` elements, or a scalar),
        ``"indivisible"`` (no dimension is a multiple of the axis size) or ``"taken"``
        (each dimension that is, another mesh axis splits: a layer's own split).
    """

    path: str
    shape: tuple[int, ...]
    reason: Literal["small", "indivisible", "taken"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which leaf of a model's and optimizer's state went where; ``str()`` prints a table.

    Attributes:
      kind: ``"replicated"``, ``"zero1"``, ``"fsdp"`` or ``"hsdp"``.
      axis: The data axis.
      axis_size: Its size.
      rows: One ``LeafPlacement`` per array of the state.
      asked: The layout ``shard_state`` was asked for; ``None`` from ``layout_of``.
      min_size: ``shard_state``'s ``min_size``; ``None`` from ``layout_of``.
      left_whole: The parameters a splitting layout left whole, and why (``LeftWhole``).
    """

    kind: LayoutKind
    axis: str
    axis_size: int
    rows: tuple[LeafPlacement, ...]
    asked: LayoutKind | None = None
    min_size: int | None = None
    left_whole: tuple[LeftWhole, ...] = ()

    @property
    def bytes_per_device(self) -> int:
        """The state's bytes on one device."""
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def total_bytes(self) -> int:
        """The state's bytes, counted once (what one device holds when replicated)."""
        return sum(r.nbytes for r in self.rows)

    def split(self) -> tuple[LeafPlacement, ...]:
        """The rows split over the axis."""
        return tuple(r for r in self.rows if r.split_dim is not None)

    def whole_summary(self, named: int = 4) -> str:
        """``left_whole`` counted by reason, all but those below ``min_size`` named (``named`` each)."""

        def listed(reason: str) -> tuple[int, str]:
            found = [w for w in self.left_whole if w.reason == reason]
            names = ", ".join(f"{w.path} {w.shape}" for w in found[:named])
            return len(found), names + (f" and {len(found) - named} more" if len(found) > named else "")

        small = sum(w.reason == "small" for w in self.left_whole)
        parts = [f"{small} of fewer than {self.min_size:,} elements (min_size)"] if small else []
        odd, names = listed("indivisible")
        if odd:
            parts.append(f"{odd} with no dimension a multiple of {self.axis_size}: {names}")
        taken, names = listed("taken")
        if taken:
            parts.append(f"{taken} with every such dimension split over another axis: {names}")
        if not parts:
            return ""
        count = len(self.left_whole)
        return f"{count} parameter{'s' * (count != 1)} left whole: " + ", ".join(parts)

    def __str__(self) -> str:
        width = max([len(r.path) for r in self.rows] + [4])
        others = {a: n for r in self.rows for _, a, n in r.other_splits}
        beside = "".join(
            f", beside the layers' splits over {a!r} ({n} devices)" for a, n in sorted(others.items())
        )
        asked = f" ({self.asked} asked)" if self.asked not in (None, self.kind) else ""
        whole = self.whole_summary()
        lines = [
            f"layout {self.kind}{asked} over {self.axis!r} ({self.axis_size} devices){beside}: "
            f"{self.bytes_per_device:,} state bytes per device of {self.total_bytes:,}"
            + (f"; {whole}" if whole else ""),
            f"{'leaf':<{width}}  {'shape':<14} {'dtype':<8} where",
        ]
        by_axis = any(r.other_splits for r in self.rows)  # a 2-D layout names each split's axis
        for r in self.rows:
            lines.append(f"{r.path:<{width}}  {str(r.shape):<14} {r.dtype:<8} {r.where(by_axis)}")
        return "\n".join(lines)


def layout_of(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    *,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    axis_size: int | None = None,
    kind: LayoutKind | None = None,
    axis: str | None = None,
) -> Layout:
    """The layout ``model`` and ``optimizer`` have now, read from their variables' metadata.

    Args:
      model: The model.
      optimizer: Its optimizer.
      mesh: The mesh, for the axis's size when no array is placed on one.
      data_axis: The data axis.
      axis_size: The axis's size; default: from the mesh the arrays are placed on, else
        ``mesh`` or the one set by ``jax.set_mesh``, else 1 (nothing placed: every
        device that runs it holds it whole).
      kind: The layout's name; default: ``"fsdp"`` when a parameter is split,
        ``"zero1"`` when only optimizer state is, else ``"replicated"``.
      axis: The older spelling of ``data_axis``.
    """
    adopt_assigned_arrays(optimizer)  # an array assigned where the optimizer held a variable
    axis = data_axis if axis is None else axis
    axis_size, sizes = _axis_sizes(model, optimizer, mesh, axis, axis_size)
    rows = _rows(model, optimizer, axis, axis_size, sizes)
    return Layout(_kind_of(model, rows) if kind is None else kind, axis, axis_size, rows)


def _axis_sizes(
    model: nnx.Module, optimizer: nnx.Optimizer[Any], mesh: Mesh | None, axis: str, axis_size: int | None
) -> tuple[int, dict[str, int]]:
    """``axis``'s size (``axis_size`` if given) and each mesh axis's, from the mesh the state is on."""
    if axis_size is not None:
        try:
            return axis_size, dict(current_mesh(mesh).shape)
        except ValueError:
            if mesh is not None:
                raise
            return axis_size, {}
    meshes = [
        v.get_value().sharding.mesh
        for _, v in flat_state((model, optimizer))
        if isinstance(getattr(v.get_value(), "sharding", None), NamedSharding)
    ]
    with_axis = [m for m in meshes if axis in m.axis_names]
    found = with_axis[0] if with_axis else mesh_in_effect(mesh) or (meshes[0] if meshes else None)
    return (1, {}) if found is None else (found.shape.get(axis, 1), dict(found.shape))  # no axis: one device


def _rows(
    model: nnx.Module, optimizer: nnx.Optimizer[Any], axis: str, axis_size: int, sizes: dict[str, int]
) -> tuple[LeafPlacement, ...]:
    """One ``LeafPlacement`` per array of the state (typed keys left out), read from its metadata."""
    rows = []
    for owner, tree in (("model", model), ("optimizer", optimizer)):
        for path, variable in flat_state(tree):
            value = variable.get_value()
            if not hasattr(value, "shape") or jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                continue
            shape = tuple(value.shape)
            others = tuple(
                (d, a, sizes.get(a, 1))
                for d, entry in enumerate(without_axis(spec_tuple(variable), len(shape), axis))
                for a in spec_axes(entry)
            )
            split = split_dim_of(spec_tuple(variable), axis)
            name, dtype = path_str(path, owner), np.dtype(value.dtype).name
            rows.append(LeafPlacement(owner, name, shape, dtype, split, axis_size, others, axis))
    return tuple(rows)


def _kind_of(model: nnx.Module, rows: tuple[LeafPlacement, ...]) -> LayoutKind:
    """``"fsdp"`` (``"hsdp"`` with a replica axis) when a parameter is split, ``"zero1"`` when only
    optimizer state is, else ``"replicated"``."""
    split_model = any(r.split_dim is not None and r.owner == "model" for r in rows)
    split_opt = any(r.split_dim is not None and r.owner == "optimizer" for r in rows)
    kind: LayoutKind = "fsdp" if split_model else "zero1" if split_opt else "replicated"
    meshes = [getattr(getattr(v.get_value(), "sharding", None), "mesh", None) for v in _params_of(model)]
    hybrid = replica_axis_of(model) is not None
    if kind == "fsdp" and (hybrid or any(REPLICA_AXIS in getattr(m, "axis_names", ()) for m in meshes)):
        kind = "hsdp"
    return kind


def replica_axis_of(model: Any) -> str | None:
    """The replica axis ``shard_state(..., layout="hsdp")`` placed ``model`` with, or None."""
    return next((a for v in _params_of(model) if (a := v.get_metadata().get(REPLICA_KEY)) is not None), None)


def check_replica_axis(model: Any, replica_axis: str, rows: str | tuple[str, ...]) -> None:
    """Refuse a step built with another ``replica_axis`` than the one the state was placed with.

    ``rows``: the axes the step splits the batch's rows over.
    """
    placed = replica_axis_of(model)
    if placed is None or placed == replica_axis:
        return
    over = " and ".join(repr(a) for a in ((rows,) if isinstance(rows, str) else rows))
    raise ValueError(
        f"The state was placed with shard_state(..., layout='hsdp', replica_axis={placed!r}), but the "
        f"step was built with replica_axis={replica_axis!r}: it would split the batch's rows over {over} "
        f"only, each {placed!r} replica computing the same rows. Build the step with "
        f"make_train_step(..., replica_axis={placed!r}), or place the state with "
        f"replica_axis={replica_axis!r}."
    )


def _params_of(model: Any) -> list[Any]:
    return [v for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
