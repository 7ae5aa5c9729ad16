"""Pipeline schedules: their names, their tables of ticks, the bubble (pipelines guide).

``PipelineSchedule`` says which microbatch each stage runs at each tick; the modes run the
stage cut (``substrax._shared.pipeline``) on it.
"""

from __future__ import annotations

import dataclasses
import fractions
from typing import Any

from substrax._layout import STAGE_AXIS

__all__ = [
    "SCHEDULES",
    "STAGE_AXIS",
    "PipelineSchedule",
    "EXPLICIT_ONLY",
    "Schedule",
    "bubble_fraction",
    "bubble_ratio",
    "check_schedule",
    "check_stage_axis",
]

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
"""The pipeline schedules ``make_train_step(..., schedule=)`` takes (see the pipelines guide)."""

EXPLICIT_ONLY = ("zb-h1",)
"""Schedules only explicit mode writes (a backward split in two ``jax.vjp``s per layer)."""


def check_schedule(schedule: Any, microbatches: int, mode: str = "explicit") -> None:
    """Refuse an unknown ``schedule``, one with fewer than two microbatches, or one ``mode`` lacks.

    Raises:
      ValueError: Naming the schedule, the microbatches, or the mode.
    """
    if schedule is None:
        return
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES} or None (no pipeline); got {schedule!r}.")
    if schedule in EXPLICIT_ONLY and mode != "explicit":
        raise ValueError(
            f"schedule={schedule!r} splits each layer's backward pass in two jax.vjps and runs the weights' "
            f"half ticks later, which only explicit mode writes (under jit, XLA keeps one backward pass). "
            f"Use mode='explicit', or schedule='1f1b' in {mode} mode."
        )
    if microbatches < 2:
        raise ValueError(
            f"schedule={schedule!r} runs the stages as a pipeline over microbatches; with microbatches="
            f"{microbatches} each stage would wait for the one before it. Pass microbatches= at least 2 "
            f"(several times the stages: the bubble is (stages - 1) / (microbatches + stages - 1))."
        )


def check_stage_axis(schedule: str | None, mesh: Any) -> None:
    """Refuse a ``schedule`` on a mesh without the ``stage`` axis (ValueError naming the mesh)."""
    if schedule is not None and STAGE_AXIS not in tuple(getattr(mesh, "axis_names", ()) or ()):
        raise ValueError(
            f"schedule={schedule!r} pipelines a stack over the mesh's {STAGE_AXIS!r} axis, which the "
            f"mesh {dict(getattr(mesh, 'shape', {}))} lacks. Build the mesh with it "
            f"(create_device_mesh({{{STAGE_AXIS!r}: S, 'data': D}})) and place the state with "
            f"shard_state(..., stages=Block), or drop schedule=."
        )


def bubble_fraction(stages: int, microbatches: int, schedule: str = "1f1b") -> float:
    """The share of a pipelined step's time a stage idles (pipelines guide, "The bubble").

    ``"gpipe"``, ``"1f1b"``: ``(stages - 1) / (microbatches + stages - 1)``. ``"zb-h1"``, in
    units of one forward pass (``F`` 1, ``B`` 2: the forward recomputed and the input's
    gradient, ``W`` 1: the weights'): ``3 (S - 1) / (4 k + 3 (S - 1))``.
    """
    return float(bubble_ratio(stages, microbatches, schedule))


