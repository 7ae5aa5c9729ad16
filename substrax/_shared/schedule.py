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

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")
"""The pipeline schedules ``make_train_step(..., schedule=)`` takes (see the pipelines guide)."""

EXPLICIT_ONLY = ("zb-h1", "interleaved-1f1b")
"""Schedules only explicit mode writes (a backward split in two ``jax.vjp``s per layer; chunks of
layers moved between stages each step)."""


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
        why = (
            "splits each layer's backward pass in two jax.vjps and runs the weights' half ticks later, which "
            "only explicit mode writes (under jit, XLA keeps one backward pass)"
            if schedule == "zb-h1"
            else "runs each stage's chunks of layers in turn and moves them between stages each step, which "
            "only explicit mode writes (ppermutes of the chunks and the carry around the ring of stages)"
        )
        raise ValueError(
            f"schedule={schedule!r} {why}. Use mode='explicit', or schedule='1f1b' in {mode} mode."
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


def bubble_fraction(stages: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """The share of a pipelined step's time a stage idles (pipelines guide, "The bubble").

    ``"gpipe"``, ``"1f1b"``: ``(stages - 1) / (microbatches + stages - 1)``. ``"zb-h1"``, in
    units of one forward pass (``F`` 1, ``B`` 2: the forward recomputed and the input's
    gradient, ``W`` 1: the weights'): ``3 (S - 1) / (4 k + 3 (S - 1))``.
    ``"interleaved-1f1b"`` with ``v`` chunks a stage: ``(S - 1) / (v k + S - 1)``.
    """
    return float(bubble_ratio(stages, microbatches, schedule, virtual_stages))


def bubble_ratio(
    stages: int, microbatches: int, schedule: str, virtual_stages: int = 1
) -> fractions.Fraction:
    """``bubble_fraction`` as an exact fraction (what the tables print)."""
    idle = stages - 1
    if schedule == "zb-h1":
        return fractions.Fraction(3 * idle, 4 * microbatches + 3 * idle)
    if schedule == "interleaved-1f1b":
        return fractions.Fraction(idle, virtual_stages * microbatches + idle)
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
    ``"interleaved-1f1b"``: 1F1B over ``stages * virtual_stages`` chunks of layers, stage ``s``
    running chunks ``s, s + stages, ...`` (its chunk ``u`` is chunk ``u * stages + s``), a
    chunk's forward or backward each slot, the microbatches in groups of ``stages``
    (Megatron's order); 1F1B is its ``virtual_stages=1``.

    ``str()`` draws ``table()``, a row per stage. See the pipelines guide.

    Attributes:
      name: One of ``SCHEDULES``.
      stages: The size of the ``stage`` axis.
      microbatches: The microbatches per step.
      virtual_stages: The chunks a stage runs (``"interleaved-1f1b"``; 1 otherwise).

    Raises:
      ValueError: If ``name`` is not one of ``SCHEDULES``, ``stages``, ``microbatches`` or
        ``virtual_stages`` is not a positive int, ``virtual_stages`` is not 1 outside
        ``"interleaved-1f1b"``, or the stages do not divide its microbatches.

    Example:
      >>> print(substrax.PipelineSchedule("1f1b", stages=2, microbatches=3))
      1f1b, 2 stages, 3 microbatches: 5 ticks, bubble 1/4
      stage 0 | F0    | F1    | F2 B0 | B1    | B2
      stage 1 |       | F0 B0 | F1 B1 | F2 B2 |
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}; got {self.name!r}.")
        for field in ("stages", "microbatches", "virtual_stages"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive int; got {value!r}.")
        if self.virtual_stages > 1 and self.name != "interleaved-1f1b":
            raise ValueError(
                f"virtual_stages={self.virtual_stages} runs several chunks a stage, which only "
                f"schedule='interleaved-1f1b' does; {self.name!r} runs one."
            )
        if self.virtual_stages > 1 and self.microbatches % self.stages:
            raise ValueError(
                f"schedule='interleaved-1f1b' runs the microbatches in groups of the {self.stages} stages; "
                f"microbatches={self.microbatches} is not a multiple of {self.stages}. Pass microbatches= "
                f"a multiple of the stage axis's size."
            )

    def __str__(self) -> str:
        rows = self.table()
        width = max(len(c) for row in rows for c in row)
        idle = bubble_ratio(self.stages, self.microbatches, self.name, self.virtual_stages)
        head = f"{self.name}, {self.stages} stages, {self.microbatches} microbatches"
        head += f", {self.virtual_stages} chunks a stage" * (self.virtual_stages > 1)
        head += f": {self.ticks} ticks, bubble {idle}"
        lines = [f"stage {s} | " + " | ".join(c.ljust(width) for c in row) for s, row in enumerate(rows)]
        return "\n".join([head, *(line.rstrip() for line in lines)])

    @property
    def _chunks(self) -> int:
        return self.stages * self.virtual_stages

    @property
    def ticks(self) -> int:
        """Loop iterations: ``k + S - 1`` (GPipe's forward), ``k + 2S - 2`` (1F1B, ZB-H1) or
        ``v k + (v + 1) S - 2`` (interleaved, each tick a chunk's slots)."""
        if self.name == "gpipe":
            return self.microbatches + self.stages - 1
        return self.virtual_stages * self.microbatches + self._chunks + self.stages - 2

    @property
    def stash(self) -> int:
        """Stage inputs a 1F1B stage keeps for its backward slots (``2S - 1``; per chunk when
        interleaved, the most any chunk holds at once; 0 for GPipe, whose backward reads the
        residuals autodiff keeps: every tick's)."""
        if self.name == "gpipe":
            return 0
        if self.virtual_stages == 1:
            return 2 * self.stages - 1
        most = 0
        for c in range(self._chunks):
            spans = [
                (self._base(j) + c, self._base(j) + 2 * self._chunks - 2 - c)
                for j in range(self.microbatches)
            ]
            most = max(most, max(sum(a <= t <= b for a, b in spans) for t in range(self.ticks)))
        return most

    @property
    def deferred(self) -> int:
        """Microbatches whose weights' gradient a ZB-H1 stage holds back at most (``stages``; 0 else)."""
        return self.stages if self.name == "zb-h1" else 0

    @property
    def bubble(self) -> float:
        """``bubble_fraction(stages, microbatches, name, virtual_stages)``."""
        return bubble_fraction(self.stages, self.microbatches, self.name, self.virtual_stages)

    @property
    def phases(self) -> tuple[tuple[int, int, bool, bool, bool], ...]:
        """The ticks as ``(start, stop, forward, backward, weight)`` runs, a loop each, with the
        slots its ticks run: 1F1B's warm-up forward slots only (no stage has a backward yet), its
        steady state both, its cool-down backward only; ZB-H1's the same loops, its weight slot
        beside each backward slot (no stage has one before tick ``2S - 2``: the tick's cond skips
        it there); interleaved's the same three, the warm-up ``v S - 1`` ticks. GPipe: its forward
        ticks, one phase. ``weight`` is False but in ZB-H1 (1F1B's backward slot computes the
        weights' gradient too)."""
        if self.name == "gpipe":
            return ((0, self.ticks, True, False, False),)
        s, k, v, zb = self.stages, self.microbatches, self.virtual_stages, self.name == "zb-h1"
        runs = (
            (0, v * s - 1, True, False, False),
            (v * s - 1, v * k + s - 1, True, True, zb),
            (v * k + s - 1, self.ticks, False, True, zb),
        )
        return tuple(r for r in runs if r[1] > r[0])

    def _base(self, j: int) -> int:
        """The tick microbatch ``j`` enters chunk 0 (interleaved: groups of ``stages``)."""
        return (j // self.stages) * self._chunks + j % self.stages

    def _task(self, n: Any, backward: bool) -> tuple[Any, Any]:
        """A stage's ``n``-th forward (or backward) slot's ``(microbatch, chunk)``."""
        group, rest = n // self._chunks, n % self._chunks
        chunk = rest // self.stages
        return group * self.stages + rest % self.stages, (
            self.virtual_stages - 1 - chunk
        ) if backward else chunk

    def forward(self, tick: Any, stage: Any) -> Any:
        """The microbatch ``stage`` forwards at ``tick`` (ints or arrays; in range only when it runs)."""
        return self._task(tick - stage, False)[0]

    def forward_chunk(self, tick: Any, stage: Any) -> Any:
        """Which of its chunks ``stage`` forwards at ``tick`` (0 but when interleaved)."""
        return self._task(tick - stage, False)[1]

    def backward(self, tick: Any, stage: Any) -> Any:
        """The microbatch ``stage`` runs backward at ``tick`` of a 1F1B step (in range only when it runs)."""
        return self._task(tick - (self._chunks + self.stages - 2 - stage), True)[0]

    def backward_chunk(self, tick: Any, stage: Any) -> Any:
        """Which of its chunks ``stage`` runs backward at ``tick`` (0 but when interleaved)."""
        return self._task(tick - (self._chunks + self.stages - 2 - stage), True)[1]

    def weight(self, tick: Any, stage: Any) -> Any:
        """The microbatch whose weights' gradient ``stage`` computes at ``tick`` of a ZB-H1 step."""
        return tick - (2 * self.stages - 2)

    def table(self) -> list[list[str]]:
        """Stage by tick, what each slot runs: ``"F3"``, ``"B1"``, ``"F3 B1"``, ``"F3 B1 W0"``
        (ZB-H1), ``"F3.1 B0.0"`` (interleaved: microbatch 3 through the stage's chunk 1) or ``""``
        (idle).

        GPipe's table lists its forward ticks, then its backward ones (``2 * ticks`` columns).
        """
        k, rows = self.microbatches, []
        for s in range(self.stages):
            if self.name == "gpipe":
                f = [f"F{t - s}" if 0 <= t - s < k else "" for t in range(self.ticks)]
                rows.append(f + [c.replace("F", "B") for c in reversed(f)])
                continue
            row = []
            for t in range(self.ticks):
                jf, jb, jw = self.forward(t, s), self.backward(t, s), self.weight(t, s)
                jw = jw if self.name == "zb-h1" else -1
                uf, ub = (
                    (f".{self.forward_chunk(t, s)}", f".{self.backward_chunk(t, s)}")
                    if (self.virtual_stages > 1)
                    else ("", "")
                )
                cells = (f"F{jf}{uf}" * (0 <= jf < k), f"B{jb}{ub}" * (0 <= jb < k), f"W{jw}" * (0 <= jw < k))
                row.append(" ".join(x for x in cells if x))
            rows.append(row)
        return rows


Schedule = PipelineSchedule  # the name inside the library


def chunk_rounds(stages: int, virtual_stages: int) -> list[list[tuple[int, int, int, int]]]:
    """How an interleaved step moves the stack's chunks from where ``shard_state`` places them
    (stage ``d`` holds chunks ``d v ... d v + v - 1``, consecutive layers) to where they run
    (chunk ``c`` on stage ``c % S``, its slot ``c // S``): ``v`` rounds, each one ``ppermute``
    over the stages (a perfect matching of the regular bipartite graph of moves, König), as
    ``(from stage, its slot, to stage, its slot)`` per stage."""
    s, v = stages, virtual_stages
    left = {d: [d * v + a for a in range(v)] for d in range(s)}  # the chunks each stage still sends
    rounds = []
    for _ in range(v):
        match: dict[int, tuple[int, int]] = {}  # to stage -> (from stage, chunk)

        def augment(d: int, seen: set[int], match: dict[int, tuple[int, int]] = match) -> bool:
            for c in left[d]:
                e = c % s
                if e not in seen:
                    seen.add(e)
                    if e not in match or augment(match[e][0], seen):
                        match[e] = (d, c)
                        return True
            return False

        for d in range(s):
            if not augment(d, set()):
                raise AssertionError("a regular bipartite graph has a perfect matching")
        for d, c in match.values():
            left[d].remove(c)
        rounds.append(sorted((d, c - d * v, c % s, c // s) for d, c in match.values()))
    return rounds
