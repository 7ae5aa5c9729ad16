"""``predict``: a compiled step's time on its target, and the ``Timeline`` that shows it."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax

from substrax.census import census, parse_module
from substrax.timeline._links import axis_links
from substrax.timeline._targets import Target, target_of
from substrax.timeline._walk import Event, walk

__all__ = ["Timeline", "predict"]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One step of a compiled program, predicted on its target (see the planning guide, "Seconds").

    Attributes:
      target: The accelerator's numbers it was predicted with.
      flops: FLOPs per device per step (the program's, loops counted their trip count times).
      compute_seconds: Every operation at its bound (matrix units or memory), one after another.
      communication_seconds: Every collective at its link's bandwidth, none overlapped.
      exposed_seconds: What of the collectives the compute waited for.
      step_seconds: ``compute_seconds + exposed_seconds``.
      events: The step's spans: compute, and each collective on its link.
      notes: What the prediction could not read (a loop of unknown trip count).
    """

    target: Target
    flops: float
    compute_seconds: float
    communication_seconds: float
    exposed_seconds: float
    step_seconds: float
    events: tuple[Event, ...] = dataclasses.field(repr=False, default=())
    notes: tuple[str, ...] = ()

    def collectives(self) -> list[Event]:
        """The collectives, the most exposed first."""
        return sorted((e for e in self.events if e.lane != "compute"), key=lambda e: -e.exposed)

    def chrome_trace(self, title: str = "substrax: a step, predicted") -> dict[str, Any]:
        """The timeline as a Chrome trace (the JSON ``jax.profiler`` writes and Perfetto opens): one
        track for the compute, one per link; times in microseconds."""
        lanes = ["compute", *sorted({e.lane for e in self.events} - {"compute"})]
        meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}}]
        meta += [{"ph": "M", "pid": 1, "tid": i, "name": "thread_name", "args": {"name": lane}}
                 for i, lane in enumerate(lanes)]  # fmt: skip
        spans = [
            {
                "ph": "X", "pid": 1, "tid": lanes.index(e.lane), "name": e.name, "cat": e.kind,
                "ts": e.start * 1e6, "dur": e.seconds * 1e6,
                "args": {k: v for k, v in (("op_name", e.op_name), ("bytes", e.bytes), ("flops", e.flops),
                                           ("exposed_us", e.exposed * 1e6)) if v},
            }
            for e in self.events
        ]  # fmt: skip
        return {"traceEvents": meta + spans, "displayTimeUnit": "ms"}

    def write_trace(self, path: str, title: str = "substrax: a step, predicted") -> str:
        """Write ``chrome_trace()`` to ``path`` (open it at ui.perfetto.dev, or ``chrome://tracing``)."""
        with open(path, "w") as file:
            json.dump(self.chrome_trace(title), file)
        return path

    def __str__(self) -> str:
        return (
            f"{self.step_seconds * 1e3:.3g} ms a step on {self.target.name}: compute "
            f"{self.compute_seconds * 1e3:.3g} ms, communication {self.communication_seconds * 1e3:.3g} ms "
            f"({self.exposed_seconds * 1e3:.3g} ms exposed), {self.flops:.3g} FLOPs per device"
        )


def predict(
    compiled: jax.stages.Compiled | str, *, mesh: Any = None, target: Target | str | None = None
) -> Timeline:
    """The step time of a program compiled for a TPU or a GPU, predicted from the program.

    Args:
      compiled: A ``jax.stages.Compiled`` (its devices name the target), or its HLO text (then
        ``target`` or ``mesh`` names it).
      mesh: The mesh it was compiled for: names each collective's axes, so its link.
      target: A ``Target`` or a ``TARGETS`` name; default the mesh's (or the program's) devices'.

    Returns:
      A ``Timeline``.

    Raises:
      ValueError: If no target is known for the program's devices (a CPU's): pass ``target=``.
    """
    chosen = target_of(mesh if mesh is not None else _device_of(compiled), target)
    if chosen is None:
        raise ValueError(
            "predict: no Target for these devices (a CPU's): the model predicts TPUs and GPUs. Pass "
            "target= (one of substrax.timeline.TARGETS, or a Target) to predict this program on one."
        )
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    module = parse_module(text)
    rows = {(r.computation, r.name): r for r in census(text, mesh=mesh).rows}
    links = axis_links(mesh) if mesh is not None else {}
    devices = module.num_devices or (math.prod(mesh.shape.values()) if mesh is not None else None)
    span = walk(module, rows, links, chosen, devices)
    exposed = min(span.exposed, span.communication)  # equal but for the clock's round-off
    return Timeline(
        target=chosen,
        flops=span.flops,
        compute_seconds=span.compute,
        communication_seconds=span.communication,
        exposed_seconds=exposed,
        step_seconds=span.compute + exposed,
        events=tuple(span.events),
        notes=tuple(span.notes),
    )


def _device_of(compiled: Any) -> Any:
    for sharding in jax.tree.leaves((getattr(compiled, "input_shardings", None),
                                     getattr(compiled, "output_shardings", None))):  # fmt: skip
        devices = getattr(sharding, "device_set", None)
        if devices:
            return next(iter(devices))
    return None
