"""Microbatches: each device's rows in k equal slices, in order; both modes (see the microbatches guide)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from substrax._base.specs import spec_axes
from substrax._base.trees import PyTree, path_str

__all__ = ["check_microbatches", "fold_microbatch_metrics", "microbatched", "split_microbatches"]


def _row_ways(spec: PartitionSpec, sizes: Mapping[str, int]) -> int:
    """How many ways a leaf's rows are split (1 when dimension 0 is not, or the spec is empty)."""
    if not len(spec) or spec[0] is None:
        return 1
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return math.prod(sizes[a] for a in axes)


def _has_rows(spec: PartitionSpec, rows: str | tuple[str, ...] | None = None) -> bool:
    """Whether a leaf on ``spec`` has rows to cut: its dimension 0 is split. On a mesh without row
    axes (``rows`` empty: a data axis of one device) nothing is split: any spec with an entry
    (the default's ``P(None)``) has rows, ``P()`` is batch-level."""
    if rows is not None and not spec_axes(rows):
        return bool(len(spec))
    return bool(len(spec)) and spec[0] is not None


def check_microbatches(
    microbatches: int,
    batch: PyTree = None,
    specs: PyTree = None,
    mesh: Any = None,
    data_axis: str | tuple[str, ...] = "data",
) -> None:
    """Refuse a ``microbatches`` that is not a positive int, or does not divide the rows per device.

    Raises:
      TypeError: If ``microbatches`` is not an int.
      ValueError: If it is below 1, or a leaf's rows per device do not divide by it;
        names the leaf, its rows per device, the devices and ``k``.
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int):
        raise TypeError(f"microbatches must be an int; got {microbatches!r}.")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1 (1: the whole shard at once); got {microbatches}.")
    if batch is None or microbatches == 1:
        return
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    for (path, leaf), spec in zip(
        leaves, jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec)), strict=True
    ):
        if not _has_rows(spec, data_axis):
            continue
        ways = _row_ways(spec, dict(mesh.shape))
        rows = np.shape(leaf)[0] // ways
        if rows % microbatches:
            raise ValueError(
                f"{path_str(tuple(path))} has {rows} rows per device ({np.shape(leaf)[0]} rows over "
                f"{ways} devices), which do not split into microbatches={microbatches} equal "
                f"microbatches. Make the rows per device a multiple of {microbatches}, or pick a "
                f"microbatch count that divides {rows}."
            )


def split_rows_over(specs: PyTree, data_axis: str, hybrid: str | tuple[str, ...]) -> str | tuple[str, ...]:
    """The axes the batch's rows are split over: ``hybrid`` (``("replica", "data")``) when a
    leaf's rows name the replica axis, else ``data_axis`` (a batch placed over ``data``
    only is the same on every replica, and reduced over ``data`` alone).

    Raises:
      ValueError: If some leaves split their rows over the replica axis and others not.
    """
    if not isinstance(hybrid, tuple):
        return data_axis
    if not hybrid:  # a mesh without row axes: the rows are not split
        return hybrid
    replicas = set(hybrid) - {data_axis}
    kinds = {
        bool(replicas & set(spec_axes(spec[0])))
        for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
        if _has_rows(spec)
    }
    if len(kinds) > 1:
        raise ValueError(
            f"Some of the batch's leaves split their rows over {sorted(replicas)} and {data_axis!r}, "
            f"others over {data_axis!r} alone; place every per-example leaf the same way "
            f"(create_data_parallel_sharding(mesh) splits rows over both)."
        )
    return hybrid if kinds == {True} or not kinds else data_axis


def split_microbatches(
    shard: PyTree, specs: PyTree, data_axis: str | tuple[str, ...], microbatches: int
) -> PyTree:
    """One device's shard as ``microbatches`` slices stacked on a new leading axis (inside shard_map);
    ``data_axis``: the axes the rows are split over."""

    def cut(x: jax.Array, spec: PartitionSpec) -> jax.Array:
        if not _has_rows(spec, data_axis):
            return jnp.broadcast_to(x, (microbatches, *jnp.shape(x)))
        return x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])

    return jax.tree.map(cut, shard, specs, is_leaf=lambda s: isinstance(s, PartitionSpec))


def split_global_microbatches(
    batch: PyTree, specs: PyTree, ways: int, microbatches: int, rows: str | tuple[str, ...] | None = None
) -> PyTree:
    """The global batch as ``microbatches`` global slices: slice j holds every device's j-th rows.

    For the implicit step, so that each microbatch keeps its rows on the device that
    loaded them: rows ``(N, k, m)`` become ``(k, N * m)``. ``rows``: the axes the rows are split over.
    """

    def cut(x: jax.Array, spec: PartitionSpec) -> jax.Array:
        if not _has_rows(spec, rows):
            return jnp.broadcast_to(x, (microbatches, *jnp.shape(x)))
        m = x.shape[0] // (ways * microbatches)
        y = x.reshape(ways, microbatches, m, *x.shape[1:])
        return jnp.swapaxes(y, 0, 1).reshape(microbatches, ways * m, *x.shape[1:])

    return jax.tree.map(cut, batch, specs, is_leaf=lambda s: isinstance(s, PartitionSpec))


def fold_microbatch_metrics(
    metrics: Mapping[str, Any], reduce: Mapping[str, str | None] | None
) -> dict[str, Any]:
    """Per-device metrics stacked over microbatches, ready for the per-device reduction.

    ``"gather"`` values ``(k, m, ...)`` become this device's rows in order ``(k * m, ...)``;
    ``"mean"``/``"sum"``/``"max"``/``"min"`` reduce every element anyway, and ``None``
    keeps the microbatch axis.
    """
    ops = dict(reduce or {})
    return {
        name: value.reshape(-1, *value.shape[2:])
        if ops.get(name) == "gather" and jnp.ndim(value) >= 2
        else value
        for name, value in metrics.items()
    }


def unfold_global_gather(value: jax.Array, ways: int) -> jax.Array:
    """Implicit mode: a gathered metric ``(k, N * m, ...)`` back in the global batch's row order."""
    k, rows = value.shape[:2]
    y = value.reshape(k, ways, rows // ways, *value.shape[2:])
    return jnp.swapaxes(y, 0, 1).reshape(k * rows, *value.shape[2:])


def microbatched(
    value_and_grad: Callable[[nnx.Module, PyTree], tuple[tuple[Any, Any], nnx.State]],
    model: nnx.Module,
    slices: PyTree,
    *,
    prepare_carry: Callable[[Callable[..., Any], Any, PyTree], Any] | None = None,
    accumulate_dtype: Any = None,
) -> tuple[tuple[jax.Array, Any], nnx.State]:
    """``value_and_grad`` over microbatches in one ``lax.scan``: the mean loss and gradient.

    ``value_and_grad(model, piece) -> ((loss, aux), grads)`` runs on each slice of
    ``slices``; the model's other state carries between slices and is written back.
    ``prepare_carry`` may retype the carry; ``accumulate_dtype`` is what gradients are
    summed in (default: the parameters' own).

    Returns:
      ``((mean loss, aux stacked on a leading microbatch axis), mean gradient)``.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    count = jax.tree.leaves(slices)[0].shape[0] if jax.tree.leaves(slices) else 1

    def body(carry: tuple[Any, Any, Any], piece: PyTree) -> tuple[tuple[Any, Any, Any], Any]:
        params, rest, total = carry  # the parameters ride along so they live at the loop's trace level
        m = nnx.merge(graphdef, params, rest)
        (loss, aux), grads = value_and_grad(m, piece)
        total = jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads)
        return (params, nnx.state(m, nnx.Not(nnx.Param)), total), (loss, aux)

    carry = (params, rest, jax.tree.map(lambda p: jnp.zeros_like(p, dtype=accumulate_dtype), params))
    if prepare_carry is not None:
        carry = prepare_carry(body, carry, jax.tree.map(lambda x: x[0], slices))
    (_, rest, total), (losses, aux) = jax.lax.scan(body, carry, slices)
    nnx.update(model, rest)
    return (jnp.mean(losses), aux), jax.tree.map(lambda g: g / count, total)
