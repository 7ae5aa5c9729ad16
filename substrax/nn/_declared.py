"""What a tensor-parallel layer communicates, declared by the layer where it writes it.

``declare_forward`` and ``declare_backward`` do nothing outside ``recording()``;
``TrainStep.check_communication`` traces the step inside it and the census expects
exactly the declared collectives, per layer and phase. ``naming(model)`` names each layer
by its path. See the tensor-parallelism guide, "A layer of your own".
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

from substrax._metrics.collectives import to_varying, varying_axes
from substrax._shared import scopes
from substrax._tree import path_str

__all__ = [
    "KINDS",
    "Declared",
    "copy_to_model_axis",
    "declare_backward",
    "declare_forward",
    "naming",
    "recording",
    "silenced",
    "silenced_until",
]


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


KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
"""The collectives a layer may declare: the census's names (``substrax.census.KINDS``)."""


def _declared(
    layer: str, phase: str, kind: str, axis: str, like: Any, shape: tuple[int, ...] | None, why: str
) -> Declared:
    if kind not in KINDS:
        raise ValueError(
            f"declare_{phase}: {kind!r} is not a collective the census counts; declare one of "
            f"{', '.join(map(repr, KINDS))} (the HLO instruction's name)."
        )
    if not isinstance(axis, str):
        raise TypeError(f"declare_{phase}: axis must be one mesh axis name, a str; got {axis!r}.")
    return Declared(
        layer, phase, kind, axis, tuple(like.shape if shape is None else shape), np.dtype(like.dtype), why
    )


def declare_forward(
    layer: nnx.Module, kind: str, axis: str, like: Any, why: str, *, shape: tuple[int, ...] | None = None
) -> None:
    """Declare a collective the forward pass runs in ``layer``, for the census.

    Args:
      layer: The module writing it (named by its path in the model).
      kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``,
        ``"collective-permute"`` or ``"all-to-all"``, as the census names them.
      axis: The mesh axis it runs over.
      like: An array whose shape and dtype are the buffer the census counts: an
        all-gather's result, the operand of the others.
      why: What it moves, in a few words (the census prints it).
      shape: That buffer's shape, when it is not ``like``'s.

    Raises:
      ValueError: If ``kind`` is not one of those.
      TypeError: If ``axis`` is not a str.
    """
    declared = _declared(_name(layer), "forward", kind, axis, like, shape, why)  # checked even unrecorded
    record = _RECORD.get()
    if record is not None:
        record.append(declared)


def declare_backward(
    layer: nnx.Module, kind: str, axis: str, value: Any, why: str, *, shape: tuple[int, ...] | None = None
) -> Any:
    """``value``, declaring the collective AD's transpose runs for its gradient, for the census.

    Wrap the value whose gradient the transpose communicates (a ``pcast``'s input, a
    ``psum_scatter``'s output); the arguments are ``declare_forward``'s, ``value`` in
    place of ``like``. The declaration is recorded only if that gradient is computed.

    Raises:
      ValueError: If ``kind`` is not one ``declare_forward`` takes.
      TypeError: If ``axis`` is not a str.
    """
    declared = _declared(_name(layer), "backward", kind, axis, value, shape, why)  # checked even unrecorded
    record = _RECORD.get()
    if record is None:
        return value

    @jax.custom_vjp
    def tap(x: Any) -> Any:
        return x

    def tap_fwd(x: Any) -> tuple[Any, None]:
        return x, None

    def tap_bwd(_: None, cotangent: Any) -> tuple[Any]:
        record.append(declared)
        return (cotangent,)

    tap.defvjp(tap_fwd, tap_bwd)
    return tap(value)


def copy_to_model_axis(layer: nnx.Module, x: Any, axis: str) -> Any:
    """``x`` typed varying over ``axis`` (Megatron's *f*): no communication forward, the
    gradient ``psum``-ed over ``axis`` backward. ``x`` itself if it already varies there.

    ``substrax._metrics.collectives.to_varying`` does the cast; this declares the backward
    all-reduce it brings (for the census) and runs it under the layers' named scope."""
    if axis in (varying_axes(x) or ()):
        return x
    x = declare_backward(layer, "all-reduce", axis, x, "the input's gradient, summed")
    with jax.named_scope(scopes.TENSOR_PARALLEL):
        return to_varying(x, axis)
