"""The plan's rows and table: each configuration's predicted communication and memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from substrax import _layout
from substrax._train.chooser import make_train_step
from substrax.timeline import Timeline

__all__ = ["Plan", "PlanRow"]


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
      schedule: The pipeline's schedule (one of ``SCHEDULES``) on a mesh with a ``stage``
        axis, ``"-"`` for none.
      bubble: The share of a pipelined step's time a stage idles, ``bubble_fraction`` of the
        schedule; 0 without a pipeline. The peak and state bytes of a
        pipelined row are one stage's (every device holds one stage).
      refused: The TPU compiler's refusal of a step that does not fit (its message; ``peak_bytes``
        then holds the arguments plus the temporaries it says it needed, to its 0.01 GB, and
        ``bytes`` the layout's rule's, as estimated), else ``""``.
      flops: FLOPs per device per step, the compiled program's (loops their trip count times);
        ``None`` where estimated on the CPU (as every field below but ``timeline``).
      compute_seconds: The program's operations, each at its bound on the target (matrix units or
        memory), summed in the compiled order.
      communication_seconds: Every collective of the census at the bandwidth of the links its axes
        span, by its kind's algorithm and group size, none overlapped.
      exposed_seconds: What the compiled schedule leaves unhidden of them.
      step_seconds: ``compute_seconds + exposed_seconds``: the predicted step.
      mfu: The model's FLOPs (three times its forward pass's matrix products) over the devices'
        bfloat16 peak and ``step_seconds``.
      timeline: The predicted step (``substrax.timeline.Timeline``): its events, its Chrome trace.
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
    refused: str = ""
    schedule: str = "-"
    bubble: float = 0.0
    flops: float | None = None
    compute_seconds: float | None = None
    communication_seconds: float | None = None
    exposed_seconds: float | None = None
    step_seconds: float | None = None
    mfu: float | None = None
    timeline: Timeline | None = dataclasses.field(default=None, repr=False, compare=False)
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
        """Whether the step fits a device: on a TPU, whether its compiler took it (it refuses a step
        that does not fit, by its own count); else whether ``peak_bytes`` fits ``device_bytes``
        (``None`` where unknown). The GPU compiler compiles a step that does not fit; this says so."""
        if self.compiler.startswith("tpu"):
            return not self.refused
        return None if self.device_bytes is None else self.peak_bytes <= self.device_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes every required collective moves, per device per step."""
        return sum(self.bytes.values())

    def seconds(self, bandwidth: float) -> float:
        """Communication time at ``bandwidth`` bytes per second (collectives not overlapped); a row
        compiled for a TPU or a GPU predicts its whole step instead (``step_seconds``)."""
        return self.total_bytes / bandwidth

    def __str__(self) -> str:
        """The row in one line: what it is, whether it fits, its step, its MFU, what is exposed."""
        return _summary(self)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The rows of ``plan``, one per configuration; ``print`` shows them as a table, each row's
    notes below it; ``summary()`` is the chosen row in one line."""

    rows: tuple[PlanRow, ...]

    def best(self, memory: int | None = None, *, bandwidth: float | None = None) -> PlanRow:
        """The fastest row that fits: the least ``step_seconds`` (where every row that fits has them:
        compiled for a TPU or a GPU), else the fewest bytes (or, at ``bandwidth`` bytes per second,
        the least communication time); a tie goes to the smaller peak.

        ``memory``: bytes per device the step's peak (``PlanRow.peak_bytes``) may take; for an
        estimate leave room for its error (see the planning guide). By default each row's
        ``device_bytes`` where known, and on a TPU whether its compiler took it. Raises
        ``ValueError`` naming the smallest requirement when no row fits.
        """
        limit = lambda r: r.device_bytes if memory is None else memory  # noqa: E731
        fits = [
            r
            for r in self.rows
            if not r.refused and (limit(r) is None or r.peak_bytes <= limit(r) or (memory is None and r.fits))
        ]
        if not fits:
            least = min(self.rows, key=lambda r: r.peak_bytes)
            raise ValueError(
                f"No configuration fits {limit(least):,} bytes per device: the smallest, "
                f"{_label(least)}, needs "
                f"{least.peak_bytes:,} (peak_bytes). Add devices (a larger data axis), split more "
                f"(layout='fsdp', units=...), or raise memory=."
            )
        if bandwidth:
            return min(fits, key=lambda r: (r.seconds(bandwidth), r.peak_bytes))
        if all(r.step_seconds is not None for r in fits):
            return min(fits, key=lambda r: (r.step_seconds, r.peak_bytes))
        return min(fits, key=lambda r: (r.total_bytes, r.peak_bytes))

    def summary(self, memory: int | None = None) -> str:
        """``best(memory)`` in one line (``str`` of the row)."""
        return str(self.best(memory))

    def __str__(self) -> str:
        return _table(self.rows)


def _table(rows: tuple[PlanRow, ...]) -> str:
    kinds = sorted({k for r in rows for k in r.bytes})
    piped = any(r.schedule != "-" for r in rows)  # the schedule's columns only where one runs
    timed = any(r.step_seconds is not None for r in rows)  # the seconds' where a row has them
    head = ["mode", "layout", "units", "mesh", *(["schedule", "bubble"] if piped else [])]
    head += [f"{k} ({a})" for k, a in kinds]
    compiled = {r.compiler.endswith("(compiled)") for r in rows}
    head += [
        "total B",
        "state GiB",
        "peak GiB (compiled)" if compiled == {True} else "peak GiB (est.)",
        "fits",
    ]
    head += ["step ms", "MFU", "exposed ms"] if timed else []
    body = [
        [r.mode, r.layout, r.units, r.mesh, *([r.schedule, f"{r.bubble:.0%}"] if piped else []),
         *(f"{r.bytes.get(k, 0):,}" for k in kinds),
         f"{r.total_bytes:,}", _gib(r.state_bytes), _gib(r.peak_bytes), _FITS[r.fits],
         *([_ms(r.step_seconds), _fixed(r.mfu), _ms(r.exposed_seconds)] if timed else [])]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *body]]
    notes = [f"{_label(r)}: {note}" for r in rows for note in _notes(r)]
    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([lines[0], rule, *lines[1:], *(["notes:", *notes] if notes else [])])


_FITS = {True: "yes", False: "no", None: "?"}


def _summary(row: PlanRow) -> str:
    """One row in a line: "explicit fsdp, units=Block, on data=256 (v5e): fits 10.1 of 15.75 GiB; ~0.41 s
    a step; MFU 0.52; 12 ms of communication exposed"."""
    units = "" if row.units == "-" else f", units={row.units}"
    schedule = "" if row.schedule == "-" else f", {row.schedule}"
    where = f" ({row.timeline.target.name})" if row.timeline is not None else ""
    head = f"{row.mode} {row.layout}{units}{schedule}, on {row.mesh}{where}"
    device = f" of {row.device_bytes / 2**30:.2f}" if row.device_bytes else ""
    fits = {True: "fits", False: "does not fit", None: "peak"}[row.fits]
    parts = [
        f"{fits} {row.peak_bytes / 2**30:.3g}{device} GiB" + (" (estimated)" if row.fits is None else "")
    ]
    if row.refused:
        parts[0] = (
            f"does not fit: the TPU compiler refused it, needing ~{row.peak_bytes / 2**30:.3g}{device} GiB"
        )
    elif row.step_seconds is None:
        parts.append(f"{row.total_bytes:,} B of collectives a step (no seconds: estimated on the CPU)")
    else:
        parts.append(f"~{_human(row.step_seconds)} a step")
        parts.append("MFU ?" if row.mfu is None else f"MFU {row.mfu:.2f}")
        parts.append(f"{_human(row.exposed_seconds or 0.0)} of communication exposed")
    return f"{head}: {'; '.join(parts)}"


def _human(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g}" if n < 2**30 else f"{n / 2**30:.2f}"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.3g}"


def _fixed(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _notes(row: PlanRow) -> tuple[str, ...]:
    refused = (f"does not fit: the TPU compiler refused it ({row.refused})",) if row.refused else ()
    timed = row.timeline.notes if row.timeline is not None else ()
    return (*row.notes, *refused, *timed)


def _label(row: PlanRow) -> str:
    units = "" if row.units == "-" else f", units={row.units}"
    schedule = "" if row.schedule == "-" else f", {row.schedule}"
    return f"{row.mode} {row.layout}{units}{schedule} on {row.mesh}"
