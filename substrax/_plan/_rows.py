"""``plan``: each configuration placed, its step traced and lowered, its communication and memory
per device predicted (or, on a mesh of other devices, compiled and read from the program)."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from substrax import _layout
from substrax._base import declared
from substrax._base.trees import PyTree
from substrax._plan import _items, _memory, _pipeline, _seconds, _units
from substrax._plan._table import Plan, PlanRow
from substrax._shared.options import Mode
from substrax._shared.pipeline_record import recording_pipeline
from substrax._train.chooser import make_train_step
from substrax.census import census, expected_step, program_platform
from substrax.mesh import compile_only, device_memory
from substrax.timeline import Target

__all__ = ["plan"]


def _mesh_label(mesh: Mesh) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.shape.items())


def _unnamed(step: Any, mesh: Mesh) -> str:
    """The axes of a collective the rule names none for: the data axis, every axis of a mesh without it."""
    axis = step.options.data_axis
    return axis if axis in mesh.axis_names else ",".join(mesh.axis_names)


def plan(
    loss_fn: Callable[[Any, PyTree], Any],
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    batch: PyTree,
    *,
    mesh: Mesh | Sequence[Mesh],
    mode: Mode | Sequence[Mode] = "explicit",
    layouts: Iterable[str] | None = None,
    units: Iterable[Any] | None = None,
    placement: Mapping[str, Any] | None = None,
    compiled: bool | None = None,
    schedule: str | None | Sequence[str | None] = None,
    target: Target | str | None = None,
    **step_options: Any,
) -> Plan:
    """Each configuration's collective bytes and memory per device: estimated, or compiled on a TPU.

    Explicit-mode bytes are the compiled census's; implicit-mode rows give the layout's rule
    (XLA chooses) and explicit mode's memory. The memory is estimated from the trace by a
    model of one compiler, XLA:CPU (its fusions, kernels, scheduler and buffer assigner;
    ``PlanRow.compiler`` says ``"XLA:CPU rules (estimated)"``). On a mesh of TPU or GPU
    devices (``substrax.mesh.topology_mesh``'s, or real ones) each configuration is compiled
    for them instead: its memory and bytes are the program's, exact, at one compile per row
    (kept: the row's step, built again, compiles it no more for ``lower(...).compile()`` or
    ``check_communication``), and its step is predicted from it. The model and batch may be
    abstract (``nnx.eval_shape``, ``jax.ShapeDtypeStruct``). See the planning guide.

    Args:
      loss_fn: As ``make_train_step`` takes it.
      model: The model; left as it is (each configuration places a copy).
      optimizer: Its optimizer; left as it is.
      batch: One global batch, as the step would get it.
      mesh: A mesh, or several (each a candidate).
      mode: ``"implicit"``, ``"explicit"``, or both.
      layouts: The layouts to try; default every one the mesh allows (``"hsdp"`` with a
        ``replica`` axis).
      units: ``shard_state``'s ``units`` to try under FSDP and HSDP (``None``: none), e.g.
        ``(None, Block)``; default none and, on a model with a stack of blocks, its block's type.
      placement: ``shard_state``'s other keywords for every configuration (``min_size``,
        ``reshard_after_forward``, ``prefetch``, ...).
      compiled: Compile each row's step and read its memory (``memory_analysis()``) and
        bytes (its census) from the program; ``None``: on a mesh whose devices are not CPUs.
      schedule: The pipeline schedules to try on a mesh with a ``stage`` axis (one of
        ``SCHEDULES`` or several; ``None``: each the mode runs), the stack ``placement``'s
        ``stages`` names split over it; a mesh without ``stage`` runs no pipeline (and drops
        ``stages``).
      target: What a compiled row's step is predicted on (``substrax.timeline``'s ``Target`` or a
        ``TARGETS`` name); default the devices'.
      **step_options: ``make_train_step``'s other keywords (``microbatches``, ``has_aux``, ...).

    Returns:
      A ``Plan``; ``print`` it for the table, ``.best()`` to choose (by ``step_seconds``, where
      compiled for a TPU or a GPU: the planning guide, "Seconds").

    Raises:
      TypeError: If ``units`` is not an iterable of candidates (a module type given alone).
      ValueError: If ``units`` is empty, or a candidate matches no submodule (naming the
        model's module types).
    """
    units = _candidates(model, units)
    meshes = [mesh] if isinstance(mesh, Mesh) else list(mesh)
    modes = [mode] if isinstance(mode, str) else list(mode)
    rows = []
    timing: dict[int, _seconds.Timing] = {}  # per mesh: the model's FLOPs (a row's MFU), the target
    memory: dict[Any, dict[str, _memory.Memory]] = {}  # per configuration: explicit mode's, for both modes
    for m in meshes:
        replica = step_options.get("replica_axis", "replica")
        names = layouts or [k for k in _layout.LAYOUTS if k != "hsdp" or replica in m.axis_names]
        for kind in names:
            for u, unit in enumerate(units if kind in ("fsdp", "hsdp") else (None,)):
                for md, sched in _pipeline.runs(m, schedule, modes, placement):
                    place, opts = _pipeline.piped(m, sched, placement, step_options)
                    config = (loss_fn, model, optimizer, batch, m, md, kind, unit, place, opts)
                    on_target = _platform(m) != "cpu" if compiled is None else compiled
                    estimate = memory.setdefault((id(m), kind, u, sched), {})
                    if on_target and id(m) not in timing:  # a compiled row's: counted once per mesh
                        timing[id(m)] = _seconds.Timing(_seconds.model_flops(*config[:2], batch, m), target)
                    rows.append(_row(*config, memory=estimate, compiled=on_target, timing=timing.get(id(m))))
    return Plan(tuple(rows))


def _candidates(model: nnx.Module, units: Iterable[Any] | None) -> list[Any]:
    """The ``units`` candidates, each checked to match a submodule of ``model`` (``None``: none, and
    the model's block where it has a stack of them)."""
    if units is None:
        block = _units.block_of(model)
        return [None] if block is None else [None, block]
    if isinstance(units, type) or callable(units) or not isinstance(units, Iterable):
        name = getattr(units, "__qualname__", repr(units))
        raise TypeError(
            f"units= takes the candidates to try, each as shard_state takes units: units=(None, {name}) "
            f"or units=({name},); got units={name}."
        )
    candidates = list(units)
    if not candidates:
        raise ValueError(
            "units=() tries no placement under FSDP and HSDP: pass units=(None,) (the default) for "
            "none, or units=(None, Block) to try units as well."
        )
    for unit in candidates:
        if unit is not None:
            _layout.find_units(model, unit, reshard_after_forward=True)  # refuses one matching nothing
    return candidates


def _row(
    loss_fn: Any,
    model: Any,
    optimizer: Any,
    batch: Any,
    mesh: Mesh,
    mode: str,
    kind: str,
    unit: Any,
    placement: Mapping[str, Any] | None,
    opts: dict[str, Any],
    *,
    memory: dict[str, _memory.Memory],
    compiled: bool = False,
    timing: _seconds.Timing | None = None,
) -> PlanRow:
    """One configuration's row; ``memory`` holds its explicit step's estimate once made."""
    graphdef, state = nnx.split((model, optimizer))
    if compile_only(mesh):  # devices that hold no array: the state's and batch's shapes alone
        state, batch = jax.tree.map(_shape_of, (state, batch))
    m, o = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new variables over the same arrays
    place = {"replica_axis": opts["replica_axis"]} if "replica_axis" in opts else {}
    place |= dict(placement or {})
    axis = opts.get("data_axis", "data")
    shard_options = {"mesh": mesh, "layout": kind, "units": unit, "data_axis": axis, **place}
    placed = _layout.shard_state(m, o, **shard_options)
    step = make_train_step(loss_fn, mode, mesh=mesh, **opts)
    with declared.recording() as layers, _layout.recording_layers() as layered, recording_pipeline() as piped:
        traced = step.traced(m, o, batch, donate=True)
        with step.mesh_context():
            lowered = traced.lower()
    body = traced.jaxpr.jaxpr
    recomputed = _items.recomputes(body)
    expected, notes = expected_step(
        lowered.out_info[1], m, o, step.options, layers=layers, layered=layered, recomputed=recomputed,
        pipeline=piped[0] if piped else None,
    )  # fmt: skip
    if kind != "replicated" and placed.kind == "replicated":
        notes = (_nothing_split(placed), *notes)
    if mode == "explicit":  # the unit gathers the trace runs, counted: required
        expected = dataclasses.replace(expected, items=_items.traced_gathers(expected.items, body))
    rows = math.prod(mesh.shape[a] for a in _axes(step.options.row_axes(mesh)))
    batch_bytes = [_per_device(x, rows) for x in jax.tree.leaves(batch)]
    row = {  # what both estimates share: the configuration, its state and batch, its notes
        "mode": mode,
        "layout": kind,
        "units": "-" if unit is None else getattr(unit, "__name__", repr(unit)),
        "mesh": _mesh_label(mesh),
        "state_bytes": placed.bytes_per_device,
        "batch_bytes": sum(batch_bytes),
        # units gather one at a time in explicit mode; XLA gathers all
        "gathered_bytes": _items.gathered(expected.items, kind, unit is not None and mode == "explicit"),
        "device_bytes": device_memory(mesh),
        "notes": notes,
        **_pipeline.fields(mesh, opts, placement),
        "shard_options": shard_options,
        "step_options": {"mesh": mesh, **opts},
    }
    by_kind, optional = _items.required(expected.items, step.options.microbatches, _unnamed(step, mesh))
    if compiled:  # the program itself: its census and memory_analysis(), exact
        return _on_target(row, lowered, mesh, by_kind, optional, timing)
    if "explicit" not in memory:  # the memory is explicit mode's (XLA places the implicit step's)
        if mode != "explicit":
            traced = make_train_step(loss_fn, "explicit", mesh=mesh, **opts).traced(m, o, batch, donate=True)
        state_bytes = [_per_device(x, 1) for x in jax.tree.leaves(nnx.state((m, o)))]
        memory["explicit"] = _memory.estimate(traced.jaxpr, state_bytes + batch_bytes, donated=True)
    return PlanRow(
        **row,
        bytes=by_kind,
        optional_bytes=optional,
        output_bytes=memory["explicit"].outputs,
        temp_bytes=memory["explicit"].temporaries,
    )


_RULES_BYTES = "no program to take a census of: its bytes are the layout's rule's (the estimate's)"


def _on_target(
    row: dict[str, Any],
    lowered: Any,
    mesh: Mesh,
    by_kind: dict[tuple[str, str], int],
    optional: int,
    timing: _seconds.Timing | None = None,
) -> PlanRow:
    """The row of the compiled program; where the TPU compiler refuses it for memory, its refusal
    with the rule's bytes ``by_kind`` and ``optional`` (no program, no census)."""
    try:
        return _compiled(row, lowered.compile(), mesh, timing)
    except jax.errors.JaxRuntimeError as e:
        if (need := _hbm_refusal(str(e))) is None:
            raise
        return PlanRow(
            **{**row, "notes": (*row["notes"], _RULES_BYTES)},
            bytes=by_kind,
            optional_bytes=optional,
            temp_bytes=need,
            compiler=f"{_platform(mesh)} (compiled)",
            refused=str(e).splitlines()[0][:400],
        )


def _compiled(
    row: dict[str, Any], program: Any, mesh: Mesh, timing: _seconds.Timing | None = None
) -> PlanRow:
    """``row`` with the bytes of ``program``'s census and its ``memory_analysis()``, and on a TPU or a
    GPU its predicted step (``timing``: the model's FLOPs, for its MFU, and the target)."""
    by_kind: dict[tuple[str, str], int] = {}
    report = census(program, mesh=mesh)
    for found in report.rows:
        key = (found.kind, ",".join(found.axes or ()) or "unnamed groups")
        by_kind[key] = by_kind.get(key, 0) + found.bytes_per_step
    stats = program.memory_analysis()
    if uncounted := report.uncounted():  # never counted once in silence
        note = (
            f"{len(uncounted)} collective(s) of the compiled step sit inside loops whose trip count the "
            f"program does not show ({', '.join(r.name for r in uncounted[:4])}): each counted once, "
            f"total_bytes is a lower bound"
        )
        warnings.warn(f"plan: {row['mode']} {row['layout']} on {row['mesh']}: {note}", stacklevel=4)
        row = {**row, "notes": (*row["notes"], note)}
    return PlanRow(
        **row,
        bytes=by_kind,
        optional_bytes=0,
        output_bytes=stats.output_size_in_bytes - stats.alias_size_in_bytes,
        temp_bytes=stats.temp_size_in_bytes,
        padding_bytes=stats.argument_size_in_bytes - row["state_bytes"] - row["batch_bytes"],
        compiler=f"{program_platform(program)} (compiled)",
        **_seconds.timed(program, mesh, timing or _seconds.Timing()),
    )


def _hbm_refusal(message: str) -> int | None:
    """The temporaries' bytes in the TPU compiler's "Ran out of memory on HBM" refusal, else ``None``."""
    found = re.search(r"Ran out of memory on HBM.*?HLO temporaries \(([\d.]+)G\)", message, re.S)
    return None if found is None else int(float(found.group(1)) * 2**30)


def _platform(mesh: Mesh) -> str:
    return str(mesh.devices.flat[0].platform)


def _shape_of(x: Any) -> Any:
    """An array's shape and dtype (``jax.ShapeDtypeStruct``), its sharding dropped; anything else as it is."""
    if isinstance(x, (jax.Array, np.ndarray)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def _nothing_split(placed: _layout.Layout) -> str:
    """The note of a layout that splits no parameter: the row is the replicated one."""
    small = [math.prod(w.shape) for w in placed.left_whole if w.reason == "small" and w.shape]
    hint = (
        f"; placement={{'min_size': {max(small):,}}} splits the largest of those below min_size"
        if small
        else ""
    )
    return (
        f"nothing split: layout={placed.asked!r} leaves every parameter whole, the state and its "
        f"communication the replicated layout's ({placed.whole_summary()}){hint}"
    )


def _axes(rows: str | tuple[str, ...]) -> tuple[str, ...]:
    return (rows,) if isinstance(rows, str) else rows


def _per_device(x: Any, rows: int) -> int:
    """Bytes one device holds of ``x``: its shard's, or (not placed yet) its rows split ``rows`` ways.

    An abstract ``x`` (``jax.ShapeDtypeStruct``) counts its shape's bytes, by its sharding's
    ``shard_shape`` where it has one.
    """
    if isinstance(x, jax.Array):
        return x.addressable_shards[0].data.nbytes
    if isinstance(x, jax.ShapeDtypeStruct):
        itemsize = np.dtype(x.dtype).itemsize
        if x.sharding is not None:
            return math.prod(x.sharding.shard_shape(x.shape)) * itemsize
        return math.prod(x.shape) * itemsize // (rows if x.ndim else 1)
    return np.asarray(x).nbytes // (rows if np.ndim(x) else 1)
