"""Metric reductions inside ``shard_map`` (the explicit path's view of a batch).

Each device computes a metric on its own shard; the collectives turn those into the
value the implicit path computes on the global batch. A metric's elements are first
reduced on the device, then across the axis, so ``"max"`` of a per-example vector is
the global maximum, and ``"mean"`` of shard means is the global mean (shards are equal
in size).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from substrax._metrics.collectives import all_gather, reduce_collective
from substrax._metrics.reductions import METRIC_REDUCTIONS, REDUCTION_OPS, check_reduce_fn
from substrax._tree import is_array

__all__ = ["reduce_metrics_collective", "reduce_metrics_on_one_device"]

def reduce_metrics_collective(
    metrics: Mapping[str, Any],
    reduce: Mapping[str, str | None] | None = None,
    axis_name: str = "data",
) -> dict[str, Any]:
    """Reduce per-device metrics across ``axis_name`` so every device holds the result.

    Only valid inside ``shard_map`` or ``pmap``. Every result is equal on every device,
    so it may leave ``shard_map(check_vma=True)`` through ``out_specs=P()``.

    Args:
      metrics: Metric name to this device's value (a scalar, or per-example values).
      reduce: Metric name to operation; a name it does not list gets ``"mean"``.
        ``"mean"``, ``"sum"``, ``"max"``, ``"min"``: reduce the value's elements on
        the device, then across devices (``pmean``, ``psum``, ``pmax``, ``pmin``).
        ``"gather"``: concatenate per-example values across devices in batch order
        (``all_gather(tiled=True)``); the global batch's values. ``None``: stack the
        devices' values unreduced on a new leading device axis
        (``all_gather(tiled=False)``), ready for ``collect_from_devices``.
      axis_name: The mesh axis to reduce across.

    Returns:
      The reduced metrics, by name. A value that is not an array passes through.

    Raises:
      ValueError: If ``metrics`` is not flat, ``reduce`` names a metric it lacks, an
        operation is not one of the above, or ``"gather"`` is asked of a scalar; the
        message names the metric.
    """
    ops = check_reduce_fn(
        metrics, reduce, allowed=METRIC_REDUCTIONS, none_means="stack the devices' values unreduced"
    )
    reduced: dict[str, Any] = {}
    for name, value in metrics.items():
        op = ops[name]
        if not is_array(value):
            reduced[name] = value
        elif op is None or op == "gather":
            reduced[name] = all_gather(value, axis_name, tiled=op == "gather")
        else:
            reduced[name] = reduce_collective(op, REDUCTION_OPS[op].local(value), axis_name)
    return reduced


def reduce_metrics_on_one_device(
    metrics: Mapping[str, Any], reduce: Mapping[str, str | None] | None = None
) -> dict[str, Any]:
    """What ``reduce_metrics_collective`` gives over an axis of size 1, with no collective."""
    ops = check_reduce_fn(
        metrics, reduce, allowed=METRIC_REDUCTIONS, none_means="stack the devices' values unreduced"
    )
    reduced: dict[str, Any] = {}
    for name, value in metrics.items():
        op = ops[name]
        if not is_array(value) or op == "gather":
            reduced[name] = value
        elif op is None:
            reduced[name] = value[None]
        else:
            reduced[name] = REDUCTION_OPS[op].local(value)
    return reduced
