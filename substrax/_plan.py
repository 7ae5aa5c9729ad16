"""A plan before compiling: each configuration's communication and memory per device, from a trace.

``plan`` places a copy of the state in each candidate configuration, traces and lowers its
step (compiling only the optimizer update, alone), applies ``TrainStep.check_communication``'s
rule (``expected_step``) and walks the trace for the peak memory (``substrax._memory``, whose
rules are XLA:CPU's). On a mesh of other devices (a TPU's, ``topology_mesh``'s) it compiles
each configuration for them and reads both from the program instead. See the planning guide.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.extend import core as jcore
from jax.sharding import Mesh

from substrax import _layout, _memory
from substrax._layout._units import find_units
from substrax._shared import scopes
from substrax._shared.options import Mode
from substrax._shared.pipeline import STAGE_AXIS, SCHEDULES, bubble_fraction
from substrax._shared.pipeline_record import recording_pipeline
from substrax._train.chooser import make_train_step
from substrax._tree import PyTree
from substrax.census import census
from substrax.census._step import expected_step, program_platform
from substrax.mesh import compile_only, device_memory
from substrax.nn import _declared as declared

__all__ = ["Plan", "PlanRow", "plan"]


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One configuration's predicted communication and state, per device and per step.

    Attributes:
      mode: ``"implicit"`` or ``"explicit"``.
      layout: ``"replicated"``, ``"zero1"``, ``"fsdp"`` or ``"hsdp"``.
      units: The units given to ``shard_state`` (``repr``), ``"-"`` for none.
      mesh: The mesh's shape, ``"data=4,model=2"``.
      bytes: ``(kind, axes) -> bytes`` of the collectives the step must run.
      optional_bytes: Bytes of collectives the compiler may leave out.
      state_bytes: Parameters and optimizer state one device holds (exact).
      batch_bytes: The batch one device holds.
      gathered_bytes: Parameters one device holds gathered at once inside the step.
      output_bytes: The step's outputs beyond those written into its donated state.
      temp_bytes: The step's temporaries at their peak (estimated: see the planning guide).
      padding_bytes: What the compiled program's arguments hold beyond ``state_bytes`` and
        ``batch_bytes`` (a TPU pads small arrays to tiles; random keys); 0 when estimated.
      device_bytes: Each device's memory (``substrax.mesh.device_memory``: a GPU's from its
        description), ``None`` where unknown (a CPU's).
      compiler: Where the bytes come from: ``"XLA:CPU rules (estimated)"``, or the platform
        the step was compiled for, ``"tpu (compiled)"``.
      notes: What the prediction could not read.
      schedule: The pipeline's schedule (``"gpipe"``, ``"1f1b"``) on a mesh with a ``stage``
        axis, ``"-"`` for none.
      bubble: The share of a pipelined step's ticks a stage idles, ``(stages - 1) /
        (microbatches + stages - 1)``; 0 without a pipeline. The peak and state bytes of a
        pipelined row are one stage's (every device holds one stage).
      shard_options: ``shard_state``'s keywords for this configuration (mesh, layout, units...).
      step_options: ``make_train_step``'s keywords (the mesh, the plan's step options).

    ``row.shard_state(model, optimizer)`` and ``row.make_train_step(loss_fn)`` build the row's
    configuration.
    """

    mode: str
    layout: str
    units: str
    mesh: str
    bytes: dict[tuple[str, str], int]
    optional_bytes: int
    state_bytes: int
    batch_bytes: int
    gathered_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    padding_bytes: int = 0
    compiler: str = "XLA:CPU rules (estimated)"
    device_bytes: int | None = None
    notes: tuple[str, ...] = ()
    schedule: str = "-"
    bubble: float = 0.0
    shard_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    step_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def shard_state(self, model: nnx.Module, optimizer: nnx.Optimizer[Any]) -> Any:
        """``shard_state`` with this row's mesh, layout, units and placement."""
        return _layout.shard_state(model, optimizer, **self.shard_options)

    def make_train_step(self, loss_fn: Callable[..., Any], **options: Any) -> Any:
        """``make_train_step`` with this row's mode, mesh and step options (``options`` added)."""
        return make_train_step(loss_fn, self.mode, **{**self.step_options, **options})

    @property
    def peak_bytes(self) -> int:
        """The step's peak per device, state donated (``.bind``, the plain call): ``memory_analysis()``'s
        argument + output + temp - alias; estimated (the explicit step's, by XLA:CPU's rules) or compiled."""
        return self.state_bytes + self.batch_bytes + self.padding_bytes + self.output_bytes + self.temp_bytes

    @property
    def fits(self) -> bool | None:
        """Whether ``peak_bytes`` fits ``device_bytes`` (``None`` where unknown). The GPU compiler
        compiles a step that does not fit; this says so before it runs."""
        return None if self.device_bytes is None else self.peak_bytes <= self.device_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes every required collective moves, per device per step."""
        return sum(self.bytes.values())

    def seconds(self, bandwidth: float) -> float:
        """Communication time at ``bandwidth`` bytes per second (collectives not overlapped)."""
        return self.total_bytes / bandwidth


@dataclasses.dataclass(frozen=True)
class Plan:
    """The rows of ``plan``, one per configuration; ``print`` shows them as a table, each row's
    notes below it."""

    rows: tuple[PlanRow, ...]

    def best(self, memory: int | None = None, *, bandwidth: float | None = None) -> PlanRow:
        """The row with the fewest bytes (or seconds at ``bandwidth``) whose state fits ``memory``.

        ``memory``: bytes per device the step's estimated peak (``PlanRow.peak_bytes``) may
        take; leave room for the estimate's error (see the planning guide). By default each
        row's ``device_bytes`` where known (a GPU's, from its description: the GPU compiler
        compiles what does not fit). Raises ``ValueError`` naming the smallest requirement
        when no row fits.
        """
        limit = lambda r: r.device_bytes if memory is None else memory  # noqa: E731
        fits = [r for r in self.rows if limit(r) is None or r.peak_bytes <= limit(r)]
        if not fits:
            least = min(self.rows, key=lambda r: r.peak_bytes)
            raise ValueError(
                f"No configuration fits {limit(least):,} bytes per device: the smallest, "
                f"{_label(least)}, needs "
                f"{least.peak_bytes:,} (peak_bytes). Add devices (a larger data axis), split more "
                f"(layout='fsdp', units=...), or raise memory=."
            )
        cost = (lambda r: r.seconds(bandwidth)) if bandwidth else (lambda r: r.total_bytes)
        return min(fits, key=cost)

    def __str__(self) -> str:
        kinds = sorted({k for r in self.rows for k in r.bytes})
        piped = any(r.schedule != "-" for r in self.rows)  # the schedule's columns only where one runs
        head = ["mode", "layout", "units", "mesh", *(["schedule", "bubble"] if piped else [])]
        head += [f"{k} ({a})" for k, a in kinds]
        compiled = {r.compiler.endswith("(compiled)") for r in self.rows}
        head += ["total B", "state B", "peak B (compiled)" if compiled == {True} else "peak B (est.)"]
        body = [
            [r.mode, r.layout, r.units, r.mesh, *([r.schedule, f"{r.bubble:.0%}"] if piped else []),
             *(f"{r.bytes.get(k, 0):,}" for k in kinds),
             f"{r.total_bytes:,}", f"{r.state_bytes:,}", f"{r.peak_bytes:,}"]
            for r in self.rows
        ]  # fmt: skip
        widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
        lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *body]]
        notes = [f"{_label(r)}: {note}" for r in self.rows for note in r.notes]
        rule = "-+-".join("-" * w for w in widths)
        return "\n".join([lines[0], rule, *lines[1:], *(["notes:", *notes] if notes else [])])


def _label(row: PlanRow) -> str:
    units = "" if row.units == "-" else f", units={row.units}"
    schedule = "" if row.schedule == "-" else f", {row.schedule}"
    return f"{row.mode} {row.layout}{units}{schedule} on {row.mesh}"


def _mesh_label(mesh: Mesh) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.shape.items())


def plan(
    loss_fn: Callable[[Any, PyTree], Any],
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    batch: PyTree,
    *,
    mesh: Mesh | Sequence[Mesh],
    mode: Mode | Sequence[Mode] = "explicit",
    layouts: Iterable[str] | None = None,
    units: Iterable[Any] = (None,),
    placement: Mapping[str, Any] | None = None,
    compiled: bool | None = None,
    schedule: str | None | Sequence[str | None] = None,
    **step_options: Any,
) -> Plan:
    """Each configuration's collective bytes and memory per device: estimated, or compiled on a TPU.

    Explicit-mode bytes are the compiled census's; implicit-mode rows give the layout's rule
    (XLA chooses) and explicit mode's memory, estimated by XLA:CPU's rules. On a mesh of
    TPU devices (``substrax.mesh.topology_mesh``'s, or a real TPU's) each configuration is
    compiled for them instead: its memory and bytes are the program's, exact, at one compile
    per row. The model and batch may be abstract (``nnx.eval_shape``, ``jax.ShapeDtypeStruct``).
    What is not predicted: see the planning guide.

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
        ``(None, Block)``.
      placement: ``shard_state``'s other keywords for every configuration (``min_size``,
        ``reshard_after_forward``, ``prefetch``, ...).
      compiled: Compile each row's step and read its memory (``memory_analysis()``) and
        bytes (its census) from the program; ``None``: on a mesh whose devices are not CPUs.
      schedule: The pipeline schedules to try on a mesh with a ``stage`` axis (``"gpipe"``,
        ``"1f1b"``, or both; ``None``: both), the stack ``placement``'s ``stages`` names split
        over it; a mesh without ``stage`` runs no pipeline (and drops ``stages``).
      **step_options: ``make_train_step``'s other keywords (``microbatches``, ``has_aux``, ...).

    Returns:
      A ``Plan``; ``print`` it for the table, ``.best(memory=...)`` to choose.

    Raises:
      TypeError: If ``units`` is not an iterable of candidates (a module type given alone).
      ValueError: If ``units`` is empty, or a candidate matches no submodule (naming the
        model's module types).
    """
    units = _candidates(model, units)
    meshes = [mesh] if isinstance(mesh, Mesh) else list(mesh)
    modes = [mode] if isinstance(mode, str) else list(mode)
    rows = []
    memory: dict[Any, dict[str, _memory.Memory]] = {}  # per configuration: explicit mode's, for both modes
    for m in meshes:
        replica = step_options.get("replica_axis", "replica")
        names = layouts or [k for k in _layout.LAYOUTS if k != "hsdp" or replica in m.axis_names]
        for kind in names:
            for u, unit in enumerate(units if kind in ("fsdp", "hsdp") else (None,)):
                for md, sched in ((md, sched) for md in modes for sched in _schedules(m, schedule)):
                    place, opts = _piped(m, sched, placement, step_options)
                    config = (loss_fn, model, optimizer, batch, m, md, kind, unit, place, opts)
                    on_target = _platform(m) != "cpu" if compiled is None else compiled
                    estimate = memory.setdefault((id(m), kind, u, sched), {})
                    rows.append(_row(*config, memory=estimate, compiled=on_target))
    return Plan(tuple(rows))


def _candidates(model: nnx.Module, units: Iterable[Any]) -> list[Any]:
    """The ``units`` candidates, each checked to match a submodule of ``model``."""
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
            find_units(model, unit, reshard_after_forward=True)  # refuses one matching nothing
    return candidates


def _row(
    loss_fn: Any, model: Any, optimizer: Any, batch: Any, mesh: Mesh, mode: str, kind: str, unit: Any,
    placement: Mapping[str, Any] | None, opts: dict[str, Any], *, memory: dict[str, _memory.Memory],
    compiled: bool = False,
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
    expected, notes = expected_step(
        lowered.out_info[1], m, o, step.options, layers=layers, layered=layered, recomputed=_recomputes(body),
        pipeline=piped[0] if piped else None,
    )  # fmt: skip
    if kind != "replicated" and placed.kind == "replicated":
        notes = (_nothing_split(placed), *notes)
    k = step.options.microbatches
    if mode == "explicit":  # the unit gathers the trace runs, counted: required
        expected = dataclasses.replace(expected, items=_traced_gathers(expected.items, body))
    by_kind: dict[tuple[str, str], int] = {}
    optional = 0
    gathers = [_one_run(i) for i in expected.items if i.kind == "all-gather" and i.category == "parameters"]
    gathered = 0
    if kind in ("fsdp", "hsdp"):  # units gather one at a time in explicit mode; XLA gathers all
        gathered = max(gathers, default=0) if unit is not None and mode == "explicit" else sum(gathers)
    for item in expected.items:
        size = item.bytes * (k if item.per_run and item.in_loop else 1)
        if item.optional:
            optional += size
            continue
        key = (item.kind, ",".join(item.axes) or step.options.data_axis)
        by_kind[key] = by_kind.get(key, 0) + size
    rows = math.prod(mesh.shape[a] for a in _axes(step.options.row_axes(mesh)))
    batch_bytes = [_per_device(x, rows) for x in jax.tree.leaves(batch)]
    row = {  # what both estimates share: the configuration, its state and batch, its notes
        "mode": mode,
        "layout": kind,
        "units": "-" if unit is None else getattr(unit, "__name__", repr(unit)),
        "mesh": _mesh_label(mesh),
        "state_bytes": placed.bytes_per_device,
        "batch_bytes": sum(batch_bytes),
        "gathered_bytes": gathered,
        "device_bytes": device_memory(mesh),
        "notes": notes,
        **_pipeline_fields(mesh, opts),
        "shard_options": shard_options,
        "step_options": {"mesh": mesh, **opts},
    }
    if compiled:  # the program itself: its census and memory_analysis(), exact
        program = lowered.compile()
        by_kind = {}
        for found in census(program, mesh=mesh).rows:
            key = (found.kind, ",".join(found.axes or ()) or "unnamed groups")
            by_kind[key] = by_kind.get(key, 0) + found.bytes_per_step
        stats = program.memory_analysis()
        return PlanRow(
            **row,
            bytes=by_kind,
            optional_bytes=0,
            output_bytes=stats.output_size_in_bytes - stats.alias_size_in_bytes,
            temp_bytes=stats.temp_size_in_bytes,
            padding_bytes=stats.argument_size_in_bytes - placed.bytes_per_device - sum(batch_bytes),
            compiler=f"{program_platform(program)} (compiled)",
        )
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


def _one_run(item: Any) -> int:
    """One run's bytes of a gather: its buffer's (a unit's, once per microbatch and layer)."""
    found = re.fullmatch(r"([a-z]+)(\d+)\[([\d,]*)\]", item.buffer)
    if not item.in_loop or found is None:
        return item.bytes
    bits = int(found.group(2))
    return math.prod(int(d) for d in found.group(3).split(",") if d) * bits // 8


def _recomputes(jaxpr: Any) -> bool:
    """Whether the traced step recomputes under remat (``nnx.remat``, ``jax.checkpoint``), as
    ``check_communication`` reads it from the compiled program's op names."""
    return any("rematted_computation" in str(e.source_info.name_stack) for e, _ in _eqns(jaxpr, 1))


def _eqns(jaxpr: Any, runs: int) -> Iterable[tuple[Any, int]]:
    """Each equation of ``jaxpr`` and those inside it, with how often it runs (a scan's trips counted)."""
    for e in jaxpr.eqns:
        yield e, runs
        inner = runs * (e.params["length"] if e.primitive.name == "scan" else 1)
        for sub in jcore.jaxprs_in_params(e.params):
            yield from _eqns(getattr(sub, "jaxpr", sub), inner)


def _traced_gathers(items: Sequence[Any], jaxpr: Any) -> tuple[Any, ...]:
    """``items`` with a unit's optional all-gathers (its backward gather, its forward gathered again
    under remat) required where the trace runs them: per buffer shape, the runs of the unit's
    all-gathers (``substrax.unit``) in the trace, code no result reads dropped (as XLA drops a
    first unit's backward gather), beyond those of the required buffers."""
    try:  # jax's own dead-code elimination, through scans and shard_map
        from jax._src.interpreters.partial_eval import dce_jaxpr

        jaxpr, _ = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    except Exception:  # noqa: BLE001  (another jax: the optional gathers stay optional)
        return tuple(items)
    runs: dict[tuple[int, ...], int] = {}
    for e, n in _eqns(jaxpr, 1):
        if e.primitive.name == "all_gather" and scopes.UNIT in str(e.source_info.name_stack):
            shape = tuple(e.outvars[0].aval.shape)
            runs[shape] = runs.get(shape, 0) + n
    gathers = [i for i in items if i.kind == "all-gather" and i.scopes == (scopes.UNIT,) and _shape(i.buffer)]
    for i in gathers:
        if not i.optional:
            runs[_shape(i.buffer)] = runs.get(_shape(i.buffer), 0) - i.bytes // max(1, _one_run(i))
    required = set()
    order = sorted((i for i in gathers if i.optional), key=lambda i: i.what.endswith("recomputed"))
    for i in order:  # the backward gathers first, then the recomputed forward ones
        own = i.bytes // max(1, _one_run(i))
        if runs.get(_shape(i.buffer), 0) >= own:
            runs[_shape(i.buffer)] -= own
            required.add(id(i))
    return tuple(dataclasses.replace(i, optional=False, why="") if id(i) in required else i for i in items)


def _shape(buffer: str) -> tuple[int, ...] | None:
    found = re.fullmatch(r"[a-z]+\d+\[([\d,]*)\]", buffer)
    return None if found is None else tuple(int(d) for d in found.group(1).split(",") if d)


def _schedules(mesh: Mesh, schedule: str | None | Sequence[str | None]) -> list[str | None]:
    """The schedules to try on ``mesh``: on a ``stage`` axis the candidates (both when none are
    named), without one none (``[None]``: no pipeline)."""
    if STAGE_AXIS not in mesh.axis_names:
        return [None]
    candidates = [schedule] if schedule is None or isinstance(schedule, str) else list(schedule)
    named = [c for c in candidates if c is not None]
    return named or list(SCHEDULES)


def _piped(
    mesh: Mesh, schedule: str | None, placement: Mapping[str, Any] | None, opts: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``shard_state``'s and ``make_train_step``'s keywords with the pipeline's: ``schedule`` on a
    ``stage`` mesh; the placement's ``stages`` only there."""
    place = dict(placement or {})
    if STAGE_AXIS not in mesh.axis_names:
        place.pop("stages", None)
    return place, {**opts, **({"schedule": schedule} if schedule is not None else {})}


def _pipeline_fields(mesh: Mesh, opts: Mapping[str, Any]) -> dict[str, Any]:
    """A row's ``schedule`` and ``bubble``."""
    schedule = opts.get("schedule")
    if schedule is None:
        return {}
    return {"schedule": schedule, "bubble": bubble_fraction(mesh.shape[STAGE_AXIS], opts.get("microbatches", 1))}
