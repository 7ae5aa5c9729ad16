"""The expected communication of a pipelined step (census guide, "Pipelines").

A pipeline adds, beside its layout's collectives over ``data`` (each once per step): per
tick of the schedule's loop a permute of one stage's carry (the microbatch's activation,
and the arrays that travel with it) to the next stage, and of its cotangent (the
floating leaves) to the previous one; after the loop the sum over ``stage`` of the
gradient of the parameters outside the stack (the first and last stages hold their
shares) and of the metrics stacked over microbatches (the last stage's); on a ``data``
axis of one device, the loss's sum over ``stage``. GPipe runs its forward ticks in one
loop and their transpose in another; 1F1B both permutes in one loop.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flax import nnx

from substrax._batch.axes import spec_axes
from substrax._layout import STAGE_AXIS, spec_tuple, without_axis
from substrax._layout._stages import STAGE_KEY
from substrax._shared import scopes
from substrax._shared.pipeline_record import PipelineRun
from substrax._tree import path_str
from substrax.census._expected import ExpectedCollective, _hlo_type

__all__ = ["outside_leaves", "permute_items", "pipeline_items"]

_Aval = tuple[tuple[int, ...], np.dtype[Any]]


def _buffer(aval: _Aval) -> str:
    shape, dtype = aval
    return f"{_hlo_type(dtype, dtype.itemsize)}[{','.join(map(str, shape))}]"


def _bytes(aval: _Aval) -> int:
    return math.prod(aval[0]) * aval[1].itemsize


_DEAD = (
    "XLA drops a loop's cotangent that no gradient reads: that of an argument the parameters do not "
    "reach (a mask computed by a comparison)"
)


def permute_items(run: PipelineRun) -> list[ExpectedCollective]:
    """Each tick's permutes of the carry (forward, ``+1``) and its cotangent (backward, ``-1``).

    One buffer per carry leaf, in the loop of ``run.ticks`` iterations (bytes per step: one
    tick's times the ticks); the cotangent only of the floating leaves. None on one stage.
    """
    if run.stages < 2:
        return []
    items = []
    floating = [a for a in run.carry if np.issubdtype(a[1], np.inexact)]
    gpipe = run.schedule == "gpipe"
    for name, leaves, shift in (("carry", run.carry, 1), ("cotangent", floating, -1)):
        phase = ("forward" if shift == 1 else "backward") if gpipe else None
        loop = f"GPipe's {phase} loop" if gpipe else "1F1B's loop"
        for i, aval in enumerate(leaves):
            leaf = "" if len(leaves) == 1 else f" leaf {i}"
            to = "next" if shift == 1 else "previous"
            optional = shift == -1 and i > 0  # the stack's input's cotangent is leaf 0
            items.append(
                ExpectedCollective(
                    "collective-permute", f"pipeline: {name}{leaf} to the {to} stage, per tick of {loop}",
                    _bytes(aval) * run.ticks, "pipeline", scopes=(scopes.PIPELINE,), buffer=_buffer(aval),
                    phase=phase, axes=(STAGE_AXIS,), in_loop=True, shift=shift, optional=optional,
                    why=_DEAD if optional else "",
                )
            )  # fmt: skip
    return items


def outside_leaves(model: nnx.Module, data_axes: tuple[str, ...], sizes: dict[str, int]) -> list[tuple[str, _Aval]]:
    """Each parameter outside the staged stack: its path and gradient on one device, whole over
    ``data_axes`` (split over any other axis, as its layer places it)."""
    out = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if variable.get_metadata().get(STAGE_KEY) is not None:
            continue
        value = variable.get_value()
        spec = spec_tuple(variable)
        for axis in data_axes:
            spec = without_axis(spec, value.ndim, axis)
        shape = tuple(n // math.prod(sizes.get(a, 1) for a in spec_axes(e)) for n, e in zip(value.shape, spec, strict=True))
        out.append((path_str(tuple(path), "model"), (shape, np.dtype(value.dtype))))
    return out


def pipeline_items(
    run: PipelineRun, model: nnx.Module, data_axes: tuple[str, ...], sizes: dict[str, int]
) -> list[ExpectedCollective]:
    """What a pipelined step communicates over ``stage`` (explicit mode), per device and step.

    ``data_axes``: the axes the step splits rows over (``data``, with hybrid sharding the
    replica axis too); ``sizes``: the mesh's axis sizes.
    """
    items = permute_items(run)
    if run.stages < 2:
        return items
    common = dict(scopes=(scopes.PIPELINE,), axes=(STAGE_AXIS,))
    for path, aval in outside_leaves(model, data_axes, sizes):
        items.append(
            ExpectedCollective("all-reduce", f"pipeline: {path}'s gradient, over stages", _bytes(aval), "pipeline",
                               buffer=_buffer(aval), **common)  # fmt: skip
        )
    for i, aval in enumerate(run.aux):
        items.append(
            ExpectedCollective(
                "all-reduce", f"pipeline: metrics leaf {i}, the last stage's, over stages", _bytes(aval), "pipeline",
                scopes=(scopes.METRICS,), axes=(STAGE_AXIS,), buffer=_buffer(aval),
            )
        )  # fmt: skip
    if math.prod(sizes.get(a, 1) for a in data_axes) == 1:  # else one sum over data and stage: the loss's
        items.append(ExpectedCollective("all-reduce", "loss", 4, "loss", scopes=(scopes.LOSS,), axes=(STAGE_AXIS,)))
    return items
