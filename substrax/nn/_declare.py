"""What a tensor-parallel layer communicates, declared by the layer where it writes it.

``declare_forward`` and ``declare_backward`` record nothing outside ``substrax._base.declared``'s
``recording()``, where ``TrainStep.check_communication`` traces the step; the census expects
exactly the declared collectives, per layer and phase. See the tensor-parallelism guide,
"A layer of your own".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from substrax._base import scopes
from substrax._base.declared import KINDS, Declared, looped, name_of, optional_why, recorder
from substrax._metrics.collectives import to_varying, varying_axes

__all__ = ["Declared", "copy_to_model_axis", "declare_backward", "declare_forward"]


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
    shape = tuple(like.shape if shape is None else shape)
    return Declared(layer, phase, kind, axis, shape, np.dtype(like.dtype), why, in_loop=looped())


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
    declared = _declared(name_of(layer), "forward", kind, axis, like, shape, why)  # checked even unrecorded
    record = recorder()
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
    declared = _declared(name_of(layer), "backward", kind, axis, value, shape, why)  # checked even unrecorded
    record = recorder()
    if record is None:
        return value

    @jax.custom_vjp
    def tap(x: Any) -> Any:
        return x

    def tap_fwd(x: Any) -> tuple[Any, None]:
        return x, None

    def tap_bwd(_: None, cotangent: Any) -> tuple[Any]:
        if recorder() is record:  # where its pullback runs: in a silenced trace it is not recorded
            record.append(dataclasses.replace(declared, dead_if=optional_why("backward"), in_loop=looped()))
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
