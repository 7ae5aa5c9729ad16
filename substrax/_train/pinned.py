"""The explicit step's ``jax.jit`` on a TPU: compiled with its collectives pinned, and compiled again
with the reduce-scatter decomposer back on where the TPU compiler refuses one as written.

The step writes its own reduce-scatters in blocks the TPU emits (``substrax._shared.scatter``);
one written by the loss function (a ``psum_scatter`` of a small activation, a sequence-parallel
layer's) may be a block it cannot emit without decomposing it (``UNIMPLEMENTED``). Such a program
is compiled with ``substrax._shared.compiler.TPU_REFUSED_OPTIONS``, with a warning; the census then names
each reduce-scatter run as an all-reduce (census guide, "On a TPU").
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

from substrax._shared.compiler import TPU_COMPILER_OPTIONS, TPU_REFUSED_OPTIONS

__all__ = ["PinnedLowered", "PinnedTraced", "pinned_jit", "refused"]


def refused(error: BaseException) -> bool:
    """Whether ``error`` is the TPU compiler refusing a reduce-scatter it would have decomposed."""
    text = str(error)
    return (
        isinstance(error, jax.errors.JaxRuntimeError)
        and "UNIMPLEMENTED" in text
        and bool(re.search(r"reduce.?scatter", text, re.IGNORECASE))
    )


def _warn(error: BaseException) -> None:
    warnings.warn(
        f"The TPU compiler cannot emit a reduce-scatter of this step as written "
        f"({str(error).splitlines()[0]}); "
        f"the step is compiled with its reduce-scatter decomposer (substrax._shared.compiler."
        f"TPU_REFUSED_OPTIONS), which may run reduce-scatters as all-reduces of the whole buffer: "
        f"step.check_communication names each (census guide, 'On a TPU').",
        stacklevel=3,
    )


class PinnedLowered(jax.stages.Lowered):
    """A lowered step whose ``compile`` falls back to ``TPU_REFUSED_OPTIONS`` where refused."""

    __slots__ = ()

    def compile(self, compiler_options: Any = None, **kwargs: Any) -> jax.stages.Compiled:
        try:
            return super().compile(compiler_options, **kwargs)
        except jax.errors.JaxRuntimeError as error:
            if not refused(error):
                raise
            _warn(error)
            return super().compile({**TPU_REFUSED_OPTIONS, **(compiler_options or {})}, **kwargs)


class PinnedTraced(jax.stages.Traced):
    """A traced step whose ``lower`` gives a ``PinnedLowered``."""

    __slots__ = ()

    def lower(self, *args: Any, **kwargs: Any) -> PinnedLowered:
        return _pinned(super().lower(*args, **kwargs), PinnedLowered)


def _pinned(stage: Any, cls: type) -> Any:
    stage.__class__ = cls  # the same object, its next stage falling back (cls adds no state)
    return stage


class _PinnedJit:
    """``jax.jit(fun, compiler_options=TPU_COMPILER_OPTIONS)``, made again with ``TPU_REFUSED_OPTIONS``
    once refused."""

    def __init__(self, fun: Callable[..., Any], **kwargs: Any) -> None:
        self._fun, self._kwargs = fun, kwargs
        self._jit = jax.jit(fun, compiler_options=TPU_COMPILER_OPTIONS, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:  # a refused compile runs nothing: the donated arguments are still whole
            return self._jit(*args, **kwargs)
        except jax.errors.JaxRuntimeError as error:
            if not refused(error):
                raise
            _warn(error)
            self._jit = jax.jit(self._fun, compiler_options=TPU_REFUSED_OPTIONS, **self._kwargs)
            return self._jit(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> PinnedLowered:
        return _pinned(self._jit.lower(*args, **kwargs), PinnedLowered)

    def trace(self, *args: Any, **kwargs: Any) -> PinnedTraced:
        return _pinned(self._jit.trace(*args, **kwargs), PinnedTraced)

    def __getattr__(self, name: str) -> Any:  # _cache_size, ...
        return getattr(self._jit, name)


def pinned_jit(fun: Callable[..., Any], options: Mapping[str, Any] | None, **kwargs: Any) -> Any:
    """``jax.jit(fun, compiler_options=options, **kwargs)``; for the explicit step's TPU options
    (``TPU_COMPILER_OPTIONS``), one compiled again with ``TPU_REFUSED_OPTIONS`` where refused."""
    if options != TPU_COMPILER_OPTIONS:
        return jax.jit(fun, compiler_options=options, **kwargs)
    return _PinnedJit(fun, **kwargs)