def bubble_ratio(stages: int, microbatches: int, schedule: str) -> fractions.Fraction:
    """``bubble_fraction`` as an exact fraction (what the tables print)."""
    idle = stages - 1
    if schedule == "zb-h1":
        return fractions.Fraction(3 * idle, 4 * microbatches + 3 * idle)
    return fractions.Fraction(idle, microbatches + idle)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """Which microbatch each stage runs at each tick (a tick: every stage runs one slot at once).

    ``"gpipe"``: ``ticks`` forward ticks, stage ``s`` forwarding microbatch ``t - s`` at
    tick ``t``; the backward is their transpose (autodiff), the ticks in reverse.
    ``"1f1b"``: ``ticks`` ticks of a forward slot then a backward slot: microbatch ``t - s``
    forward, ``t - (2 * stages - 2 - s)`` backward (the last stage runs the loss and its
    backward in the tick its forward ends); a stage keeps at most ``stash`` stage inputs.
    ``"zb-h1"``: 1F1B's ticks with the backward slot ``B`` computing the input's gradient
    only and a third slot ``W`` the weights', microbatch ``t - (2 * stages - 2)`` on every
    stage (stage ``s`` defers it ``s`` ticks, holding at most ``deferred`` layers' pullbacks).

    ``str()`` draws ``table()``, a row per stage. See the pipelines guide.

    Attributes:
      name: One of ``SCHEDULES``.
      stages: The size of the ``stage`` axis.
      microbatches: The microbatches per step.

    Raises:
      ValueError: If ``name`` is not one of ``SCHEDULES``, or ``stages`` or ``microbatches``
        is not a positive int.

    Example:
      >>> print(substrax.PipelineSchedule("1f1b", stages=2, microbatches=3))
      1f1b, 2 stages, 3 microbatches: 5 ticks, bubble 1/4
      stage 0 | F0    | F1    | F2 B0 | B1    | B2
      stage 1 |       | F0 B0 | F1 B1 | F2 B2 |
    """

    name: str
    stages: int
    microbatches: int

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}; got {self.name!r}.")
        for field in ("stages", "microbatches"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive int; got {value!r}.")

    def __str__(self) -> str:
        rows = self.table()
        width = max(len(c) for row in rows for c in row)
        idle = bubble_ratio(self.stages, self.microbatches, self.name)
        head = f"{self.name}, {self.stages} stages, {self.microbatches} microbatches: {self.ticks} ticks"
        head += f", bubble {idle}"
        lines = [f"stage {s} | " + " | ".join(c.ljust(width) for c in row) for s, row in enumerate(rows)]
        return "\n".join([head, *(line.rstrip() for line in lines)])

    @property
    def ticks(self) -> int:
        """Loop iterations: ``k + S - 1`` (GPipe's forward) or ``k + 2S - 2`` (1F1B, ZB-H1)."""
        extra = self.stages - 1 if self.name == "gpipe" else 2 * self.stages - 2
        return self.microbatches + extra

    @property
    def stash(self) -> int:
        """Stage inputs a 1F1B stage keeps for its backward slots (``2S - 1``; 0 for GPipe,
        whose backward reads the residuals autodiff keeps: every tick's)."""
        return 0 if self.name == "gpipe" else 2 * self.stages - 1

    @property
    def deferred(self) -> int:
        """Microbatches whose weights' gradient a ZB-H1 stage holds back at most (``stages``; 0 else)."""
        return self.stages if self.name == "zb-h1" else 0

    @property
    def bubble(self) -> float:
        """``bubble_fraction(stages, microbatches, name)``."""
        return bubble_fraction(self.stages, self.microbatches, self.name)

    @property
    def phases(self) -> tuple[tuple[int, int, bool, bool, bool], ...]:
        """The ticks as ``(start, stop, forward, backward, weight)`` runs, a loop each, with the
        slots its ticks run: 1F1B's warm-up forward slots only (no stage has a backward yet), its
        steady state both, its cool-down backward only; ZB-H1's the same loops, its weight slot
        beside each backward slot (no stage has one before tick ``2S - 2``: the tick's cond skips
        it there). GPipe: its forward ticks, one phase. ``weight`` is False but in ZB-H1 (1F1B's
        backward slot computes the weights' gradient too)."""
        if self.name == "gpipe":
            return ((0, self.ticks, True, False, False),)
        s, k, zb = self.stages, self.microbatches, self.name == "zb-h1"
        runs = (
            (0, s - 1, True, False, False),
            (s - 1, k + s - 1, True, True, zb),
            (k + s - 1, k + 2 * s - 2, False, True, zb),
        )
        return tuple(r for r in runs if r[1] > r[0])

    def forward(self, tick: Any, stage: Any) -> Any:
        """The microbatch ``stage`` forwards at ``tick`` (ints or arrays; in range only when it runs)."""
        return tick - stage

    def backward(self, tick: Any, stage: Any) -> Any:
        """The microbatch ``stage`` runs backward at ``tick`` of a 1F1B step (in range only when it runs)."""
        return tick - (2 * self.stages - 2 - stage)

    def weight(self, tick: Any, stage: Any) -> Any:
        """The microbatch whose weights' gradient ``stage`` computes at ``tick`` of a ZB-H1 step."""
        return tick - (2 * self.stages - 2)

    def table(self) -> list[list[str]]:
        """Stage by tick, what each slot runs: ``"F3"``, ``"B1"``, ``"F3 B1"``, ``"F3 B1 W0"``
        (ZB-H1) or ``""`` (idle).

        GPipe's table lists its forward ticks, then its backward ones (``2 * ticks`` columns).
        """
        k, rows = self.microbatches, []
        for s in range(self.stages):
            if self.name == "gpipe":
                f = [f"F{t - s}" if 0 <= t - s < k else "" for t in range(self.ticks)]
                rows.append(f + [c.replace("F", "B") for c in reversed(f)])
            else:
                row = []
                for t in range(self.ticks):
                    jf, jb, jw = self.forward(t, s), self.backward(t, s), self.weight(t, s)
                    jw = jw if self.name == "zb-h1" else -1
                    cells = (f"F{jf}" * (0 <= jf < k), f"B{jb}" * (0 <= jb < k), f"W{jw}" * (0 <= jw < k))
                    row.append(" ".join(x for x in cells if x))
                rows.append(row)
        return rows


Schedule = PipelineSchedule  # the name inside the library
