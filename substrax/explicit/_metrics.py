"""Metric reductions inside ``shard_map`` (the explicit path's view of a batch); see the metrics guide."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from substrax._base.trees import is_array
from substrax._metrics.collectives import all_gather, reduce_collective
from substrax._metrics.reductions import METRIC_REDUCTIONS, REDUCTION_OPS, check_reduce_fn

__all__ = ["reduce_metrics_collective", "reduce_metrics_on_one_device"]


def reduce_metrics_collective(
    metrics: Mapping[str, Any],
    reduce: Mapping[str, str | None] | None = None,
    axis_name: str = "data",
) -> dict[str, Any]:
    """Reduce per-device metrics across ``axis_name`` so every device holds the result.

    Only inside ``shard_map`` or ``pmap``; the results are equal on every device (they may
    leave ``shard_map(check_vma=True)`` through ``out_specs=P()``).

    Args:
      metrics: Metric name to this device's value (a scalar, or per-example values).
      reduce: Metric name to ``"mean"`` (the default for unlisted names), ``"sum"``,
        ``"max"``, ``"min"`` (on the device, then across devices), ``"gather"`` (per-example
        values in batch order) or ``None`` (stacked on a new leading device axis, for
        ``collect_from_devices``); see the metrics guide.
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
