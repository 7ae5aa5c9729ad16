"""A PartitionSpec against a mesh: the axes each entry names, and whether an array fits it."""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec

from substrax._base.trees import KeyPath, path_str


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axis names one PartitionSpec entry splits a dimension over."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def check_spec_axes(spec: PartitionSpec, mesh: Any, *, where: str) -> None:
    """Raise a ValueError naming any axis of ``spec`` that ``mesh`` lacks."""
    for entry in spec:
        for axis in spec_axes(entry):
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{where}: axis {axis!r} of {spec} is not in the mesh, whose axes are "
                    f"{tuple(mesh.axis_names)}. Use one of those axes, or build the mesh with "
                    f"{axis!r}."
                )


def check_fits(
    path: KeyPath,
    shape: tuple[int, ...],
    spec: PartitionSpec,
    mesh: Any,
    *,
    local: bool,
    root: str = "batch",
    replicate_hint: str = (
        "pass a pytree prefix of shardings with NamedSharding(mesh, PartitionSpec()) for it"
    ),
) -> None:
    """Raise a ValueError unless an array of ``shape`` can be split as ``spec`` says.

    Args:
      path: The leaf's key path, for the message.
      shape: The leaf's shape (this process's rows when ``local``).
      spec: The partition spec it goes on.
      mesh: The mesh (concrete for ``local``; abstract is fine otherwise).
      local: Whether ``shape`` is the process-local slice, split over the devices of
        this process only.
      root: What the tree is called in the message (``batch``, ``state``).
      replicate_hint: How the caller's user replicates a leaf instead, for the message.
    """
    partitioned = [i for i, entry in enumerate(spec) if spec_axes(entry)]
    if partitioned and len(shape) <= partitioned[-1]:
        raise ValueError(
            f"{path_str(path, root)} has shape {shape} ({len(shape)} dimensions), but {spec} "
            f"splits dimension {partitioned[-1]}. A value without that axis (a scalar, a "
            f"batch-level setting) must be replicated: {replicate_hint}."
        )
    sizes = mesh.local_mesh.shape if local else mesh.shape
    for dim in partitioned:
        axes = spec_axes(spec[dim])
        ways = math.prod(sizes[a] for a in axes)
        if shape[dim] % ways:
            axis_text = " x ".join(f"{a!r} ({mesh.shape[a]})" for a in axes)
            scope = " on this process" if local and jax.process_count() > 1 else ""
            what = " (the batch size: drop or pad the last rows)" if root == "batch" and dim == 0 else ""
            raise ValueError(
                f"{path_str(path, root)} has size {shape[dim]} along dimension {dim}{scope}, which "
                f"does not divide by {ways}, the size of mesh axis {axis_text} it is split "
                f"over. Make that size a multiple of {ways}{what}."
            )
