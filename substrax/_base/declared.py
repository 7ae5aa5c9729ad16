"""What the layers declare they communicate, recorded while a step is traced.

A layer declares each collective it writes (``substrax.nn.declare_forward``,
``declare_backward``); they are recorded only inside ``recording()``, where
``TrainStep.check_communication`` and ``substrax.plan`` trace a step, and the census expects
exactly those, per layer and phase. ``naming(model)`` names each layer by its path. See the
tensor-parallelism guide, "A layer of your own".
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from flax import nnx

from substrax._base.trees import path_str

__all__ = [
    "KINDS",
    "Declared",
    "looped",
    "looping",
    "name_of",
    "naming",
    "optional",
    "optional_why",
    "recorder",
    "recording",
    "silenced",
    "silenced_until",
]


KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
"""The collectives a layer may declare: the census's names (``substrax.census.KINDS``)."""


@dataclass(frozen=True)
class Declared:
    """One collective a layer writes, per execution of the layer.

    Attributes:
      layer: the layer's path in the model (``"model['attn']['out']"``), or its class
        name when it ran outside ``naming``.
      phase: ``"forward"`` or ``"backward"``.
      kind: the collective as the census names it (``"all-reduce"``, ``"all-gather"``,
        ``"reduce-scatter"``, ``"collective-permute"``).
      axis: the mesh axis it runs over.
      shape: the buffer the census counts, per device: an all-gather's result, the
        operand of the others.
      dtype: its element type.
      why: what it moves, in a few words.
      dead_if: for a backward collective whose transpose was traced inside ``optional(why)``,
        that ``why`` (the census expects it optionally).
      in_loop: whether it was traced inside a loop of more than one iteration (``looping``), or
        ``None`` where no loop said (the census then goes by the microbatches).
    """

    layer: str
    phase: str
    kind: str
    axis: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    why: str
    dead_if: str = ""  # its transpose traced inside ``optional(why)``: why XLA may drop it
    in_loop: bool | None = None

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def buffer(self) -> str:
        """``"f32[4,8,16]"``, as the census writes buffers."""
        kind = {"f": "f", "i": "s", "u": "u", "c": "c", "b": "pred"}.get(self.dtype.kind, "?")
        bits = "" if self.dtype.kind == "b" else str(self.dtype.itemsize * 8)
        return f"{kind}{bits}[{','.join(map(str, self.shape))}]"


_RECORD: contextvars.ContextVar[list[Declared] | None] = contextvars.ContextVar(
    "substrax_nn_declared", default=None
)
_NAMES: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "substrax_nn_names", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[Declared]]:
    """Collect what the layers declare while a step is traced in this context (a list, filled in place)."""
    declared: list[Declared] = []
    token = _RECORD.set(declared)
    try:
        yield declared
    finally:
        _RECORD.reset(token)


_OPTIONAL: contextvars.ContextVar[str] = contextvars.ContextVar("substrax_nn_optional", default="")


@contextlib.contextmanager
def optional(why: str) -> Iterator[None]:
    """Record the backward collectives whose transposes are traced in this context as ones XLA may
    drop (``why``)."""
    token = _OPTIONAL.set(why)
    try:
        yield
    finally:
        _OPTIONAL.reset(token)


_LOOPED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("substrax_nn_looped", default=None)


@contextlib.contextmanager
def looping(iterations: int) -> Iterator[None]:
    """Trace a loop body of ``iterations`` here: what is declared inside runs in a loop if this loop or
    one around it iterates more than once (XLA unrolls a loop of one iteration: its body runs once)."""
    token = _LOOPED.set(bool(_LOOPED.get()) or iterations > 1)
    try:
        yield
    finally:
        _LOOPED.reset(token)


def looped() -> bool | None:
    """Whether a collective declared here runs in a loop (``looping``), ``None`` outside every one."""
    return _LOOPED.get()


def optional_why(phase: str) -> str:
    """Why a collective of ``phase`` whose transpose is traced here may be dropped (``optional``),
    else ``""``."""
    return _OPTIONAL.get() if phase == "backward" else ""


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """Record nothing in this context: for a trace that only reads shapes (``jax.eval_shape``)."""
    token = _RECORD.set(None)
    try:
        yield
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def silenced_until() -> Iterator[Any]:
    """Record nothing until the ``resume()`` this yields is called, then as before: for a trace
    whose first part is dead code (a pipeline's epilogue reruns ``loss_fn`` up to the stack)."""
    saved = _RECORD.get()
    token = _RECORD.set(None)
    try:
        yield lambda: _RECORD.set(saved)
    finally:
        _RECORD.reset(token)


def recorder() -> list[Declared] | None:
    """The list ``recording`` fills here, or ``None`` outside one."""
    return _RECORD.get()


@contextlib.contextmanager
def naming(model: Any) -> Iterator[None]:
    """Name each module of ``model`` by its path while it runs (only while ``recording``)."""
    if _RECORD.get() is None:
        yield
        return
    names = {id(node): path_str(tuple(path), "model") for path, node in nnx.iter_graph(model)}
    token = _NAMES.set({**(_NAMES.get() or {}), **names})
    try:
        yield
    finally:
        _NAMES.reset(token)


def name_of(layer: nnx.Module) -> str:
    """``layer``'s path, as ``naming`` set it, else its class name."""
    return (_NAMES.get() or {}).get(id(layer), type(layer).__name__)
