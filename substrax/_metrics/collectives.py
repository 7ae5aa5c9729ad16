"""Collectives over a named mesh axis (in ``shard_map`` or ``pmap``), on every array leaf of a tree."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import numpy as np

from substrax._base.specs import spec_axes
from substrax._base.trees import is_array, map_arrays
from substrax._metrics.reductions import REDUCTION_OPS

__all__ = [
    "all_gather",
    "require_axis",
    "to_varying_over",
    "collect_from_devices",
    "reduce_collective",
    "reduce_max_collective",
    "reduce_mean_collective",
    "reduce_min_collective",
    "reduce_sum_collective",
    "to_varying",
    "varying_axes",
    "zeros_of_type",
]

T = TypeVar("T")
V = TypeVar("V")


def to_varying_over(x: Any, axis: str | tuple[str, ...]) -> Any:
    """``x`` cast to varying over each axis of ``axis`` it does not vary over yet (no communication)."""
    missing = tuple(a for a in spec_axes(axis) if a not in (varying_axes(x) or ()))
    return to_varying(x, missing if len(missing) > 1 else missing[0]) if missing else x


def require_axis(axis_name: str | tuple[str, ...], where: str) -> None:
    """Raise a ValueError naming ``axis_name`` and the bound axes unless it is bound (not jax's error)."""
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
        bound = (
            f"the enclosing shard_map's axes are {manual}"
            if manual
            else "no shard_map or pmap encloses the call"
        )
        raise ValueError(
            f"{where}: axis {axis_name!r} is not bound here ({bound}). Call it inside "
            f"jax.shard_map over a mesh with that axis, or pass axis_name= one of its axes."
        ) from None


def _collective(op: Any, metrics: T, axis_name: str, where: str) -> T:
    require_axis(axis_name, where)
    return map_arrays(lambda x: op(x, axis_name), metrics)


def reduce_collective(name: str, metrics: T, axis_name: str) -> T:
    """``metrics`` (any pytree), every array leaf reduced across ``axis_name`` by ``REDUCTION_OPS[name]``.

    Raises:
      ValueError: If ``axis_name`` is not bound by an enclosing shard_map or pmap.
    """
    return _collective(REDUCTION_OPS[name].collective, metrics, axis_name, f"reduce_{name}_collective")


def reduce_mean_collective(metrics: T, axis_name: str = "batch") -> T:
    """Average every array leaf across ``axis_name`` (``lax.pmean``); other leaves pass through."""
    return reduce_collective("mean", metrics, axis_name)


def reduce_sum_collective(metrics: T, axis_name: str = "batch") -> T:
    """Sum every array leaf across ``axis_name`` (``lax.psum``); other leaves pass through."""
    return reduce_collective("sum", metrics, axis_name)


def reduce_max_collective(metrics: T, axis_name: str = "batch") -> T:
    """Every array leaf's elementwise maximum across ``axis_name`` (``lax.pmax``); others pass through."""
    return reduce_collective("max", metrics, axis_name)


def reduce_min_collective(metrics: T, axis_name: str = "batch") -> T:
    """Every array leaf's elementwise minimum across ``axis_name`` (``lax.pmin``); others pass through."""
    return reduce_collective("min", metrics, axis_name)


# jax >= 0.12 spells an all_gather whose result is equal on every device `to="invarying"`;
# 0.11 had `all_gather_invariant`. Under check_vma=True only such a result may leave
# shard_map through a replicated out_spec.
if "to" in inspect.signature(jax.lax.all_gather).parameters:

    def gather_invariant(x: Any, axis_name: str, *, axis: int = 0, tiled: bool = False) -> Any:
        """``all_gather`` whose result is typed equal on every device (may leave through ``P()``)."""
        # jax >= 0.12.1 gathers only a value typed varying over the axis: one equal on every
        # device is cast first (no communication; its copies are gathered, as before)
        x = to_varying_over(x, axis_name) if varying_axes(x) is not None else x
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")

elif hasattr(jax.lax, "all_gather_invariant"):

    def gather_invariant(x: Any, axis_name: str, *, axis: int = 0, tiled: bool = False) -> Any:
        """``all_gather`` whose result is typed equal on every device (may leave through ``P()``)."""
        return jax.lax.all_gather_invariant(x, axis_name, axis=axis, tiled=tiled)  # type: ignore[attr-defined]

else:  # pragma: no cover - older jax than pyproject allows

    def gather_invariant(x: Any, axis_name: str, *, axis: int = 0, tiled: bool = False) -> Any:
        """``all_gather`` whose result is typed equal on every device (may leave through ``P()``)."""
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def varying_axes(x: Any) -> frozenset[str] | None:
    """The mesh axes ``x`` varies over inside ``shard_map`` (none under ``check_vma=False``), or None."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.12
    if manual is not None:
        return frozenset(manual.varying)
    vma = getattr(aval, "vma", None)  # jax 0.11
    return None if vma is None else frozenset(vma)


def zeros_of_type(aval: Any) -> jax.Array:
    """Zeros of ``aval``'s shape, dtype and varying axes (a symbolic zero made real)."""
    zero = jax.numpy.zeros(aval.shape, aval.dtype)
    manual = getattr(aval, "manual_axis_type", None)
    axes = tuple(manual.varying) if manual is not None else tuple(getattr(aval, "vma", ()) or ())
    return to_varying_over(zero, axes) if axes else zero


def to_varying(x: Any, axis_name: str) -> Any:
    """Cast a value equal on every device to varying over ``axis_name`` (no communication, none in grad)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axis_name, to="varying")
    return jax.lax.pvary(x, axis_name)  # type: ignore[attr-defined]  # jax 0.11


def all_gather(metrics: T, axis_name: str = "batch", *, tiled: bool = False) -> T:
    """Gather metrics from all devices, inside ``shard_map`` or ``pmap``; the result is equal on every device.

    Args:
      metrics: The metrics to gather: a mapping, or any pytree of them.
      axis_name: The name of the axis to gather across.
      tiled: ``False`` stacks the devices' values on a new leading axis; ``True``
        concatenates them on the existing one (the shards' per-example values become
        the global batch's, in order).

    Returns:
      ``metrics`` with every array leaf gathered across the axis.

    Raises:
      ValueError: If ``axis_name`` is not bound by an enclosing shard_map or pmap.
    """
    return _collective(
        lambda x, axis: gather_invariant(x, axis, tiled=tiled), metrics, axis_name, "all_gather"
    )


def collect_from_devices(metrics: Mapping[str, V]) -> dict[str, list[jax.Array] | V]:
    """Split per-device values (outside ``pmap``/``shard_map``) from their leading device axis into lists.

    Args:
      metrics: The metrics from all devices, the first dimension the device axis.

    Returns:
      A dictionary of metrics, arrays split into per-device lists; a value that is not an
      array, or has no leading axis, is kept as it is.
    """
    collected: dict[str, list[jax.Array] | V] = {}
    for name, value in metrics.items():
        array: Any = value
        collected[name] = (
            [array[i] for i in range(array.shape[0])] if is_array(array) and np.ndim(array) else value
        )
    return collected
