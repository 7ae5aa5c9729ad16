"""The expected communication of a pipelined step (census guide, "Pipelines").

A pipeline adds, beside its layout's collectives over ``data`` (each once per step): per
tick of the schedule's loop a permute of one stage's carry (the microbatch's activation,
and the arrays that travel with it) to the next stage, and of its cotangent (the
floating leaves) to the previous one; after the loop the sum over ``stage`` of the
gradient of the parameters outside the stack (the first and last stages hold their
shares) and of the metrics stacked over microbatches (the last stage's); on a ``data``
axis of one device, the loss's sum over ``stage``. GPipe runs its forward ticks in one
loop and their transpose in another; 1F1B its warm-up, steady state and cool-down in three.
Interleaved 1F1B permutes around the ring of stages (the last stage's chunk feeding stage 0's
next), a tick running one chunk's layers, and moves the chunks to their stages before the
loops and their gradients home after (``chunk_rounds``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from flax import nnx

from substrax._base import scopes
from substrax._base.specs import spec_axes
from substrax._base.trees import path_str
from substrax._layout import STAGE_AXIS, STAGE_KEY, spec_tuple, without_axis
from substrax._shared.pipeline_record import PipelineRun
from substrax._shared.schedule import bubble_ratio
from substrax.census._expected import ExpectedCollective, _hlo_type

__all__ = ["outside_leaves", "permute_items", "pipeline_items", "pipeline_note", "stage_unit_items"]

_Aval = tuple[tuple[int, ...], np.dtype[Any]]
_DEAD = (
    "XLA drops a loop's cotangent that no gradient reads: that of an argument the parameters do not "
    "reach (a mask computed by a comparison)"
)
_IMPLICIT = (
    "implicit mode: XLA places an argument that travels with the carry (it may stay whole on every stage)"
)
_LAST = (
    "the last loop with this slot runs one tick, whose send nothing reads (no later tick receives it): "
    "XLA may drop it"
)


def _buffer(aval: _Aval) -> str:
    shape, dtype = aval
    return f"{_hlo_type(dtype, dtype.itemsize)}[{','.join(map(str, shape))}]"


def _bytes(aval: _Aval) -> int:
    return math.prod(aval[0]) * aval[1].itemsize


def _ticks(n: int) -> str:
    return f"{n} tick{'s' * (n != 1)}"


_PHASES = {(True, False): "warm-up", (True, True): "steady state", (False, True): "cool-down"}


def _loops(run: PipelineRun) -> list[tuple[str, int, bool, bool, bool]]:
    """``(name, iterations, forward, backward, weight)`` per loop of the schedule: GPipe's forward
    ticks and their transpose; 1F1B's warm-up (forward slots), steady state (both), cool-down
    (backward); ZB-H1's the same, with its weight slots beside the backward ones."""
    if run.schedule == "gpipe":
        return [
            ("GPipe's forward loop", run.ticks, True, False, False),
            ("GPipe's backward loop", run.ticks, False, True, False),
        ]
    label = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "interleaved-1f1b": "interleaved 1F1B"}[run.schedule]
    return [(f"{label}'s {_PHASES[f, b]}", stop - start, f, b, w) for start, stop, f, b, w in run.phases]


def stage_unit_items(units: list[ExpectedCollective], run: PipelineRun) -> list[ExpectedCollective]:
    """FSDP units inside a stage, per loop of the schedule: ``units`` are ``unit_items``'s for one
    tick (one microbatch); each runs in the loops that run its slot, once per tick and layer (the
    census counts the bubble's ticks too: the tick's ``cond`` skips them at run time). A forward
    gather runs in the forward slots; the backward slots run the reduce-scatter, the backward
    gather and, in 1F1B (which recomputes the stage's forward pass there), the forward gather again.
    ZB-H1's backward slots run the forward gather again and the backward gather; its weight slots
    the backward gather again (a layer's pullback gathers its parameters each time it runs) and
    the reduce-scatter."""
    out = []
    zb = run.schedule == "zb-h1"
    for item in units:
        if item.what.startswith("root unit"):  # the parameters outside every unit: once per step
            out.append(item)
            continue
        recomputed = item.what.endswith("recomputed")
        forward = item.kind == "all-gather" and not item.optional
        for loop, ticks, has_forward, has_backward, has_weight in _loops(run):
            if forward:
                slots = [("", has_forward)]
            elif zb and item.kind == "reduce-scatter":
                slots = [("", has_weight)]
            elif zb and not recomputed:  # the backward gather: both halves' pullbacks gather
                slots = [(" (input-gradient slot)", has_backward), (" (weight slot)", has_weight)]
            else:
                slots = [("", has_backward)]
            required = recomputed and run.schedule != "gpipe"
            for slot, runs in slots:
                if runs:
                    out.append(
                        dataclasses.replace(
                            item, what=f"{item.what}{slot}, {_ticks(ticks)} of {loop}",
                            bytes=item.bytes * ticks // run.virtual_stages, in_loop=True,
                            optional=item.optional and not required,
                            why="" if required else item.why,
                        )
                    )  # fmt: skip
    return out


