"""How a step and the code it traces talk: the attributes a step sets on a layer's module inside
its trace, for the layer to hand the step its work (``scan_layers`` reads them, the steps set
them), and ``recording_into``, where a traced step notes what it ran."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

__all__ = ["STAGE_HOOK", "UNIT_HOOK", "recording_into"]

T = TypeVar("T")

# a pipelined step on a staged stack: an object whose ``reached(stack, x, args, kwargs, remat)``
# scan_layers returns instead (substrax._shared.pipeline: the loss cut at the stack)
STAGE_HOOK = "_substrax_stage"
# the explicit step on an FSDP unit: its run, whose ``scan`` runs a prefetched stack (explicit._units)
UNIT_HOOK = "_substrax_unit"


@contextlib.contextmanager
def recording_into(var: contextvars.ContextVar[T | None], record: T) -> Iterator[T]:
    """Set ``var`` to ``record`` while the ``with`` lasts (what a traced step notes goes there)."""
    token = var.set(record)
    try:
        yield record
    finally:
        var.reset(token)
