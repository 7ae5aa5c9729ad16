"""A training step's census held against the communication its layout calls for.

The expectation comes from the state's placement, the step's outputs, the optimizer
update compiled alone (``update_items``), explicit mode's BatchNorm averages and the
layers' declarations; see the census guide. ``TrainStep.check_communication`` calls it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax._base.declared import Declared
from substrax._layout import gradient_spec, layout_of, prefetched_units
from substrax._base import scopes
from substrax._shared.options import StepOptions
from substrax._shared.pipeline_record import PipelineRun
from substrax._shared.update import apply_update, donated_state, state_values
from substrax._base.trees import KeyPath
from substrax.census._expected import Expected, ExpectedCollective, expected_communication
from substrax.census._items import (
    _metric_items,
    batch_stat_items,
    cross_replica_items,
    layer_items,
    parameter_leaves,
    tiled_scatters,
    unit_items,
    update_dims,
)
from substrax.census._pipeline import pipeline_items, pipeline_note, stage_unit_items
from substrax.census._report import CensusReport, Comparison, census, compare
from substrax.census._rows import library_scope
from substrax.census._text import short_op
from substrax.mesh import current_mesh_with

__all__ = [
    "check_communication",
    "expected_step",
    "layer_items",
    "parameter_leaves",
    "program_platform",
    "update_dims",
    "update_items",
]


# The scope each expected buffer of the explicit step is compiled under (substrax.explicit._step, substrax.explicit._shard).
_EXPLICIT_SCOPES = {
    "gradients": scopes.GRAD_REDUCE,
    "parameters": scopes.GATHER_PARAMS,
    "loss": scopes.LOSS,
    "metrics": scopes.METRICS,
    "batch stats": scopes.BATCH_STATS,
}


def _mesh_context(options: StepOptions) -> contextlib.AbstractContextManager[Any]:
    """``jax.set_mesh(options.mesh)``, or nothing when the step has no mesh of its own (as the step runs)."""
    return jax.set_mesh(options.mesh) if options.mesh is not None else contextlib.nullcontext()


def _mesh_of(
    options: StepOptions, model: nnx.Module, optimizer: nnx.Optimizer[Any]
) -> jax.sharding.Mesh | None:
    """The concrete mesh the step runs on: its own, the state's, or the one set by ``jax.set_mesh``."""
    if isinstance(options.mesh, jax.sharding.Mesh):
        return options.mesh
    for _, variable in nnx.to_flat_state(nnx.state((model, optimizer))):
        sharding = getattr(variable.get_value(), "sharding", None)
        mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        if isinstance(mesh, jax.sharding.Mesh) and options.data_axis in mesh.axis_names:
            return mesh
    found = current_mesh_with(options.data_axis)
    return found if isinstance(found, jax.sharding.Mesh) else None


def _axis_sizes(options: StepOptions, model: nnx.Module, optimizer: nnx.Optimizer[Any]) -> dict[str, int]:
    mesh = _mesh_of(options, model, optimizer)
    return {} if mesh is None else dict(mesh.shape)