def permute_items(run: PipelineRun, implicit: bool = False) -> list[ExpectedCollective]:
    """Each tick's permutes of the carry (forward, ``+1``) and its cotangent (backward, ``-1``).

    One buffer per carry leaf and loop of the schedule (bytes per step: one tick's times the
    loop's iterations); the cotangent only of the floating leaves. None on one stage.
    ``implicit``: the leaves after the first (XLA places them) optional both ways.
    """
    if run.stages < 2:
        return []
    items = []
    floating = [a for a in run.carry if np.issubdtype(a[1], np.inexact)]
    gpipe = run.schedule == "gpipe"
    loops = _loops(run)
    # the last loop with forward (backward) slots: a tick of its own sends a carry (cotangent) nothing reads
    final = {shift: max(i for i, lp in enumerate(loops) if lp[2 if shift == 1 else 3]) for shift in (1, -1)}
    for index, (loop, ticks, forward, backward, _) in enumerate(loops):
        for name, leaves, shift, on in (
            ("carry", run.carry, 1, forward),
            ("cotangent", floating, -1, backward),
        ):
            phase = ("forward" if shift == 1 else "backward") if gpipe else None
            to = "next" if shift == 1 else "previous"
            ring = run.virtual_stages > 1  # around the ring: the pairs are no one step
            for i, aval in enumerate(leaves if on else ()):
                leaf = "" if len(leaves) == 1 else f" leaf {i}"
                # the stack's input's cotangent is leaf 0
                last = ticks == 1 and index == final[shift] and not gpipe
                optional = last or (i > 0 and (shift == -1 or implicit))
                items.append(
                    ExpectedCollective(
                        "collective-permute",
                        f"pipeline: {name}{leaf} to the {to} stage{' (a ring)' * ring}, "
                        f"{_ticks(ticks)} of {loop}",
                        _bytes(aval) * ticks, "pipeline", scopes=(scopes.PIPELINE,), buffer=_buffer(aval),
                        phase=phase, axes=(STAGE_AXIS,), in_loop=ticks > 1, shift=None if ring else shift,
                        optional=optional,
                        why=(_LAST if last else _IMPLICIT if implicit else _DEAD) if optional else "",
                    )
                )  # fmt: skip
    return items


def outside_leaves(
    model: nnx.Module, data_axes: tuple[str, ...], sizes: dict[str, int]
) -> list[tuple[str, _Aval]]:
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
        ways = [math.prod(sizes.get(a, 1) for a in spec_axes(e)) for e in spec]
        shape = tuple(n // w for n, w in zip(value.shape, ways, strict=True))
        out.append((path_str(tuple(path), "model"), (shape, np.dtype(value.dtype))))
    return out


def pipeline_items(
    run: PipelineRun, model: nnx.Module, data_axes: tuple[str, ...], sizes: dict[str, int]
) -> list[ExpectedCollective]:
    """What a pipelined step communicates over ``stage`` (explicit mode), per device and step.

    ``data_axes``: the axes the step splits rows over (``data``, with hybrid sharding the
    replica axis too); ``sizes``: the mesh's axis sizes.
    """
    if run.mode == "implicit":  # XLA places the global view's carry: its rows split over the data axes
        rows = math.prod(sizes.get(a, 1) for a in data_axes)
        x = run.carry[0]  # the stack's input, rows first (the other leaves: only leaf 0's permutes required)
        carry = (((x[0][0] // rows, *x[0][1:]), x[1]) if x[0] and x[0][0] % rows == 0 else x, *run.carry[1:])
        items = permute_items(dataclasses.replace(run, carry=carry), implicit=True)
        return [dataclasses.replace(i, scopes=(), shift=None, phase=None) for i in items]
    items = permute_items(run)
    if run.stages < 2:
        return items
    common = dict(scopes=(scopes.PIPELINE,), axes=(STAGE_AXIS,))
    for way, aval in run.moved:  # interleaved: a chunk's piece a round, to its stage and home
        what = "to the stage that runs it" if way == "out" else "its gradient (or draws) home"
        items.append(ExpectedCollective(
            "collective-permute", f"pipeline: a chunk {what}", _bytes(aval), "pipeline", buffer=_buffer(aval),
            **common,
        ))  # fmt: skip
    for path, aval in outside_leaves(model, data_axes, sizes):
        items.append(
            ExpectedCollective(
                "all-reduce",
                f"pipeline: {path}'s gradient, over stages",
                _bytes(aval),
                "pipeline",
                buffer=_buffer(aval),
                **common,
            )  # fmt: skip
        )
    for i, aval in enumerate(run.aux):
        items.append(
            ExpectedCollective(
                "all-reduce", f"pipeline: metrics leaf {i}, the last stage's, over stages", _bytes(aval),
                "pipeline", scopes=(scopes.METRICS,), axes=(STAGE_AXIS,), buffer=_buffer(aval),
            )
        )  # fmt: skip
    if math.prod(sizes.get(a, 1) for a in data_axes) == 1:  # else one sum over data and stage: the loss's
        items.append(
            ExpectedCollective("all-reduce", "loss", 4, "loss", scopes=(scopes.LOSS,), axes=(STAGE_AXIS,))
        )
    return items


def pipeline_note(run: PipelineRun) -> str:
    """The schedule in a line: its loops, their ticks, the bubble."""
    loops = ", ".join(f"{loop} {ticks}" for loop, ticks, *_ in _loops(run))
    k = run.microbatches
    bubble = bubble_ratio(run.stages, k, run.schedule, run.virtual_stages)
    formula = {
        "zb-h1": "3 (stages - 1) / (4 microbatches + 3 (stages - 1))",
        "interleaved-1f1b": f"(stages - 1) / ({run.virtual_stages} microbatches + stages - 1)",
    }.get(run.schedule, "(stages - 1) / (microbatches + stages - 1)")
    return (
        f"pipeline: {run.schedule} over {run.stages} stages, {k} microbatches; ticks per "
        f"loop: {loops}; bubble {formula} = {bubble} ({float(bubble):.0%}). The census counts a "
        f"collective inside these loops once per tick; a stage's own work there (a unit's gathers) runs "
        f"under the tick's cond, skipped in the bubble"
    )
