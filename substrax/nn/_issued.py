"""What ``substrax.nn``'s layers communicate, said by the layers while a step is traced.

Each collective a layer writes is announced where it is written: ``forward(...)`` for
one the forward pass runs, ``backward(...)`` for one that AD's transpose of it runs (a
``pcast`` to varying becomes a ``psum`` of the gradient, a ``psum_scatter`` an
``all_gather``, ...). Outside ``recording()`` both do nothing (``backward`` returns its
value untouched), so a step traced for training is the program as written. Inside it,
each announcement is kept as an ``Issued``, and ``backward`` wraps its value in an
identity whose custom VJP records the collective only when AD does transpose it: a layer
whose input carries no gradient (the batch) runs no backward collective, and none is
recorded.

``substrax.census`` reads these (``TrainStep.check_communication`` traces the step
afresh inside ``recording()``) to expect each layer's collectives over the model axis,
per layer and phase, before it reads the compiled program. ``naming(model)`` names each
layer by its path in the model while the loss function runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from substrax._collectives import to_varying as _cast_varying
from substrax._collectives import varying_axes
from substrax._tree import path_str

__all__ = ["Issued", "backward", "forward", "naming", "recording", "silenced", "to_varying"]

SCOPE = "substrax.tensor_parallel"  # the named scope of every collective of this package


@dataclass(frozen=True)
class Issued:
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
    """

    layer: str
    phase: str
    kind: str
    axis: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    why: str

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def buffer(self) -> str:
        """``"f32[4,8,16]"``, as the census writes buffers."""
        kind = {"f": "f", "i": "s", "u": "u", "c": "c", "b": "pred"}.get(self.dtype.kind, "?")
        bits = "" if self.dtype.kind == "b" else str(self.dtype.itemsize * 8)
        return f"{kind}{bits}[{','.join(map(str, self.shape))}]"


_RECORD: contextvars.ContextVar[list[Issued] | None] = contextvars.ContextVar(
    "substrax_nn_issued", default=None
)
_NAMES: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "substrax_nn_names", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[Issued]]:
    """Collect what the layers announce while a step is traced in this context (a list, filled in place)."""
    issued: list[Issued] = []
    token = _RECORD.set(issued)
    try:
        yield issued
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """Record nothing in this context: for a trace that only reads shapes (``jax.eval_shape``)."""
    token = _RECORD.set(None)
    try:
        yield
    finally:
        _RECORD.reset(token)


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


def _name(layer: nnx.Module) -> str:
    return (_NAMES.get() or {}).get(id(layer), type(layer).__name__)


def _issued(
    layer: str, phase: str, kind: str, axis: str, like: Any, shape: tuple[int, ...] | None, why: str
) -> Issued:
    return Issued(
        layer, phase, kind, axis, tuple(like.shape if shape is None else shape), np.dtype(like.dtype), why
    )


def forward(
    layer: nnx.Module, kind: str, axis: str, like: Any, why: str, *, shape: tuple[int, ...] | None = None
) -> None:
    """Announce a forward collective over ``axis`` whose counted buffer is ``like`` (or ``shape`` of its dtype)."""
    record = _RECORD.get()
    if record is not None:
        record.append(_issued(_name(layer), "forward", kind, axis, like, shape, why))


def backward(
    layer: nnx.Module, kind: str, axis: str, value: Any, why: str, *, shape: tuple[int, ...] | None = None
) -> Any:
    """``value``, and the announcement of the collective AD's transpose runs for its gradient.

    ``shape``: that collective's counted buffer, when it is not ``value``'s shape. The
    announcement is made only if the gradient is computed (see the module docstring).
    """
    record = _RECORD.get()
    if record is None:
        return value
    issued = _issued(_name(layer), "backward", kind, axis, value, shape, why)

    @jax.custom_vjp
    def tap(x: Any) -> Any:
        return x

    def tap_fwd(x: Any) -> tuple[Any, None]:
        return x, None

    def tap_bwd(_: None, cotangent: Any) -> tuple[Any]:
        record.append(issued)
        return (cotangent,)

    tap.defvjp(tap_fwd, tap_bwd)
    return tap(value)


def to_varying(layer: nnx.Module, x: Any, axis: str) -> Any:
    """``x`` typed varying over ``axis`` (Megatron's *f*): no communication forward, the
    gradient ``psum``-ed over ``axis`` backward. ``x`` itself if it already varies there."""
    if axis in (varying_axes(x) or ()):
        return x
    x = backward(layer, "all-reduce", axis, x, "the input's gradient, summed")
    with jax.named_scope(SCOPE):
        return _cast_varying(x, axis)
