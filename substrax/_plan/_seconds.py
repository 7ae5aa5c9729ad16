"""A compiled row's seconds: its program's predicted step (``substrax.timeline``), and its MFU:
the model's FLOPs (``timeline.model_flops``) over what the devices could do in the predicted step,
``model_flops / (devices x peak x step_seconds)``."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from jax.sharding import Mesh

from substrax.timeline import Target, model_flops, predict, target_of

__all__ = ["Timing", "model_flops", "timed"]


class Timing(NamedTuple):
    """What a compiled row's seconds are predicted with: the model's FLOPs (``None``: no MFU) and the
    target (``None``: the mesh's devices')."""

    model_flops: float | None = None
    target: Target | str | None = None


def timed(program: Any, mesh: Mesh, timing: Timing) -> dict[str, Any]:
    """A compiled row's predicted fields: ``flops``, the seconds, ``mfu``, its ``timeline``; none on a
    platform with no ``Target`` (a CPU) unless ``timing`` names one."""
    flops_of_model = timing.model_flops
    target = target_of(mesh, timing.target)
    if target is None:
        return {}
    timeline = predict(program, mesh=mesh, target=target)
    devices = math.prod(mesh.shape.values())
    step = timeline.step_seconds
    mfu = flops_of_model / (devices * target.flops * step) if flops_of_model and step > 0 else None
    return {
        "flops": timeline.flops,
        "compute_seconds": timeline.compute_seconds,
        "communication_seconds": timeline.communication_seconds,
        "exposed_seconds": timeline.exposed_seconds,
        "step_seconds": step,
        "mfu": mfu,
        "timeline": timeline,
    }
