"""A compiled row's seconds: its program's predicted step (``substrax.timeline``), and its MFU:
the model's FLOPs (``timeline.model_flops``) over what the devices could do in the predicted step,
``model_flops / (devices x peak x step_seconds)``."""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import Mesh

from substrax.timeline import model_flops, predict, target_of

__all__ = ["model_flops", "timed"]


def timed(program: Any, mesh: Mesh, flops_of_model: float | None) -> dict[str, Any]:
    """A compiled row's predicted fields: ``flops``, the seconds, ``mfu``, its ``timeline``; none on a
    platform with no ``Target`` (a CPU)."""
    target = target_of(mesh)
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
