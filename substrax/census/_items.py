"""The expected communication of a step, kind by kind: parameters, units, replicas, layers, metrics."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from substrax._base import scopes
from substrax._base.declared import Declared
from substrax._base.specs import spec_axes
from substrax._base.trees import KeyPath, path_str
from substrax._layout import (
    UNIT_KEY,
    parameter_splits,
    prefetched_units,
    spec_tuple,
    split_dim_of,
    unit_paths,
    without_axis,
)
from substrax._shared.options import StepOptions
from substrax._shared.scatter import block_of, block_shape, on_tpu
from substrax.census._expected import ExpectedCollective, _hlo_type, _itemsize

__all__ = [
    "batch_stat_items",
    "cross_replica_items",
    "layer_items",
    "parameter_leaves",
    "unit_items",
    "update_dims",
]


def update_dims(model: nnx.Module, optimizer: nnx.Optimizer[Any], axis: str) -> dict[KeyPath, int | None]:
    """Per parameter path: the dimension the optimizer updates a slice on, ``None`` if whole.

    The parameter's own split dimension (FSDP), else that of the optimizer state
    mirroring it (ZeRO-1): the dimension its gradient is reduce-scattered on
    (``substrax._layout.parameter_splits``, the reading the explicit step uses).
    """
    return {path: split.update_dim for path, split in parameter_splits(model, optimizer, axis).items()}


def parameter_leaves(
    model: nnx.Module, optimizer: nnx.Optimizer[Any], axis: str, sizes: dict[str, int] | None = None
) -> list[tuple[str, tuple[int, ...], Any, bool]]:
    """``(path, shape, dtype, split)`` per parameter, as ``expected_communication`` takes them.

    ``split``: the parameter, or the optimizer state mirroring it, is split over ``axis``.
    ``shape``: what one device of an ``axis`` group holds of it: the global shape with
    every dimension the layer splits over another mesh axis (``model``) divided by that
    axis's size, from ``sizes`` (the mesh's axis sizes).
    """
    dims = update_dims(model, optimizer, axis)
    leaves = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        shape = tuple(
            n // math.prod((sizes or {}).get(a, 1) for a in spec_axes(entry))
            for n, entry in zip(
                value.shape, without_axis(spec_tuple(variable), value.ndim, axis), strict=True
            )
        )
        leaves.append((path_str(tuple(path), "model"), shape, value.dtype, dims[tuple(path)] is not None))
    return leaves


def unit_items(
    model: nnx.Module,
    leaves: list[tuple[str, tuple[int, ...], Any, bool]],
    options: StepOptions,
    n: int,
    precision: Any,
    communicated: Any,
    layered: dict[KeyPath, int] | None = None,
    recomputed: bool = False,
    platform: str | None = None,
) -> tuple[list[tuple[str, tuple[int, ...], Any, bool]], list[ExpectedCollective]]:
    """The leaves outside every FSDP unit, and each unit's expected buffers (explicit mode).

    The split parameters outside every unit are the root unit: one all-gather before the
    forward pass and one reduce-scatter after the backward (after the microbatch loop),
    per dtype and set of other axes. Per unit and dtype: an all-gather in the forward
    pass, another in the backward with ``reshard_after_forward`` (optional: AD drops it
    for a unit whose input needs no gradient, such as the first), and one reduce-scatter
    of its gradient; with
    microbatches, each runs once per microbatch, inside the loop. A stacked unit that
    ran one layer at a time (``nnx.scan``; ``layered``: unit path -> layers, recorded
    while the step was traced) moves one layer's buffer per iteration, inside the loop.
    ``recomputed`` (the program recomputes under remat): each forward gather may run again.
    A stack run with ``prefetch`` (``_prefetched_items``) runs its own loop.
    """
    layered = layered or {}
    units = unit_paths(model)
    prefetched = prefetched_units(model) & set(layered)
    if not units:
        return leaves, []
    owner, others = _unit_owners(model, leaves, options.data_axis)
    k = options.microbatches
    tiles = on_tpu(platform)  # a reduce-scatter's blocks, as the step writes it (_shared.scatter)
    items = []
    for (unit, kind, dtype, _), sizes in _moved(leaves, owner, others, precision).items():
        size, elements = _itemsize(dtype, communicated), sum(sizes)
        layers = layered.get(unit, 1) if unit else 1
        buffer = f"{_hlo_type(dtype, size)}[{n},{elements // (n * layers)}]"
        if kind == "reduce" and tiles:  # on a TPU: tiles per device, padded to them (explicit._units)
            per_layer, buffer = scatter_buffer([k // layers for k in sizes], n, dtype, size, tiles)
            elements = per_layer * layers
        if not unit:  # the root unit: gathered once before the forward pass, reduced once after
            items.append(_root_item(kind, elements * size, buffer))
            continue
        name = path_str(unit, "model")
        if unit in prefetched:  # its own loop: the first layer of each pass outside it
            items += _prefetched_items(name, kind, elements * size // layers, layers, k, buffer)
            continue
        in_loop = k > 1 or layers > 1
        items += _unit_collectives(name, kind, elements * size * k, buffer, in_loop, recomputed, units[unit])
    return [leaf for leaf in leaves if leaf[0] not in owner], items


def _unit_owners(
    model: nnx.Module, leaves: list[tuple[str, tuple[int, ...], Any, bool]], axis: str
) -> tuple[dict[str, KeyPath], dict[str, tuple[str, ...]]]:
    """Each split parameter's unit (the root: ``()``), and the other mesh axes it is split over (an axis
    of one device splits nothing: nothing varies over it, so its buffer is the unsplit ones')."""
    split = {leaf[0] for leaf in leaves if leaf[3]}
    owner, others = {}, {}
    for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path_str(tuple(p), "model")
        if name in split:
            owner[name] = tuple(v.get_metadata().get(UNIT_KEY) or ())
            mesh = getattr(getattr(v.get_value(), "sharding", None), "mesh", None)
            sizes = dict(getattr(mesh, "shape", {}) or {})
            axes = {a for entry in spec_tuple(v) or () for a in spec_axes(entry) if sizes.get(a, 2) > 1}
            others[name] = tuple(sorted(axes - {axis}))
    return owner, others


