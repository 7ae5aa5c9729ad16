"""Named dimensions of an array, checked, and the one-axis specs and placement the strategies share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax._base.specs import spec_axes

__all__ = ["DimensionNames", "checked_names", "needs_a_dimension", "one_dimension", "place", "split_one"]

DimensionNames = tuple[str, ...]


def checked_names(names: object, who: str) -> DimensionNames:
    """``names`` as a tuple of str (one per dimension), or a TypeError naming ``who``."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(
            f"{who}: dimension_names must be a tuple of str, one per dimension, such as "
            f"('batch', 'hidden'); got {names!r} ({type(names).__name__})."
        )
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{who}: dimension names are str; got {name!r} in {tuple(names)}.")
    return tuple(names)


def one_dimension(names: DimensionNames, target: str, axis: str, who: str) -> PartitionSpec:
    """The spec splitting the dimension named ``target`` over ``axis``, the others whole."""
    if names.count(target) > 1:
        raise ValueError(
            f"{who}: {names} names {target!r} {names.count(target)} times, but mesh axis "
            f"{axis!r} can split only one dimension of an array."
        )
    return PartitionSpec(*(axis if name == target else None for name in names))


def place(array: Any, mesh: Mesh, spec: PartitionSpec, who: str) -> jax.Array:
    """``jax.device_put(array, NamedSharding(mesh, spec))``, the mesh and sizes checked first."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{who}: mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}.")
    shape = np.shape(array)
    for dim, entry in enumerate(spec):
        for axis in spec_axes(entry):
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{who}: mesh axis {axis!r} is not in the mesh, whose axes are "
                    f"{tuple(mesh.axis_names)}; build the strategy with one of those."
                )
            if shape[dim] % mesh.shape[axis]:
                raise ValueError(
                    f"{who}: dimension {dim} of an array of shape {shape} has size {shape[dim]}, "
                    f"which does not divide by {mesh.shape[axis]}, the size of mesh axis {axis!r}."
                )
    return jax.device_put(array, NamedSharding(mesh, spec))


def needs_a_dimension(array: Any, who: str, what: str) -> int:
    ndim = np.ndim(array)
    if ndim == 0:
        raise ValueError(f"{who}: a 0-d array has no {what} to split; replicate it instead.")
    return ndim


def split_one(array: Any, mesh: Mesh, axis: str, dim: int, who: str, what: str) -> jax.Array:
    """``array`` placed with dimension ``dim`` (its ``what``) split over ``axis``; a 0-d one refused."""
    spec: list[str | None] = [None] * needs_a_dimension(array, who, what)
    spec[dim] = axis
    return place(array, mesh, PartitionSpec(*spec), who)
