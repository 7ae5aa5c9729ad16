"""Metric reductions over global arrays (the implicit path): plain ``jnp``; XLA adds collectives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from substrax._base.trees import is_array, map_arrays
from substrax._metrics.reductions import METRIC_REDUCTIONS, REDUCTION_OPS, check_reduce_fn

__all__ = ["reduce_custom", "reduce_max", "reduce_mean", "reduce_metrics", "reduce_min", "reduce_sum"]

T = TypeVar("T")
V = TypeVar("V")


def _reduce_elements(name: str, metrics: T) -> T:
    """``metrics`` with every array leaf of at least one dimension reduced by ``name``."""
    return map_arrays(REDUCTION_OPS[name].local, metrics, min_ndim=1)


def reduce_mean(metrics: T) -> T:
    """Mean of every array leaf with a dimension (global arrays), at any depth; others pass."""
    return _reduce_elements("mean", metrics)


def reduce_sum(metrics: T) -> T:
    """Sum of every array leaf with a dimension (global arrays), at any depth; others pass."""
    return _reduce_elements("sum", metrics)


def reduce_max(metrics: T) -> T:
    """Maximum of every array leaf with a dimension (global arrays), at any depth; others pass."""
    return _reduce_elements("max", metrics)


def reduce_min(metrics: T) -> T:
    """Minimum of every array leaf with a dimension (global arrays), at any depth; others pass."""
    return _reduce_elements("min", metrics)


def reduce_custom(
    metrics: Mapping[str, V], reduce_fn: Mapping[str, str | None] | None = None
) -> dict[str, V | jnp.ndarray]:
    """Reduce each metric (an array with a dimension) by its named operation.

    Args:
      metrics: The metrics to reduce, by name.
      reduce_fn: Metric name to ``"mean"``, ``"sum"``, ``"max"``, ``"min"`` or ``None``
        (left as it is); unlisted metrics, or all when ``None``, get ``"mean"``.

    Returns:
      A dictionary of reduced metrics.

    Raises:
      ValueError: If an operation is not one of those, ``reduce_fn`` names a metric
        ``metrics`` lacks (naming it), or ``metrics`` is not a flat mapping.
    """
    ops = check_reduce_fn(metrics, reduce_fn)
    reduced: dict[str, V | jnp.ndarray] = {}
    for name, value in metrics.items():
        op = ops[name]
        if op is not None and is_array(value) and jnp.ndim(value) > 0:  # type: ignore[arg-type]
            reduced[name] = REDUCTION_OPS[op].local(value)
        else:
            reduced[name] = value
    return reduced


def _replicated(value: Any, mesh: Mesh | AbstractMesh | None) -> Any:
    """``value`` constrained to be whole on every device of ``mesh`` (or the current mesh, if any)."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not is_array(value):
        return value
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh, PartitionSpec()))


def reduce_metrics(
    metrics: Mapping[str, V],
    reduce: Mapping[str, str | None] | None = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
) -> dict[str, V | jnp.ndarray]:
    """Reduce a training step's metrics, computed on the global batch, by name.

    The implicit twin of ``substrax.explicit.reduce_metrics_collective``: the same
    ``reduce`` gives the same values, replicated (see the metrics guide).

    Args:
      metrics: Metric name to its value on the global batch.
      reduce: Metric name to ``"mean"`` (the default for unlisted names), ``"sum"``,
        ``"max"``, ``"min"``, ``"gather"`` (per-example values, replicated over the mesh
        so every process can read them) or ``None`` (kept as it is).
      mesh: The mesh ``"gather"`` replicates over; ``None`` takes the one set by
        ``jax.set_mesh``, and without one leaves the values where they are.

    Returns:
      The reduced metrics, by name.

    Raises:
      ValueError: If ``metrics`` is not flat, ``reduce`` names a metric it lacks, an
        operation is not one of the above, or ``"gather"`` is asked of a scalar; the
        message names the metric.
    """
    ops = check_reduce_fn(metrics, reduce, allowed=METRIC_REDUCTIONS)
    reduced: dict[str, V | jnp.ndarray] = {}
    for name, value in metrics.items():
        op = ops[name]
        if op is not None and op in REDUCTION_OPS and is_array(value):
            reduced[name] = REDUCTION_OPS[op].local(value)
        elif op == "gather":
            reduced[name] = _replicated(value, mesh)
        else:
            reduced[name] = value
    return reduced