def _moved(
    leaves: list[tuple[str, tuple[int, ...], Any, bool]],
    owner: dict[str, KeyPath],
    others: dict[str, tuple[str, ...]],
    precision: Any,
) -> dict[tuple[KeyPath, str, str, tuple[str, ...]], list[int]]:
    """(unit, pass, dtype, other axes) -> each parameter's elements: a buffer per dtype and per set of
    other axes (a parameter split over model and one whole over it do not share one), in the policy's
    dtypes."""
    moved: dict[tuple[KeyPath, str, str, tuple[str, ...]], list[int]] = {}
    for path, shape, dtype, _ in leaves:
        if path in owner:
            for kind, want in (
                ("gather", None if precision is None else precision.param_dtype),
                ("reduce", None if precision is None else precision.reduce_dtype),
            ):
                floating = jnp.issubdtype(np.dtype(dtype), jnp.floating)
                key = (
                    owner[path],
                    kind,
                    np.dtype(want if want is not None and floating else dtype).name,
                    others[path],
                )
                moved.setdefault(key, []).append(math.prod(shape))
    return moved


def _root_item(kind: str, nbytes: int, buffer: str) -> ExpectedCollective:
    """The root unit's buffer: its parameters gathered before the forward pass, or reduced after."""
    if kind == "reduce":
        return ExpectedCollective("reduce-scatter", "root unit", nbytes, "gradients",
                                  scopes=(scopes.GRAD_REDUCE,), buffer=buffer)  # fmt: skip
    return ExpectedCollective("all-gather", "root unit", nbytes, "parameters",
                              scopes=(scopes.GATHER_PARAMS,), buffer=buffer)  # fmt: skip


def _unit_collectives(
    name: str, kind: str, nbytes: int, buffer: str, in_loop: bool, recomputed: bool, reshard: bool
) -> list[ExpectedCollective]:
    """A unit's buffers of one pass (``nbytes`` per step): its gradient's reduce-scatter, or its
    forward gather, again under remat (``recomputed``) and for the backward (``reshard``)."""
    common = dict(scopes=(scopes.UNIT,), buffer=buffer, in_loop=in_loop)
    if kind == "reduce":
        return [ExpectedCollective("reduce-scatter", f"unit {name}", nbytes, "gradients", **common)]
    items = [ExpectedCollective("all-gather", f"unit {name} forward", nbytes, "parameters", **common)]
    if recomputed:  # under nnx.remat the forward pass runs again in the backward, gather and all
        items.append(
            ExpectedCollective(
                "all-gather", f"unit {name} forward, recomputed", nbytes, "parameters",
                optional=True, why="run again only where the unit is under remat (nnx.remat)", **common,
            )
        )  # fmt: skip
    if reshard:  # reshard_after_forward: gathered again for the backward pass
        items.append(
            ExpectedCollective(
                "all-gather", f"unit {name} backward", nbytes, "parameters", optional=True,
                why="AD needs no backward gather for a unit whose input takes no gradient (the first)",
                **common,
            )
        )  # fmt: skip
    return items


