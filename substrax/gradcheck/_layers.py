"""What ``compare_gradients`` reads of the model's layers: the axes they reduce over, and those
whose batch statistics, under ``shard_map``, come from each device's shard alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx


def _axis_names(node: nnx.Module) -> tuple[Any, ...]:
    """A layer's ``axis_name`` (``nnx.BatchNorm(axis_name=...)`` and the like), as a tuple."""
    axis_name = getattr(node, "axis_name", None)
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def layer_axis_names(model: nnx.Module) -> tuple[str, ...]:
    """The axis names the model's layers reduce over (``nnx.BatchNorm(axis_name=...)`` and the like)."""
    names: list[str] = []
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for name in _axis_names(node):
                if isinstance(name, str) and name not in names:
                    names.append(name)
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class ShardStatistics:
    """A layer that computes statistics from each device's shard alone, when the batch is split.

    ``kind`` is the layer's class name; ``batchnorm``: it is an ``nnx.BatchNorm`` (whose
    ``axis_name`` is ``axis_name``); otherwise a layer that updates the ``nnx.BatchStat``
    variables ``stats``.
    """

    path: str
    kind: str
    batchnorm: bool
    axis_name: Any
    stats: tuple[str, ...]

    def __str__(self) -> str:
        """``path (axis_name=...)`` or ``path (Kind: stat, ...)``, as the diagnosis names it."""
        if self.batchnorm:
            return f"{self.path} (axis_name={self.axis_name!r})"
        return f"{self.path} ({self.kind}: {', '.join(self.stats)})"


def per_shard_statistics(
    model: nnx.Module, before: nnx.State, after: nnx.State, data_axis: str
) -> list[ShardStatistics]:
    """The layers whose batch statistics, under shard_map, come from each device's shard alone.

    An ``nnx.BatchNorm`` in training mode (``use_running_average=False``, or its
    statistics updated by the loss) whose ``axis_name`` does not name ``data_axis``, and
    any other layer whose ``nnx.BatchStat`` variables the loss updated, unless its
    ``axis_name`` names ``data_axis``.
    """

    def batch_stats(state: nnx.State) -> dict[tuple[Any, ...], np.ndarray]:
        return {
            tuple(path): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(state)
            if isinstance(var, nnx.BatchStat)
        }

    old, new = batch_stats(before), batch_stats(after)
    updated = {p for p, v in old.items() if p in new and not np.array_equal(v, new[p], equal_nan=True)}
    found = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        where = tuple(path)
        own = [p for p in updated if p[:-1] == where]
        axis_name = getattr(node, "axis_name", None)
        if data_axis in _axis_names(node):
            continue
        batchnorm = isinstance(node, nnx.BatchNorm)
        if (batchnorm and getattr(node, "use_running_average", True) is False) or own:
            found.append(
                ShardStatistics(
                    ".".join(map(str, where)) or "(the model)",
                    type(node).__name__,
                    batchnorm,
                    axis_name,
                    tuple(".".join(map(str, p)) for p in sorted(own, key=str)),
                )
            )
    return found


_BATCHNORM = (
    "nnx.BatchNorm in training mode at {named}: under shard_map each device normalizes "
    "its shard with that shard's own batch statistics (mean and variance over its rows), "
    "not the global batch's that the reference and the implicit path use, so the loss "
    "itself differs, and with it the gradient (its reduction over the devices may be "
    "right). Give the layer axis_name={axis!r} (nnx.BatchNorm(..., "
    "axis_name={axis!r})): the statistics are then averaged over the data axis and "
    "equal the global batch's. Or check with the running averages (model.eval())."
)
_BATCH_STATS = (
    "nnx.BatchStat variables updated by the loss at {named}: if the layer computes them "
    "from its input, under shard_map each device computes them from its own shard, and "
    "they differ from the global batch's. Average them over {axis!r} inside the "
    "layer (jax.lax.pmean(..., {axis!r})) to use the global batch's."
)


def per_shard_statistics_text(layers: Sequence[ShardStatistics], data_axis: str) -> str:
    """Why a gradient under shard_map differs from the reference, given those layers."""
    parts = []
    for text, batchnorm in ((_BATCHNORM, True), (_BATCH_STATS, False)):
        named = ", ".join(str(layer) for layer in layers if layer.batchnorm == batchnorm)
        if named:
            parts.append(text.format(named=named, axis=data_axis))
    return " ".join(parts)
