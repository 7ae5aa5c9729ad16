"""Orbax's noise around a damaged step, kept off the console: the one line ``restore`` says is enough.

``orbax_logs`` holds orbax's log records during a read (passed on, or logged at DEBUG to
``substrax.checkpoint`` on damage); ``leftovers_dropped`` sends the late tracebacks of
abandoned reads there too, and asyncio's "exception was never retrieved" for their futures.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["LOG", "keep_dropping", "leftovers_dropped", "orbax_logs"]


LOG = logging.getLogger("substrax.checkpoint")  # orbax's details of a damaged step, at DEBUG
_ABSL = "absl"  # the logger orbax logs to


class _Held(logging.Filter):
    """Holds every record of the logger it filters, instead of letting it through."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


class Logs:
    """Orbax's records held during a read: passed on (``release``) or demoted to DEBUG (``demote``)."""

    def __init__(self, held: _Held) -> None:
        self._held = held

    def release(self, keep: Callable[[logging.LogRecord], bool] = lambda record: True) -> None:
        """Log the held records as orbax meant them; those ``keep`` refuses go to DEBUG."""
        logger = logging.getLogger(_ABSL)
        for record in self._held.records:
            if keep(record):
                logger.handle(record)
            else:
                LOG.debug("orbax: %s", record.getMessage())
        self._held.records.clear()

    def demote(self, what: str) -> None:
        """Log the held records at DEBUG, as details of ``what``."""
        for record in self._held.records:
            LOG.debug("orbax, %s: %s", what, record.getMessage())
        self._held.records.clear()


@contextlib.contextmanager
def orbax_logs() -> Iterator[Logs]:
    """Hold orbax's log records (of every thread) until the caller releases or demotes them.

    Records still held when the block ends (neither released nor demoted) are released.
    """
    held = _Held()
    logger = logging.getLogger(_ABSL)
    logger.addFilter(held)
    logs = Logs(held)
    try:
        yield logs
    finally:
        logger.removeFilter(held)
        logs.release()


def _is_leftover(unraisable: Any) -> bool:
    """Whether an unraisable exception is an abandoned read ending after its event loop closed."""
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine, closed when collected
    return _is_reader(getattr(code, "co_filename", ""))


_NEVER_RETRIEVED = ("Future exception was never retrieved", "Task exception was never retrieved")


class _AbandonedFutures(logging.Filter):
    """On the ``asyncio`` logger: an abandoned read's future, collected with its error unread
    (tensorstore's ``DATA_LOSS: ...``, or raised in orbax or tensorstore), goes to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not (isinstance(record.msg, str) and record.msg.startswith(_NEVER_RETRIEVED) and error):
            return True
        frames = traceback.extract_tb(error.__traceback__)
        if not (_STATUS.match(str(error)) or any(_is_reader(f.filename) for f in frames)):
            return True
        LOG.debug("a read abandoned at a damaged step ended late: %r", error, exc_info=record.exc_info)
        return False


_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")  # an absl status, as tensorstore's errors begin
_FUTURES = _AbandonedFutures()


def _is_reader(filename: str) -> bool:
    return "/orbax/" in filename or "/tensorstore/" in filename


class _Leftovers:
    """The ``sys.unraisablehook`` that logs abandoned reads' tracebacks at DEBUG and passes on the rest."""

    lock = threading.Lock()
    previous: Callable[[Any], None] = sys.__unraisablehook__
    readers = 0  # reads under way
    kept = False  # a read failed: its leftovers may end at any time, until the process exits

    @staticmethod
    def hook(unraisable: Any) -> None:
        if _is_leftover(unraisable):
            error = unraisable.exc_value
            LOG.debug(
                "a read abandoned at a damaged step ended late: %r",
                error,
                exc_info=(type(error), error, unraisable.exc_traceback),
            )
            return
        _Leftovers.previous(unraisable)


@contextlib.contextmanager
def leftovers_dropped() -> Iterator[None]:
    """While reading, log the tracebacks of reads orbax abandoned at DEBUG instead of printing them.

    Installs ``_Leftovers.hook`` as ``sys.unraisablehook`` (passing every other exception to
    the hook it replaces); after a read that failed (``keep_dropping``) it stays, since a
    failed read's leftovers end at any time after it.
    """
    with _Leftovers.lock:
        if sys.unraisablehook is not _Leftovers.hook:
            _Leftovers.previous = sys.unraisablehook
            sys.unraisablehook = _Leftovers.hook
            logging.getLogger("asyncio").addFilter(_FUTURES)
        _Leftovers.readers += 1
    try:
        yield
    finally:
        with _Leftovers.lock:
            _Leftovers.readers -= 1
            if not (_Leftovers.readers or _Leftovers.kept) and sys.unraisablehook is _Leftovers.hook:
                sys.unraisablehook = _Leftovers.previous
                logging.getLogger("asyncio").removeFilter(_FUTURES)


def keep_dropping() -> None:
    """Keep ``leftovers_dropped``'s hook for good: a read failed, and left reads to end later."""
    _Leftovers.kept = True
