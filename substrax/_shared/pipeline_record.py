"""What a pipelined step records while it is traced, for the census (census guide, "Pipelines").

``TrainStep.check_communication`` traces the step inside ``recording_pipeline()``; the
pipeline of either mode calls ``note_pipeline`` with its schedule, one stage's carry and
the metrics it stacks over microbatches. Outside ``recording_pipeline`` nothing is kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from substrax._base.hooks import recording_into

__all__ = ["PipelineRun", "note_pipeline", "recording_pipeline"]


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    """One pipelined step as traced.

    Attributes:
      schedule: One of ``SCHEDULES``.
      stages: The size of the ``stage`` axis.
      microbatches: The microbatches per step.
      ticks: The schedule's ticks (``Schedule.ticks``).
      phases: ``Schedule.phases``: ``(start, stop, forward, backward, weight)`` per loop.
      mode: ``"explicit"`` or ``"implicit"``.
      carry: One stage's carry on one device, ``(shape, dtype)`` per leaf (the stack's input
        and the arrays that travel with it).
      aux: The metrics stacked over microbatches on one device, ``(shape, dtype)`` per leaf.
      virtual_stages: The chunks a stage runs (interleaved; 1 otherwise).
      moved: Each ``ppermute`` moving a chunk between stages (interleaved), in trace order:
        ``("out" or "back", (shape, dtype))``, a parameter's (or random stream's) piece to the
        stage that runs it, or its gradient (or advanced stream) home.
    """

    schedule: str
    stages: int
    microbatches: int
    ticks: int
    phases: tuple[tuple[int, int, bool, bool, bool], ...]
    mode: str
    carry: tuple[tuple[tuple[int, ...], np.dtype[Any]], ...] = ()
    aux: tuple[tuple[tuple[int, ...], np.dtype[Any]], ...] = ()
    virtual_stages: int = 1
    moved: tuple[tuple[str, tuple[tuple[int, ...], np.dtype[Any]]], ...] = ()


_RECORD: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "substrax_pipeline", default=None
)


@contextlib.contextmanager
def recording_pipeline() -> Iterator[list[PipelineRun]]:
    """Collect the pipelined step traced in this context (a list of at most one, filled on exit)."""
    found: list[PipelineRun] = []
    with recording_into(_RECORD, {}) as fields:
        try:
            yield found
        finally:
            if "schedule" in fields:
                found.append(PipelineRun(**fields))


def _avals(tree: Any) -> tuple[tuple[tuple[int, ...], np.dtype[Any]], ...]:
    return tuple((tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(tree))


def note_pipeline(
    schedule: Any = None,
    *,
    mode: str = "",
    carry: Any = None,
    aux: Any = None,
    moved: Any = None,
    back: bool = False,
) -> None:
    """Record (inside ``recording_pipeline``) the ``Schedule``, one stage's ``carry``, the stacked ``aux``,
    a chunk's piece ``moved`` between stages (``back``: home)."""
    fields = _RECORD.get()
    if fields is None:
        return
    if schedule is not None:
        fields.update(schedule=schedule.name, stages=int(schedule.stages),
                      microbatches=int(schedule.microbatches), ticks=int(schedule.ticks),
                      phases=tuple(schedule.phases), mode=mode,
                      virtual_stages=int(schedule.virtual_stages))  # fmt: skip
    if carry is not None:
        fields["carry"] = _avals(carry)
    if aux is not None:
        fields["aux"] = _avals(aux)
    if moved is not None:
        fields["moved"] = fields.get("moved", ()) + (("back" if back else "out", _avals(moved)[0]),)
