"""Saves still in flight when the script ends: finished while Python can still start threads.

Python 3.12 refuses new threads once it begins to exit, so managers left open are closed
as the ``__main__`` module's code returns or raises (``sys.monitoring``), else by
``threading``'s exit hook. See the checkpoints guide.
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import Any, Protocol

__all__ = ["ORPHANS", "finish", "orphan", "register", "unregister"]


class Closable(Protocol):
    def _close_at_exit(self, raised: bool) -> None: ...


_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()  # the managers not closed yet
ORPHANS: set[Any] = set()  # the orbax managers of managers collected unclosed
_TOOL_NAME = "substrax.checkpoint"
_watching: dict[str, Any] = {}  # the main module's code and the sys.monitoring tool watching it


def register(manager: Closable) -> None:
    """Note an open manager: its saves are finished when the script ends, if it is not closed."""
    _watch()
    _OPEN.add(manager)
    _unwinds(True)


def unregister(manager: Closable) -> None:
    _OPEN.discard(manager)
    _unwinds(bool(_OPEN or ORPHANS))


def _unwinds(on: bool) -> None:
    """Hear the main module's code raise only while a manager is open (the event is global)."""
    if "tool" in _watching:
        monitoring = sys.monitoring
        monitoring.set_events(_watching["tool"], monitoring.events.PY_UNWIND if on else 0)


def orphan(orbax: Any) -> None:
    """Keep the orbax manager of a manager collected unclosed, for its save to finish at the end."""
    for other in list(ORPHANS):
        if not other.is_saving_in_progress():
            ORPHANS.discard(other)
    ORPHANS.add(orbax)


def finish(raised: bool = False) -> None:
    """Close the managers left open, finishing their saves (``raised``: the script raised)."""
    for manager in list(_OPEN):
        manager._close_at_exit(raised)
    while ORPHANS:
        orbax = ORPHANS.pop()
        saving = orbax.is_saving_in_progress()
        try:
            orbax.close()
        except Exception as e:  # noqa: BLE001  (at exit: say it in one line, and go on)
            print(
                f"substrax.checkpoint: a save in {orbax.directory} (its CheckpointManager was "
                f"collected unclosed) failed as the script ended: {e}".splitlines()[0],
                file=sys.stderr,
                flush=True,
            )
            continue
        if saving:
            print(
                f"substrax.checkpoint: a CheckpointManager of {orbax.directory} was collected "
                f"unclosed while saving; its save was finished as the script ended. Close the "
                f"manager (or open it in a `with` block) to finish its saves where you choose.",
                file=sys.stderr,
                flush=True,
            )


def _main_code() -> Any:
    """The code object of the ``__main__`` module, if it is running in this thread's stack."""
    main = sys.modules.get("__main__")
    namespace = getattr(main, "__dict__", None)
    frame: FrameType | None = sys._getframe()
    code = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is namespace:
            code = frame.f_code
        frame = frame.f_back
    return code


def _watch() -> None:
    """Once: call ``finish`` when the main module's code returns or raises (in the main thread)."""
    if _watching:
        return
    _watching["done"] = True
    threading._register_atexit(finish)  # type: ignore[attr-defined]  (the fallback; see the docstring)
    monitoring = getattr(sys, "monitoring", None)
    code = _main_code() if threading.current_thread() is threading.main_thread() else None
    if monitoring is None or code is None:
        return
    tool = next((t for t in range(4, -1, -1) if monitoring.get_tool(t) is None), None)
    if tool is None:
        return
    main = threading.main_thread().ident
    events = monitoring.events

    def returned(c: Any, offset: int, value: object) -> Any:
        if c is not code:
            return monitoring.DISABLE
        if threading.get_ident() == main:
            finish()
        return None

    def unwound(c: Any, offset: int, error: BaseException) -> None:
        if c is code and threading.get_ident() == main:
            finish(raised=not isinstance(error, SystemExit) or error.code not in (None, 0))

    monitoring.use_tool_id(tool, _TOOL_NAME)
    monitoring.register_callback(tool, events.PY_RETURN, returned)
    monitoring.register_callback(tool, events.PY_UNWIND, unwound)
    monitoring.set_local_events(tool, code, events.PY_RETURN)
    _watching.update(tool=tool, code=code)
