"""The named reductions a metric can ask for, shared by both modes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

REDUCTIONS = ("mean", "sum", "max", "min")
# What a training step's metric may ask for: the four, or its per-example values whole.
METRIC_REDUCTIONS = (*REDUCTIONS, "gather")


def check_reduce_fn(
    names: Iterable[str],
    reduce_fn: Mapping[str, str | None] | None,
    *,
    allowed: tuple[str, ...] = REDUCTIONS,
) -> dict[str, str | None]:
    """Resolve each metric's operation: its entry in ``reduce_fn``, else ``"mean"``.

    Raises:
      ValueError: If an operation is not one of ``allowed`` or ``None``; the message
        names the metric and the operation, since a typo would otherwise leave the
        metric silently unreduced.
    """
    reduce_fn = dict(reduce_fn or {})
    for name, op in reduce_fn.items():
        if op is not None and op not in allowed:
            raise ValueError(
                f"Metric {name!r} asks for reduction {op!r}; use one of "
                f"{', '.join(repr(a) for a in allowed)} or None (leave it as it is)."
            )
    return {name: reduce_fn.get(name, "mean") for name in names}
