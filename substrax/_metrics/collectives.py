"""Collectives over a named mesh axis, applied to every array leaf of a metrics tree.

These run inside ``jax.shard_map`` (or ``jax.pmap``), where each device holds its own
value and ``axis_name`` names the axis to reduce over. Every array leaf, 0-d included,
is reduced at any depth; any other leaf (a string, a Python number) passes through.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import numpy as np

from substrax._batch.axes import spec_axes
from substrax._metrics.reductions import REDUCTION_OPS
from substrax._tree import is_array, map_arrays

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
]

T = TypeVar("T")
V = TypeVar("V")


def to_varying_over(x: Any, axis: str | tuple[str, ...]) -> Any:
    """``x`` cast to varying over each axis of ``axis`` it does not vary over yet (no communication)."""
    missing = tuple(a for a in spec_axes(axis) if a not in (varying_axes(x) or ()))
    return to_varying(x, missing if len(missing) > 1 else missing[0]) if missing else x


def require_axis(axis_name: str | tuple[str, ...], where: str) -> None:
    """Raise a ValueError unless ``axis_name`` is bound by an enclosing ``shard_map`` or ``pmap``.

    jax's own failure for an unbound or mistyped axis is a bare ``AssertionError`` or
    ``NameError`` deep in its tracing; this names the axis and the ones that are bound.
    """
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
        bound = f"the enclosing shard_map's axes are {manual}" if manual else "no shard_map or pmap encloses the call"
        raise ValueError(
            f"{where}: axis {axis_name!r} is not bound here ({bound}). Call it inside "
            f"jax.shard_map over a mesh with that axis, or pass axis_name= one of its axes."
        ) from None


def _collective(op: Any, metrics: T, axis_name: str, where: str) -> T:
    require_axis(axis_name, where)
    return map_arrays(lambda x: op(x, axis_name), metrics)


def reduce_collective(name: str, metrics: T, axis_name: str) -> T:
    """``metrics`` with every array leaf reduced across ``axis_name`` by the reduction ``name``.

    The body of every ``reduce_*_collective``: ``name`` is a key of ``REDUCTION_OPS``
    (``"mean"``: ``lax.pmean``, ``"sum"``: ``lax.psum``, ``"max"``: ``lax.pmax``,
    ``"min"``: ``lax.pmin``). Only valid inside a pmap or shard_map context; ``metrics``
    is a mapping or any pytree of them, and a leaf that is not an array passes through.

    Raises:
      ValueError: If ``axis_name`` is not bound by an enclosing shard_map or pmap.
    """
    return _collective(REDUCTION_OPS[name].collective, metrics, axis_name, f"reduce_{name}_collective")


def reduce_mean_collective(metrics: T, axis_name: str = "batch") -> T:
    """Compute the mean of metrics using collective operations.

    Every array leaf averaged across ``axis_name`` (``lax.pmean``); other leaves pass through.
    Only inside shard_map or pmap: an axis not bound there raises a ValueError.
    """
    return reduce_collective("mean", metrics, axis_name)


def reduce_sum_collective(metrics: T, axis_name: str = "batch") -> T:
    """Compute the sum of metrics using collective operations.

    Every array leaf summed across ``axis_name`` (``lax.psum``); other leaves pass through.
    Only inside shard_map or pmap: an axis not bound there raises a ValueError.
    """
    return reduce_collective("sum", metrics, axis_name)


def reduce_max_collective(metrics: T, axis_name: str = "batch") -> T:
    """Compute the elementwise maximum of metrics across devices.

    Every array leaf's maximum across ``axis_name`` (``lax.pmax``); other leaves pass through.
    Only inside shard_map or pmap: an axis not bound there raises a ValueError.
    """
    return reduce_collective("max", metrics, axis_name)


def reduce_min_collective(metrics: T, axis_name: str = "batch") -> T:
    """Compute the elementwise minimum of metrics across devices.

    Every array leaf's minimum across ``axis_name`` (``lax.pmin``); other leaves pass through.
    Only inside shard_map or pmap: an axis not bound there raises a ValueError.
    """
    return reduce_collective("min", metrics, axis_name)


# jax >= 0.12 spells an all_gather whose result is equal on every device `to="invarying"`;
# 0.11 had `all_gather_invariant`. Under check_vma=True only such a result may leave
# shard_map through a replicated out_spec.
if "to" in inspect.signature(jax.lax.all_gather).parameters:

    def gather_invariant(x: Any, axis_name: str, *, axis: int = 0, tiled: bool = False) -> Any:
        """``all_gather`` whose result is typed equal on every device (may leave through ``P()``)."""
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
    """The mesh axes ``x`` varies over inside ``shard_map``, or None where jax can't say.

    With ``check_vma=False`` every value reports no varying axes.
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.12
    if manual is not None:
        return frozenset(manual.varying)
    vma = getattr(aval, "vma", None)  # jax 0.11
    return None if vma is None else frozenset(vma)


def to_varying(x: Any, axis_name: str) -> Any:
    """Cast a value equal on every device to varying over ``axis_name``: no communication.

    ``grad`` with respect to the result runs no collective (the transpose of the cast is
    the ``psum`` a replicated parameter's gradient would otherwise get), so each device
    keeps its own shard's gradient until the caller reduces it.
    """
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axis_name, to="varying")
    return jax.lax.pvary(x, axis_name)  # type: ignore[attr-defined]  # jax 0.11


def all_gather(metrics: T, axis_name: str = "batch", *, tiled: bool = False) -> T:
    """Gather metrics from all devices.

    Only valid inside a pmap or shard_map context. The result is equal on every device,
    so under ``shard_map(check_vma=True)`` it may leave through ``out_specs=P()``.

    Args:
      metrics: The metrics to gather: a mapping, or any pytree of them.
      axis_name: The name of the axis to gather across.
      tiled: ``False`` stacks the devices' values on a new leading axis (a scalar
        becomes a vector with one entry per device); ``True`` concatenates them along
        the existing leading axis (per-example values of the shards become the global
        batch's, in order).

    Returns:
      ``metrics`` with every array leaf gathered across the axis.

    Raises:
      ValueError: If ``axis_name`` is not bound by an enclosing shard_map or pmap.
    """
    return _collective(lambda x, axis: gather_invariant(x, axis, tiled=tiled), metrics, axis_name, "all_gather")


def collect_from_devices(metrics: Mapping[str, V]) -> dict[str, list[jax.Array] | V]:
    """Collect metrics from all devices.

    Call outside of a pmapped function to split per-device values from the leading
    device axis.

    Args:
      metrics: The metrics from all devices, with the first dimension corresponding to
        the device axis.

    Returns:
      A dictionary of metrics, with array values split into per-device lists; a value
      that is not an array, or has no leading axis, is kept as it is.
    """
    collected: dict[str, list[jax.Array] | V] = {}
    for name, value in metrics.items():
        array: Any = value
        collected[name] = [array[i] for i in range(array.shape[0])] if is_array(array) and np.ndim(array) else value
    return collected