def scatter_buffer(sizes: Sequence[int], n: int, dtype: Any, itemsize: int, tiles: bool) -> tuple[int, str]:
    """The elements and the buffer (``"f32[8,8,128]"``) of the explicit step's reduce-scatter of
    parameters of ``sizes`` elements over ``n`` devices, with ``tiles`` a TPU's (``block_of``)."""
    rows, columns = block_of([k // n for k in sizes], np.dtype(dtype).itemsize, tiles)
    return n * rows * columns, f"{_hlo_type(dtype, itemsize)}[{n},{rows},{columns}]"


def tiled_scatters(
    items: Sequence[ExpectedCollective],
    leaves: list[tuple[str, tuple[int, ...], Any, bool]],
    n: int,
    platform: str | None,
) -> list[ExpectedCollective]:
    """``items`` with each split parameter's own reduce-scatter as the explicit step writes it for
    ``platform``: on a TPU in tiles, padded (``substrax._shared.scatter``); elsewhere unchanged."""
    if not on_tpu(platform):
        return list(items)
    elements = {path: math.prod(shape) for path, shape, _, split in leaves if split}
    out = []
    for item in items:
        if item.kind == "reduce-scatter" and item.what in elements and item.buffer:
            e, kind = elements[item.what], item.buffer.split("[")[0]
            rows, columns = block_shape(-(-e // n), item.bytes // e, True)
            item = dataclasses.replace(
                item, bytes=n * rows * columns * item.bytes // e, buffer=f"{kind}[{n},{rows},{columns}]"
            )
        out.append(item)
    return out


def _prefetched_items(
    name: str, kind: str, layer: int, layers: int, k: int, buffer: str
) -> list[ExpectedCollective]:
    """A prefetched stack's buffers (``substrax.explicit._prefetch``): per pass, the first
    layer's gather before the loop and the other layers' inside it; each layer's gradient
    reduce-scattered inside the backward loop, layer 0's after it. ``layer``: one layer's bytes."""
    common = dict(scopes=(scopes.UNIT,), buffer=buffer)
    if kind == "reduce":
        return [
            ExpectedCollective("reduce-scatter", f"unit {name} layer 0", layer * k, "gradients",
                               in_loop=k > 1, **common),
            ExpectedCollective("reduce-scatter", f"unit {name} layers 1-{layers - 1}",
                               layer * (layers - 1) * k, "gradients", in_loop=k > 1 or layers > 2, **common),
        ]  # fmt: skip
    why = "a parameter its layer's gradient does not read (a bias) is not gathered for the backward pass"
    return [
        ExpectedCollective("all-gather", f"unit {name} {phase}, {which}", layer * runs * k, "parameters",
                           in_loop=k > 1 or runs > 1, phase=phase, optional=phase == "backward",
                           why=why if phase == "backward" else "", **common)
        for phase, ends in (("forward", 0), ("backward", layers - 1))
        for which, runs in ((f"layer {ends}", 1), ("prefetched", layers - 1))
    ]  # fmt: skip


def cross_replica_items(
    leaves: list[tuple[str, tuple[int, ...], Any, bool]],
    options: StepOptions,
    sizes: dict[str, int],
    precision: Any,
    communicated: Any,
    platform: str | None = None,
) -> list[ExpectedCollective]:
    """Hybrid sharding's once-per-step reduction across replicas: every split gradient's
    slice (a ``1/|data|`` of it, in the policy's reduce dtype), summed over the replica
    axis after the reduce-scatter over the data axis (explicit mode: one all-reduce, a
    buffer per slice; on a TPU each slice as its block of whole tiles, ``to_tiles``)."""
    n = sizes.get(options.data_axis, 1)  # a mesh without it: one device
    items = []
    for path, shape, dtype, split in leaves:
        if split:
            floating = jnp.issubdtype(np.dtype(dtype), jnp.floating)
            moved = precision.reduce_dtype if precision is not None and floating else dtype
            elements = math.prod(shape) // n
            if on_tpu(platform):
                rows, columns = block_shape(elements, np.dtype(moved).itemsize, True)
                elements = rows * columns
            items.append(
                ExpectedCollective(
                    "all-reduce", f"across {options.replica_axis!r}: {path}",
                    elements * _itemsize(moved, communicated),
                    "gradients", scopes=(scopes.GRAD_REDUCE,), axes=(options.replica_axis,),
                )
            )  # fmt: skip
    return items


def layer_items(
    layers: Sequence[Declared],
    microbatches: int,
    sizes: dict[str, int] | None = None,
    recomputed: bool = False,
) -> list[ExpectedCollective]:
    """One expected buffer per collective a layer declared (``substrax.nn.declare_forward``, ...).

    ``layers``: what ``substrax._base.declared.recording`` collected while the step was
    traced: each layer's collectives per execution, forward and backward. They run as
    often as the program's loops run the layer (``per_run``: once per microbatch inside
    the accumulation loop, once per layer of a scanned stack). Each must
    run over its axis, unless ``sizes`` (the mesh's axis sizes) gives that axis one
    device: groups of one device span no axis the census can name. ``recomputed`` (the
    program recomputes under remat): each forward collective may run again, in the backward.
    """
    again = [i for i in layers if i.phase == "forward"] if recomputed else []
    return [
        ExpectedCollective(
            i.kind,
            f"{i.layer} {i.phase}: {i.why}",
            i.bytes,
            "model",
            scopes=(
                None,
                scopes.TENSOR_PARALLEL,
            ),  # substrax.nn's own scope, or none (a layer of yours; AD's transposes)
            buffer=i.buffer,
            phase=i.phase,
            axes=() if (sizes or {}).get(i.axis) == 1 else (i.axis,),
            in_loop=microbatches > 1 if i.in_loop is None else i.in_loop,
            per_run=True,
            optional=bool(i.dead_if),
            why=i.dead_if,
        )
        for i in layers
    ] + [
        ExpectedCollective(
            i.kind,
            f"{i.layer} forward, recomputed: {i.why}",
            i.bytes,
            "model",
            scopes=(None, scopes.TENSOR_PARALLEL),
            buffer=i.buffer,
            phase="backward",
            axes=() if (sizes or {}).get(i.axis) == 1 else (i.axis,),
            in_loop=microbatches > 1 if i.in_loop is None else i.in_loop,
            per_run=True,
            optional=True,
            why="run again only where the layer is under remat (nnx.remat)",
        )
        for i in again
    ]


def _metric_items(outputs: Any, has_aux: bool) -> list[ExpectedCollective]:
    """One buffer per metric: a scalar all-reduced, per-example (or per-device) values all-gathered."""
    if not has_aux:
        return []
    _, metrics = outputs
    items = []
    for name, value in metrics.items():
        dtype = np.dtype(value.dtype)
        nbytes = math.prod(value.shape) * dtype.itemsize
        kind = "all-gather" if value.shape else "all-reduce"
        buffer = f"{_short_type(dtype)}[{','.join(map(str, value.shape))}]"
        items.append(ExpectedCollective(kind, f"metric {name!r}", nbytes, "metrics", buffer=buffer))
    return items


def batch_stat_items(model: nnx.Module, axis: str) -> list[ExpectedCollective]:
    """The explicit step's average of each replicated floating ``nnx.BatchStat`` (optional)."""
    items = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.BatchStat)):
        value = variable.get_value()
        if not hasattr(value, "shape") or not jnp.issubdtype(value.dtype, jnp.inexact):
            continue
        if split_dim_of(spec_tuple(variable), axis) is not None:
            continue
        dtype = np.dtype(value.dtype)
        items.append(
            ExpectedCollective(
                "all-reduce",
                path_str(tuple(path), "model"),
                math.prod(value.shape) * dtype.itemsize,
                "batch stats",
                optional=True,
                buffer=f"{_short_type(dtype)}[{','.join(map(str, value.shape))}]",
                why="a statistic is averaged only when the step leaves it different on each device "
                "(BatchNorm in training mode without axis_name)",
            )
        )
    return items


def _short_type(dtype: np.dtype[Any]) -> str:
    return {"f": "f", "i": "s", "u": "u", "c": "c", "b": "pred"}.get(dtype.kind, "?") + (
        "" if dtype.kind == "b" else str(dtype.itemsize * 8)
    )
