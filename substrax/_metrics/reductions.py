"""The named reductions a metric can ask for, and the check of a step's metrics; both modes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from substrax._base.trees import describe, is_array


@dataclass(frozen=True)
class Reduction:
    """One named reduction: over an array's elements, and across a named mesh axis."""

    local: Callable[[Any], Any]  # every element of one array: jnp.mean, ...
    collective: Callable[[Any, Any], Any]  # each device's value across an axis: lax.pmean, ...


# The metric reductions by name: the one table both paths read.
REDUCTION_OPS: dict[str, Reduction] = {
    "mean": Reduction(jnp.mean, jax.lax.pmean),
    "sum": Reduction(jnp.sum, jax.lax.psum),
    "max": Reduction(jnp.max, jax.lax.pmax),
    "min": Reduction(jnp.min, jax.lax.pmin),
}
REDUCTIONS = tuple(REDUCTION_OPS)
# What a training step's metric may ask for: the four, or its per-example values whole.
METRIC_REDUCTIONS = (*REDUCTIONS, "gather")


def check_reduce_fn(
    metrics: Mapping[str, Any],
    reduce_fn: Mapping[str, str | None] | None,
    *,
    allowed: tuple[str, ...] = REDUCTIONS,
    none_means: str = "leave it as it is",
) -> dict[str, str | None]:
    """Resolve each metric's operation: its entry in ``reduce_fn``, else ``"mean"``.

    Args:
      metrics: The metrics, by name: a flat mapping.
      reduce_fn: Metric name to operation.
      allowed: The operations this caller supports, besides ``None``.
      none_means: What ``None`` does here, for the error message.

    Raises:
      ValueError: Naming the metric: ``metrics`` not flat, ``reduce_fn`` naming a metric
        ``metrics`` lacks, an operation not ``allowed``, or ``"gather"`` of a 0-d value.
    """
    if not isinstance(metrics, Mapping):
        raise ValueError(f"Metrics must be a flat mapping from name to value; got {describe(metrics)}.")
    for name, value in metrics.items():
        if isinstance(value, (Mapping, tuple, list)):
            raise ValueError(
                f"Metric {name!r} is {describe(value)}; metrics must be flat, one value per "
                f"name: flatten it into names such as '{name}/...'."
            )
    reduce_fn = dict(reduce_fn or {})
    unknown = sorted(set(reduce_fn) - set(metrics))
    if unknown:
        raise ValueError(
            f"The reductions name metric(s) {unknown} that are not among the metrics "
            f"{sorted(metrics)}; fix the name, or drop the entry."
        )
    for name, op in reduce_fn.items():
        if op is not None and op not in allowed:
            raise ValueError(
                f"Metric {name!r} asks for reduction {op!r}; use one of "
                f"{', '.join(repr(a) for a in allowed)} or None ({none_means})."
            )
        if op == "gather" and is_array(metrics[name]) and np.ndim(metrics[name]) == 0:
            raise ValueError(
                f"Metric {name!r} asks for 'gather', which collects per-example values (one "
                f"per row of the batch), but it is a scalar; reduce it, or return its "
                f"per-example values."
            )
    return {name: reduce_fn.get(name, "mean") for name in metrics}
