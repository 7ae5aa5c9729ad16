"""The step's ``jax.jit``: its lowerings compiled once per program (``substrax._shared.compiled``); on
a TPU the explicit step's compiled with its collectives pinned, and compiled again with the
reduce-scatter decomposer back on where the TPU compiler refuses one as written.

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

from substrax._shared.compiled import CachedLowered, CachedTraced, as_class
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
        f"The TPU compiler cannot emit a reduce-scatter of this step as written ({str(error).splitlines()[0]}); "
        f"the step is compiled with its reduce-scatter decomposer (substrax._shared.compiler."
        f"TPU_REFUSED_OPTIONS), which may run reduce-scatters as all-reduces of the whole buffer: "
        f"step.check_communication names each (census guide, 'On a TPU').",
        stacklevel=3,
    )


class PinnedLowered(CachedLowered):
    """A lowered step whose ``compile`` falls back to ``TPU_REFUSED_OPTIONS`` where refused (and is kept)."""

    __slots__ = ()

    def _compile(self, compiler_options: Any = None, **kwargs: Any) -> jax.stages.Compiled:
        try:
            return super()._compile(compiler_options, **kwargs)
        except jax.errors.JaxRuntimeError as error:
            if not refused(error):
                raise
            _warn(error)
            return super()._compile({**TPU_REFUSED_OPTIONS, **(compiler_options or {})}, **kwargs)


class PinnedTraced(CachedTraced):
    """A traced step whose ``lower`` gives a ``PinnedLowered``."""

    __slots__ = ()
    _LOWERED = PinnedLowered


class _StepJit:
    """``jax.jit(fun, compiler_options=options)`` whose lowerings compile once per program
    (``substrax._shared.compiled``); with ``TPU_COMPILER_OPTIONS``, made again with
    ``TPU_REFUSED_OPTIONS`` once refused."""

    def __init__(self, fun: Callable[..., Any], options: Mapping[str, Any] | None, **kwargs: Any) -> None:
        self._fun, self._kwargs = fun, kwargs
        self._pinned = options == TPU_COMPILER_OPTIONS
        self._jit = jax.jit(fun, compiler_options=options, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:  # a refused compile runs nothing: the donated arguments are still whole
            return self._jit(*args, **kwargs)
        except jax.errors.JaxRuntimeError as error:
            if not (self._pinned and refused(error)):
                raise
            _warn(error)
            self._jit = jax.jit(self._fun, compiler_options=TPU_REFUSED_OPTIONS, **self._kwargs)
            return self._jit(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> CachedLowered:
        return as_class(self._jit.lower(*args, **kwargs), PinnedLowered if self._pinned else CachedLowered)

    def trace(self, *args: Any, **kwargs: Any) -> CachedTraced:
        return as_class(self._jit.trace(*args, **kwargs), PinnedTraced if self._pinned else CachedTraced)

    def __getattr__(self, name: str) -> Any:  # _cache_size, ...
        return getattr(self._jit, name)


def pinned_jit(fun: Callable[..., Any], options: Mapping[str, Any] | None, **kwargs: Any) -> Any:
    """``jax.jit(fun, compiler_options=options, **kwargs)``, its lowerings compiled once per program;
    for the explicit step's TPU options (``TPU_COMPILER_OPTIONS``), compiled again with
    ``TPU_REFUSED_OPTIONS`` where refused."""
    return _StepJit(fun, options, **kwargs)
