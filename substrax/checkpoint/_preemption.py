"""A run told to stop: SIGTERM, noted by one handler for every manager, or JAX's preemption service."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any

import jax

__all__ = ["SIGTERM_EXIT", "Sigterm", "jax_preemption_service"]


SIGTERM_EXIT = 128 + signal.SIGTERM  # 143: the exit status a SIGTERM would have given


class Sigterm:
    """One SIGTERM handler for every manager that listens: it only notes the signal."""

    pending = False
    listeners = 0
    previous: Any = signal.SIG_DFL

    @classmethod
    def listen(cls) -> bool:
        """Listen, if this is the main thread (the only one that may set handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if cls.listeners == 0:
            previous = signal.signal(signal.SIGTERM, _note_sigterm)
            if previous is not _note_sigterm:  # not left behind by a manager collected in another thread
                cls.previous = signal.SIG_DFL if previous is None else previous
        cls.listeners += 1
        return True

    @classmethod
    def stop(cls) -> None:
        cls.listeners -= 1
        if cls.listeners == 0 and signal.getsignal(signal.SIGTERM) is _note_sigterm:
            with contextlib.suppress(ValueError):  # not the main thread (a finalizer): leave it
                signal.signal(signal.SIGTERM, cls.previous)


def _note_sigterm(signum: int, frame: FrameType | None) -> None:
    if Sigterm.pending:  # the second: what SIGTERM did before, now
        signal.signal(signal.SIGTERM, Sigterm.previous)
        os.kill(os.getpid(), signal.SIGTERM)
    Sigterm.pending = True


def jax_preemption_service() -> bool:
    """Whether JAX's preemption service is on (it catches SIGTERM on a multi-process run)."""
    return bool(getattr(jax.config, "jax_enable_preemption_service", False))