def update_census(
    options: StepOptions, model: nnx.Module, optimizer: nnx.Optimizer[Any], loss_dtype: Any
) -> CensusReport | None:
    """The census of the step's optimizer update, lowered and compiled alone.

    Its arguments are placed as the step hands them over: the model's and the
    optimizer's state as placed, the gradients split over the data axis where the
    optimizer updates slices (``update_dims``) and replicated elsewhere, the loss a
    replicated scalar. ``None`` when no mesh is known.
    """
    mesh = _mesh_of(options, model, optimizer)
    if mesh is None:
        return None
    axis = options.data_axis
    dims = update_dims(model, optimizer, axis)
    graphdef, state = nnx.split((model, optimizer))
    treedef = jax.tree.structure(state)
    arrays = jax.tree.leaves(state)

    def placed(path: KeyPath, variable: nnx.Variable[Any]) -> nnx.Variable[Any]:
        value = variable.get_value()
        spec = gradient_spec(variable, dims[path], axis)
        return variable.replace(
            jax.ShapeDtypeStruct(np.shape(value), value.dtype, sharding=NamedSharding(mesh, spec))
        )

    grads = nnx.from_flat_state(
        [(p, placed(tuple(p), v)) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    )
    loss = jax.ShapeDtypeStruct((), loss_dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    def update(arrays: list[jax.Array], grads: nnx.State, loss: jax.Array) -> list[jax.Array]:
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
        before = state_values((model, optimizer)) if options.skip_nonfinite else None
        with donated_state(True):  # the update the step runs after its gradients, as it runs: donated
            apply_update(model, optimizer, grads, loss, before)
        return jax.tree.leaves(nnx.state((model, optimizer)))

    with _mesh_context(options):
        compiled = jax.jit(update, donate_argnums=0).lower(arrays, grads, loss).compile()
    return census(compiled, mesh=mesh)


def update_items(
    options: StepOptions, model: nnx.Module, optimizer: nnx.Optimizer[Any], loss_dtype: Any
) -> list[ExpectedCollective]:
    """What the update communicates, one expected buffer per buffer of ``update_census``.

    Each keeps the library scope it was compiled under (``substrax.update``,
    ``substrax.finite``), and must be compiled under the same one in the step; one the
    update runs in a loop of its own (muon's Newton-Schulz iterations in optax 0.2.5) is
    expected in a loop, with its bytes per step.
    """
    report = update_census(options, model, optimizer, loss_dtype)
    if report is None:
        return []
    return [
        ExpectedCollective(
            part.kind,
            f"update: {_operation(part.op_name)}",
            part.bytes_per_step,
            "update",
            scopes=(part.scope,),
            buffer=str(part.buffer),
            in_loop=part.row.in_loop,
        )
        for part in (p for row in report.rows for p in row.parts)
    ]


def _operation(op_name: str) -> str:
    """An operation's name from its library scope on (``substrax.update/...``), else its last steps."""
    at = op_name.find(scopes.PREFIX)
    return op_name[at:] if at >= 0 else short_op(op_name)


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


def program_platform(compiled: jax.stages.Compiled) -> str:
    """The platform ``compiled`` was compiled for (its devices': ``"tpu"`` for a topology mesh's),
    not the host's; jax's default backend for a program with neither arguments nor results."""
    for sharding in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings)):
        devices = getattr(sharding, "device_set", None)
        if devices:
            return str(next(iter(devices)).platform)
    return jax.default_backend()


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
    with _mesh_context(options):
        layout = layout_of(model, optimizer, mesh=options.mesh, axis=options.data_axis)
    # a prefetched stack recomputes each layer's forward pass for its gradient (explicit._prefetch)
    recomputed = recomputed or bool(prefetched_units(model) & set(layered or {}))
    loss_dtype = out[0].dtype if options.has_aux else out.dtype
    sizes = _axis_sizes(options, model, optimizer)
    replicas = sizes.get(options.replica_axis, 1) if options.mode == "explicit" else 1
    piped, piped_notes = _pipeline_expected(pipeline, model, options, sizes, np.dtype(loss_dtype).itemsize)
    if layout.axis_size == 1 and replicas == 1:  # a data axis of size 1: nothing moves over it
        # over another axis (a tensor-parallel ``model``), the update still reduces what the
        # layers split there (a global norm, the non-finite flags): the update's own census
        update = (
            update_items(options, model, optimizer, loss_dtype) if math.prod(sizes.values()) > 1 else None
        )
        expected = expected_communication(
            [], layout=layout.kind, mode=options.mode, microbatches=options.microbatches, loss_bytes=0,
            update=update,
        )  # fmt: skip
        # what the model issues itself (BatchNorm's psum over a size-1 axis_name) is attributed
        return expected.with_items(layer_items(layers, options.microbatches, sizes, recomputed) + piped), piped_notes
    metrics = _metric_items(out, options.has_aux)
    notes = list(piped_notes)
    try:
        update: list[ExpectedCollective] | None = update_items(options, model, optimizer, loss_dtype)
    except Exception as error:  # noqa: BLE001  (the census goes on with the layout's rule)
        update = None
        notes.append(
            f"the optimizer update could not be compiled alone ({type(error).__name__}: {error}); "
            f"its communication is taken from the layout's rule"
        )
    if update and options.mode == "implicit":  # XLA may test the gradients whole, where reduced
        update = [
            dataclasses.replace(
                i, optional=True,
                why="XLA may test the gradients for non-finite values where it holds them whole",
            ) if scopes.FINITE in i.scopes else i
            for i in update
        ]  # fmt: skip
    precision = options.precision if options.mode == "explicit" else None
    widened = None
    if platform is None:
        devices = getattr(options.mesh, "devices", None)
        platform = devices.flat[0].platform if getattr(devices, "size", 0) else jax.default_backend()
    if precision is not None and platform == "cpu":
        narrow = [d for d in (precision.param_dtype, precision.reduce_dtype) if np.dtype(d).itemsize < 4]
        if narrow:  # measured (jax 0.12): XLA's CPU compiler moves them as float32
            widened = "float32"
            notes.append(
                f"the policy moves {', '.join(sorted({np.dtype(d).name for d in narrow}))}; XLA's CPU "
                f"compiler widens such collectives to float32, so float32 bytes are expected here "
                f"(the lowered program asks for the policy's; an accelerator moves those)"
            )
    leaves = parameter_leaves(model, optimizer, options.data_axis, sizes)
    if layout.axis_size == 1:  # replicas of one device each: every gradient whole, reduced across them
        leaves = [(path, shape, dtype, False) for path, shape, dtype, _ in leaves]
    units: list[ExpectedCollective] = []
    across = []
    if options.mode == "explicit" and sizes.get(options.replica_axis, 1) > 1:  # hybrid sharding
        across = cross_replica_items(leaves, options, sizes, precision, widened)
    if options.mode == "explicit" and layout.axis_size > 1:  # a unit's parameters move together
        per_tick = options if pipeline is None else options.replace(microbatches=1, schedule=None)
        again = recomputed or (pipeline is not None and pipeline.schedule == "1f1b")
        leaves, units = unit_items(
            model, leaves, per_tick, sizes[options.data_axis], precision, widened, layered, again, platform
        )
        units = units if pipeline is None else stage_unit_items(units, pipeline)
    expected = expected_communication(
        leaves,
        layout=layout.kind,
        mode=options.mode,
        microbatches=options.microbatches,
        loss_bytes=np.dtype(loss_dtype).itemsize,
        update=update,
        precision=precision,
        communicated_dtype=widened,
    )
    written = expected.items  # the explicit step writes each split gradient's reduce-scatter for its platform
    if options.mode == "explicit" and layout.axis_size > 1:
        written = tiled_scatters(written, leaves, sizes[options.data_axis], platform)
        if across:  # each whole gradient summed over the replica and data axes at once (not a slice's sum)
            over = tuple(a for a in sizes if a in (options.replica_axis, options.data_axis))
            whole = [i.kind == "all-reduce" and i.category == "gradients" for i in written]
            written = [dataclasses.replace(i, axes=over) if w else i for i, w in zip(written, whole, strict=True)]
    items = [*written, *units, *across, *metrics]
    items += layer_items(layers, options.microbatches, sizes, recomputed)
    items += piped
    gathered = any(i.kind == "all-gather" for i in metrics)
    if options.mode == "explicit":
        items += batch_stat_items(model, options.data_axis)
        if scoped:  # each buffer under the scope the step writes it in
            items = _scoped(items, {k: (v,) for k, v in _EXPLICIT_SCOPES.items()})
    else:
        items = _scoped(
            items,
            {
                "gradients": (None,),
                "parameters": (None,),
                "loss": (None, scopes.LOSS),
                "metrics": (None, scopes.METRICS),
            },
        )
    scalars = [i for i in metrics if i.kind == "all-reduce"]
    why = ""
    if gathered and options.mode == "implicit":
        why = "XLA may compute it from the per-example values it gathers anyway"
    elif scalars:
        why = (
            "XLA reduces equal values once and may compute one reduction from another "
            "(a metric equal to the loss, or a multiple of it)"
        )
    if why:  # measured on jax 0.12 CPU: both happen
        items = [
            dataclasses.replace(i, optional=True, why=why)
            if i.category in ("loss", "metrics") and i.kind == "all-reduce"
            else i
            for i in items
        ]
    if not scoped:  # a step that names no scope (or compiled none of its collectives): anywhere
        items = [dataclasses.replace(i, scopes=()) for i in items]
    return dataclasses.replace(expected, items=tuple(items)), tuple(notes)


def _pipeline_expected(
    pipeline: PipelineRun | None, model: nnx.Module, options: StepOptions, sizes: dict[str, int], loss_bytes: int
) -> tuple[list[ExpectedCollective], tuple[str, ...]]:
    """A pipelined step's own communication over ``stage`` (``census._pipeline``) and a note on its
    schedule; nothing without one."""
    if pipeline is None:
        return [], ()
    rows = tuple(a for a in (options.replica_axis, options.data_axis) if a in sizes)
    items = pipeline_items(pipeline, model, rows, sizes)
    items = [dataclasses.replace(i, bytes=loss_bytes) if i.category == "loss" else i for i in items]
    return items, (pipeline_note(pipeline),)
