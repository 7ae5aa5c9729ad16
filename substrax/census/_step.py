"""A training step's census held against the communication its layout calls for.

The expectation comes from the state's placement, the step's outputs, the optimizer
update compiled alone (``census._update``), explicit mode's BatchNorm averages and the
layers' declarations; see the census guide. ``TrainStep.check_communication`` calls it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from substrax._base import scopes
from substrax._base.declared import Declared
from substrax._base.trees import KeyPath
from substrax._layout import layout_of, prefetched_units
from substrax._shared.options import StepOptions
from substrax._shared.pipeline_record import PipelineRun
from substrax.census._expected import Expected, ExpectedCollective, expected_communication
from substrax.census._items import (
    _metric_items,
    batch_stat_items,
    cross_replica_items,
    layer_items,
    parameter_leaves,
    tiled_scatters,
    unit_items,
)
from substrax.census._pipeline import pipeline_items, pipeline_note, stage_unit_items
from substrax.census._platform import axis_sizes, mesh_context, program_platform
from substrax.census._report import Comparison, census, compare
from substrax.census._rows import library_scope
from substrax.census._update import update_items

__all__ = ["check_communication", "expected_step", "program_platform"]


# The scope each expected buffer of the explicit step is compiled under (explicit._step, explicit._shard),
_EXPLICIT_SCOPES = {
    "gradients": scopes.GRAD_REDUCE,
    "parameters": scopes.GATHER_PARAMS,
    "loss": scopes.LOSS,
    "metrics": scopes.METRICS,
    "batch stats": scopes.BATCH_STATS,
}
# and of the implicit step: XLA's own under none, the loss and metrics under theirs or none.
_IMPLICIT_SCOPES: dict[str, tuple[str | None, ...]] = {
    "gradients": (None,),
    "parameters": (None,),
    "loss": (None, scopes.LOSS),
    "metrics": (None, scopes.METRICS),
}


def _scoped(
    items: Sequence[ExpectedCollective], scopes: dict[str, tuple[str | None, ...]]
) -> list[ExpectedCollective]:
    return [
        dataclasses.replace(i, scopes=scopes[i.category]) if i.category in scopes and not i.scopes else i
        for i in items
    ]


def check_communication(
    lowered: jax.stages.Lowered,
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    options: StepOptions,
    *,
    layers: Sequence[Declared] = (),
    layered: dict[KeyPath, int] | None = None,
    pipeline: PipelineRun | None = None,
) -> Comparison:
    """Compile a lowered step, take its census, and compare it with what the step should communicate.

    ``lowered`` is the step lowered for ``model``, ``optimizer`` and a batch; ``options`` its
    ``StepOptions``; ``layers``, ``layered`` and ``pipeline`` what the layers declared, the FSDP
    units that ran one layer at a time and the pipeline that ran, while it was traced. See the
    census guide.
    """
    compiled = lowered.compile()
    report = census(compiled, mesh=options.mesh)
    recomputed = any("rematted_computation" in (p.op_name or "") for row in report.rows for p in row.parts)
    scoped = any(library_scope(p.op_name) for row in report.rows for p in row.parts)
    expected, notes = expected_step(
        lowered.out_info[1], model, optimizer, options,
        layers=layers, layered=layered, recomputed=recomputed, scoped=scoped,
        platform=program_platform(compiled), pipeline=pipeline,
    )  # fmt: skip
    found = compare(report, expected, attribute_model=True)
    return dataclasses.replace(found, notes=found.notes + tuple(notes)) if notes else found


def expected_step(
    out: Any,
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    options: StepOptions,
    *,
    layers: Sequence[Declared] = (),
    layered: dict[KeyPath, int] | None = None,
    recomputed: bool = False,
    scoped: bool = True,
    platform: str | None = None,
    pipeline: PipelineRun | None = None,
) -> tuple[Expected, tuple[str, ...]]:
    """What a step should communicate, built without compiling it (see ``check_communication``).

    ``out``: the step's ``(loss, metrics)`` as shapes and dtypes (``lowered.out_info[1]``);
    ``recomputed``: the program recomputes under remat (its recomputed collectives are
    optional); ``scoped``: the program names the library's scopes; ``platform``: the one
    the program is compiled for (``program_platform``; default: the step's mesh's devices',
    else jax's default backend); ``pipeline``: the pipeline the step ran. Returns the expected
    communication and notes on what it could not read (the update compiled alone failed, a
    policy's narrow collectives widened by XLA's CPU compiler) and on the pipeline's schedule.
    """
    with mesh_context(options):
        layout = layout_of(model, optimizer, mesh=options.mesh, axis=options.data_axis)
    # a prefetched stack recomputes each layer's forward pass for its gradient (explicit._prefetch)
    recomputed = recomputed or bool(prefetched_units(model) & set(layered or {}))
    loss_dtype = out[0].dtype if options.has_aux else out.dtype
    sizes = axis_sizes(options, model, optimizer)
    replicas = sizes.get(options.replica_axis, 1) if options.mode == "explicit" else 1
    piped, piped_notes = _pipeline_expected(pipeline, model, options, sizes, np.dtype(loss_dtype).itemsize)
    declared = layer_items(layers, options.microbatches, sizes, recomputed) + piped
    if layout.axis_size == 1 and replicas == 1:  # a data axis of size 1: nothing moves over it
        expected = _without_data_axis(options, model, optimizer, layout.kind, sizes, loss_dtype)
        # what the model issues itself (BatchNorm's psum over a size-1 axis_name) is attributed
        return expected.with_items(declared), piped_notes
    metrics = _metric_items(out, options.has_aux)
    update, notes = _update_or_rule(options, model, optimizer, loss_dtype)
    step = _read(model, optimizer, options, sizes, layout.axis_size, platform)
    notes = [*piped_notes, *notes, *step.notes]
    leaves, units, across = _parameter_items(step, layered, recomputed, pipeline)
    expected = expected_communication(
        leaves,
        layout=layout.kind,
        mode=options.mode,
        microbatches=options.microbatches,
        loss_bytes=np.dtype(loss_dtype).itemsize,
        update=update,
        precision=step.precision,
        communicated_dtype=step.widened,
    )
    items = [
        *_written(step, [*expected.items, *metrics], leaves, across, pipeline is not None),
        *units,
        *across,
        *declared,
    ]
    items = _optional_reductions(_step_scopes(items, model, options, scoped), metrics, options.mode)
    if not scoped:  # a step that names no scope (or compiled none of its collectives): anywhere
        items = [dataclasses.replace(i, scopes=()) for i in items]
    return dataclasses.replace(expected, items=tuple(items)), tuple(notes)


@dataclasses.dataclass(frozen=True)
class _Step:
    """What ``expected_step``'s helpers read of a step: its state and options, the mesh's axis
    sizes, the data axis's size ``n``, the policy the explicit step moves (``precision``), the
    dtype XLA widens its collectives to (``widened``), the platform, and notes on them."""

    model: nnx.Module
    optimizer: nnx.Optimizer[Any]
    options: StepOptions
    sizes: dict[str, int]
    n: int
    precision: Any
    widened: str | None
    platform: str
    notes: tuple[str, ...]


def _read(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    options: StepOptions,
    sizes: dict[str, int],
    n: int,
    platform: str | None,
) -> _Step:
    """The step as ``expected_step`` reads it; ``platform`` ``None``: its mesh's devices', else jax's."""
    precision = options.precision if options.mode == "explicit" else None
    if platform is None:
        devices = getattr(options.mesh, "devices", None)
        platform = devices.flat[0].platform if getattr(devices, "size", 0) else jax.default_backend()
    widening = _widening(precision, platform)
    widened = "float32" if widening else None
    notes = (widening,) if widening else ()
    return _Step(model, optimizer, options, sizes, n, precision, widened, platform, notes)


def _widening(precision: Any, platform: str) -> str | None:
    """The note that XLA's CPU compiler moves the policy's narrow dtypes as float32, if it does."""
    if precision is None or platform != "cpu":
        return None
    narrow = [d for d in (precision.param_dtype, precision.reduce_dtype) if np.dtype(d).itemsize < 4]
    if not narrow:
        return None
    return (  # measured (jax 0.12): XLA's CPU compiler moves them as float32
        f"the policy moves {', '.join(sorted({np.dtype(d).name for d in narrow}))}; XLA's CPU "
        f"compiler widens such collectives to float32, so float32 bytes are expected here "
        f"(the lowered program asks for the policy's; an accelerator moves those)"
    )


def _without_data_axis(
    options: StepOptions,
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    layout: str,
    sizes: dict[str, int],
    loss_dtype: Any,
) -> Expected:
    """A data axis of size 1 moves nothing; over another axis (a tensor-parallel ``model``), the
    update still reduces what the layers split there (a global norm, the non-finite flags): the
    update's own census."""
    update = update_items(options, model, optimizer, loss_dtype) if math.prod(sizes.values()) > 1 else None
    return expected_communication(
        [], layout=layout, mode=options.mode, microbatches=options.microbatches, loss_bytes=0, update=update
    )


def _update_or_rule(
    options: StepOptions, model: nnx.Module, optimizer: nnx.Optimizer[Any], loss_dtype: Any
) -> tuple[list[ExpectedCollective] | None, list[str]]:
    """``update_items``, or ``None`` and a note when the update cannot be compiled alone (the
    census goes on with the layout's rule); in implicit mode its non-finite tests optional."""
    try:
        update = update_items(options, model, optimizer, loss_dtype)
    except Exception as error:  # noqa: BLE001  (the census goes on with the layout's rule)
        return None, [
            f"the optimizer update could not be compiled alone ({type(error).__name__}: {error}); "
            f"its communication is taken from the layout's rule"
        ]
    if update and options.mode == "implicit":  # XLA may test the gradients whole, where reduced
        update = [
            dataclasses.replace(
                i, optional=True,
                why="XLA may test the gradients for non-finite values where it holds them whole",
            ) if scopes.FINITE in i.scopes else i
            for i in update
        ]  # fmt: skip
    return update, []


def _parameter_items(
    step: _Step, layered: dict[KeyPath, int] | None, recomputed: bool, pipeline: PipelineRun | None
) -> tuple[list[tuple[str, tuple[int, ...], Any, bool]], list[ExpectedCollective], list[ExpectedCollective]]:
    """The parameter leaves ``expected_communication`` takes (those outside every FSDP unit), the
    units' buffers, and hybrid sharding's sums across replicas (the last two: explicit mode)."""
    options, sizes = step.options, step.sizes
    leaves = parameter_leaves(step.model, step.optimizer, options.data_axis, sizes)
    if step.n == 1:  # replicas of one device each: every gradient whole, reduced across them
        leaves = [(path, shape, dtype, False) for path, shape, dtype, _ in leaves]
    units: list[ExpectedCollective] = []
    across = []
    if options.mode == "explicit" and sizes.get(options.replica_axis, 1) > 1:  # hybrid sharding
        across = cross_replica_items(leaves, options, sizes, step.precision, step.widened, step.platform)
    if options.mode == "explicit" and step.n > 1:  # a unit's parameters move together
        per_tick = options if pipeline is None else options.replace(microbatches=1, schedule=None)
        again = recomputed or (pipeline is not None and pipeline.schedule != "gpipe")
        leaves, units = unit_items(
            step.model, leaves, per_tick, sizes.get(options.data_axis, 1), step.precision, step.widened,
            layered, again, step.platform,
        )  # fmt: skip
        units = units if pipeline is None else stage_unit_items(units, pipeline)
    return leaves, units, across


def _written(
    step: _Step,
    items: Sequence[ExpectedCollective],
    leaves: list[tuple[str, tuple[int, ...], Any, bool]],
    across: list[ExpectedCollective],
    pipelined: bool = False,
) -> list[ExpectedCollective]:
    """``items`` as the explicit step writes them: each split gradient's reduce-scatter for its
    platform, each whole gradient summed over the rows' axes (the replica and data axes at once
    where the mesh has both; with hybrid sharding, unpipelined, the loss and metrics too)."""
    options, sizes = step.options, step.sizes
    if options.mode != "explicit" or step.n == 1:
        return list(items)
    written = tiled_scatters(items, leaves, sizes.get(options.data_axis, 1), step.platform)
    # each whole gradient summed over the rows' axes at once: the replica axis where the mesh has it
    over = tuple(a for a in sizes if a in (options.replica_axis, options.data_axis) and sizes[a] > 1)
    summed = ("gradients", "loss", "metrics") if across and not pipelined else ("gradients",)
    whole = [i.kind == "all-reduce" and i.category in summed and not i.axes for i in written]
    return [dataclasses.replace(i, axes=over) if w else i for i, w in zip(written, whole, strict=True)]


def _step_scopes(
    items: list[ExpectedCollective], model: nnx.Module, options: StepOptions, scoped: bool
) -> list[ExpectedCollective]:
    """Each buffer under the scope the step writes it in (explicit mode: with its BatchNorm averages)."""
    if options.mode != "explicit":
        return _scoped(items, _IMPLICIT_SCOPES)
    items = items + batch_stat_items(model, options.data_axis)
    return _scoped(items, {k: (v,) for k, v in _EXPLICIT_SCOPES.items()}) if scoped else items


def _optional_reductions(
    items: list[ExpectedCollective], metrics: list[ExpectedCollective], mode: str
) -> list[ExpectedCollective]:
    """The loss's and metrics' all-reduces optional where XLA may fold them (measured on jax 0.12 CPU)."""
    gathered = any(i.kind == "all-gather" for i in metrics)
    scalars = [i for i in metrics if i.kind == "all-reduce"]
    why = ""
    if gathered and mode == "implicit":
        why = "XLA may compute it from the per-example values it gathers anyway"
    elif scalars:
        why = (
            "XLA reduces equal values once and may compute one reduction from another "
            "(a metric equal to the loss, or a multiple of it)"
        )
    if not why:
        return items
    return [
        dataclasses.replace(i, optional=True, why=why)
        if i.category in ("loss", "metrics") and i.kind == "all-reduce"
        else i
        for i in items
    ]


def _pipeline_expected(
    pipeline: PipelineRun | None,
    model: nnx.Module,
    options: StepOptions,
    sizes: dict[str, int],
    loss_bytes: int,
) -> tuple[list[ExpectedCollective], tuple[str, ...]]:
    """A pipelined step's own communication over ``stage`` (``census._pipeline``) and a note on its
    schedule; nothing without one."""
    if pipeline is None:
        return [], ()
    rows = tuple(a for a in (options.replica_axis, options.data_axis) if a in sizes)
    items = pipeline_items(pipeline, model, rows, sizes)
    items = [dataclasses.replace(i, bytes=loss_bytes) if i.category == "loss" else i for i in items]
    return items, (pipeline_note(pipeline),)
