"""One compile per program: a step's ``Lowered.compile()`` kept, keyed by what determines the program.

``substrax.plan``, ``step.lower(...).compile()`` and ``step.check_communication`` each lower the
same step for the same configuration; on a TPU topology each compile takes tens of seconds at
1B parameters. The compiled program is kept here and handed back to the next ``compile()`` of
the same program: the same HLO (its operations' names included), the same devices, compiler
options, argument and result trees and XLA flags. A compile that warned warns again on each
hit. The last ``SIZE`` programs are kept.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import warnings
from collections import OrderedDict
from typing import Any

import jax

__all__ = ["SIZE", "CachedLowered", "CachedTraced", "as_class", "cache_clear", "cached", "program_key"]

SIZE = 8
_lock = threading.Lock()
_programs: OrderedDict[tuple[Any, ...], tuple[jax.stages.Compiled, tuple[warnings.WarningMessage, ...]]] = (
    OrderedDict()
)
# what the printed HLO says of where each operation was written (the call stack differs between
# plan's trace and the step's own): dropped from the key; the operations' names are kept
_SOURCE = re.compile(
    r"\s(?:source_file|source_line|source_end_line|source_column|source_end_column|stack_frame_id)=(?:\"[^\"]*\"|\d+)"
)
_TABLES = re.compile(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", re.M)


def program_key(lowered: jax.stages.Lowered, compiler_options: Any = None) -> tuple[Any, ...]:
    """What determines the program ``lowered.compile(compiler_options)`` gives."""
    lowering = lowered._lowering  # noqa: SLF001  (its compiler options and devices: jax keeps them there)
    options = tuple(getattr(lowering, "_compiler_options_kvs", ())) + tuple((compiler_options or {}).items())
    devices = tuple(getattr(lowering, "_device_list", None) or ())
    flags = tuple(os.environ.get(k, "") for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"))
    digest = hashlib.sha256(_hlo_text(lowered).encode()).hexdigest()
    return digest, repr(options), devices, str(lowered.in_tree), str(lowered.out_tree), flags


def _hlo_text(lowered: jax.stages.Lowered) -> str:
    """The lowered HLO with each operation's name, without where in the Python it was written."""
    try:
        from jaxlib import _hlo  # the printer's options: jaxlib's, pinned with jax

        options = _hlo.HloPrintOptions()
        options.print_metadata = True
        text = lowered.compiler_ir("hlo").as_hlo_module().to_string(options)
    except (ImportError, AttributeError):  # another jaxlib: every location kept (fewer hits, none wrong)
        return lowered.as_text(debug_info=True)
    return _SOURCE.sub("", _TABLES.sub("", text + "\n"))


def cached(lowered: jax.stages.Lowered, compiler_options: Any, compile_: Any) -> jax.stages.Compiled:
    """``compile_()``, or the program it gave for the same ``program_key`` (its warnings again)."""
    key = program_key(lowered, compiler_options)
    with _lock:
        found = _programs.get(key)
        if found is not None:
            _programs.move_to_end(key)
    if found is not None:
        program, caught = found
        for w in caught:
            warnings.warn(w.message, w.category, stacklevel=4)
        return program
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = compile_()
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=4)
    with _lock:
        _programs[key] = (program, tuple(caught))
        while len(_programs) > SIZE:
            _programs.popitem(last=False)
    return program


def cache_clear() -> None:
    """Forget every kept program."""
    with _lock:
        _programs.clear()


class CachedLowered(jax.stages.Lowered):
    """A lowered step whose ``compile`` is kept (``cached``)."""

    __slots__ = ()

    def compile(self, compiler_options: Any = None, **kwargs: Any) -> jax.stages.Compiled:
        if kwargs:  # a device assignment of its own: compiled as asked, not kept
            return self._compile(compiler_options, **kwargs)
        return cached(self, compiler_options, lambda: self._compile(compiler_options))

    def _compile(self, compiler_options: Any = None, **kwargs: Any) -> jax.stages.Compiled:
        return jax.stages.Lowered.compile(self, compiler_options, **kwargs)


class CachedTraced(jax.stages.Traced):
    """A traced step whose ``lower`` gives a ``CachedLowered`` (the class ``_LOWERED`` names)."""

    __slots__ = ()
    _LOWERED: type = CachedLowered

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return as_class(super().lower(*args, **kwargs), self._LOWERED)


def as_class(stage: Any, cls: type) -> Any:
    """``stage`` itself, its class ``cls`` (a subclass that adds no state)."""
    stage.__class__ = cls
    return stage
