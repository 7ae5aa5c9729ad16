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
    "Schedule",
    "bubble_fraction",
    "check_schedule",
    "check_stage_axis",
]

SCHEDULES = ("gpipe", "1f1b")
"""The pipeline schedules ``make_train_step(..., schedule=)`` takes (see the pipelines guide)."""


def check_schedule(schedule: Any, microbatches: int) -> None:
    """Refuse an unknown ``schedule``, or one with fewer than two microbatches.

    Raises:
      ValueError: Naming the schedule, or the microbatches.
    """
    if schedule is None:
        return
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES} or None (no pipeline); got {schedule!r}.")
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


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of a pipelined step's ticks a stage idles: ``(stages - 1) / (microbatches + stages - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """Which microbatch each stage runs at each tick (a tick: every stage runs one slot at once).

    ``"gpipe"``: ``ticks`` forward ticks, stage ``s`` forwarding microbatch ``t - s`` at
    tick ``t``; the backward is their transpose (autodiff), the ticks in reverse.
    ``"1f1b"``: ``ticks`` ticks of a forward slot then a backward slot: microbatch ``t - s``
    forward, ``t - (2 * stages - 2 - s)`` backward (the last stage runs the loss and its
    backward in the tick its forward ends); a stage keeps at most ``stash`` stage inputs.

    ``str()`` draws ``table()``, a row per stage. See the pipelines guide.

    Attributes:
      name: ``"gpipe"`` or ``"1f1b"``.
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
        idle = fractions.Fraction(self.stages - 1, self.microbatches + self.stages - 1)
        head = f"{self.name}, {self.stages} stages, {self.microbatches} microbatches: {self.ticks} ticks"
        head += f", bubble {idle}"
        lines = [f"stage {s} | " + " | ".join(c.ljust(width) for c in row) for s, row in enumerate(rows)]
        return "\n".join([head, *(line.rstrip() for line in lines)])

    @property
    def ticks(self) -> int:
        """Loop iterations: ``k + S - 1`` (GPipe's forward) or ``k + 2S - 2`` (1F1B)."""
        extra = self.stages - 1 if self.name == "gpipe" else 2 * self.stages - 2
        return self.microbatches + extra

    @property
    def stash(self) -> int:
        """Stage inputs a 1F1B stage keeps for its backward slots (``2S - 1``; 0 for GPipe,
        whose backward reads the residuals autodiff keeps: every tick's)."""
        return 0 if self.name == "gpipe" else 2 * self.stages - 1

    @property
    def bubble(self) -> float:
        """``bubble_fraction(stages, microbatches)``, for both schedules."""
        return bubble_fraction(self.stages, self.microbatches)

    @property
    def phases(self) -> tuple[tuple[int, int, bool, bool], ...]:
        """1F1B's ticks as ``(start, stop, forward, backward)`` runs: the warm-up runs forward
        slots only (no stage has a backward yet), the steady state both, the cool-down backward
        only; each phase is one loop. GPipe: its forward ticks, one phase."""
        if self.name == "gpipe":
            return ((0, self.ticks, True, False),)
        s, k = self.stages, self.microbatches
        runs = (
            (0, s - 1, True, False),
            (s - 1, k + s - 1, True, True),
            (k + s - 1, k + 2 * s - 2, False, True),
        )
        return tuple(r for r in runs if r[1] > r[0])

    def forward(self, tick: Any, stage: Any) -> Any:
        """The microbatch ``stage`` forwards at ``tick`` (ints or arrays; in range only when it runs)."""
        return tick - stage

    def backward(self, tick: Any, stage: Any) -> Any:
        """The microbatch ``stage`` runs backward at ``tick`` of a 1F1B step (in range only when it runs)."""
        return tick - (2 * self.stages - 2 - stage)

    def table(self) -> list[list[str]]:
        """Stage by tick, what each slot runs: ``"F3"``, ``"B1"``, ``"F3 B1"`` or ``""`` (idle).

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
                    jf, jb = self.forward(t, s), self.backward(t, s)
                    row.append(" ".join(x for x in (f"F{jf}" * (0 <= jf < k), f"B{jb}" * (0 <= jb < k)) if x))
                rows.append(row)
        return rows


Schedule = PipelineSchedule  # the name inside the library
