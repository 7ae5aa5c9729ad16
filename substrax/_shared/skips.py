"""Runs of skipped steps, said out loud: a warning while steps are skipped, an error after too many.

``SkipWatch`` reads the guard's flags ``LAG`` at a time, each at least ``LAG`` steps old (so
reading never waits for a step still running), warns on the 1st, 2nd, 4th, 8th ... skip of
a run, and raises ``NonFiniteStepsError`` after ``limit`` in a row.
See the nonfinite guide.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import jax

__all__ = ["DEFAULT_MAX_SKIPS", "NonFiniteStepsError", "SkipWatch", "SkippedStepWarning"]

DEFAULT_MAX_SKIPS = 10
LAG = 8  # flags read together, in one transfer, every LAG calls, once LAG newer ones are queued


class SkippedStepWarning(RuntimeWarning):
    """A step's update was skipped: its loss or a gradient was NaN or infinite."""


class NonFiniteStepsError(RuntimeError):
    """Too many steps in a row were skipped for a non-finite loss or gradient."""


class SkipWatch:
    """Counts skipped steps from each step's ``applied`` flag; see the module docstring.

    Args:
      limit: Steps in a row to skip before raising, or ``None`` never to raise.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.total = 0
        self._pending: collections.deque[Any] = collections.deque()

    def push(self, applied: Any) -> None:
        """Take this step's flag (``None`` without the guard); judge the oldest ``LAG`` once
        ``2 * LAG`` are queued: steps long done, so the device is never drained."""
        if applied is not None:
            self._pending.append(applied)
        if len(self._pending) >= 2 * LAG:
            self._judge_oldest(LAG)

    def flush(self) -> None:
        """Judge every flag still pending (waiting for them), oldest first."""
        self._judge_oldest(len(self._pending))

    def _judge_oldest(self, count: int) -> None:
        flags = [self._pending.popleft() for _ in range(count)]
        for applied in jax.device_get(flags):
            self._judge(bool(applied))

    def _judge(self, applied: bool) -> None:
        if applied:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.limit is not None and self.in_a_row >= self.limit:
            self.in_a_row = 0  # a caller that catches the error and goes on starts a new count
            raise NonFiniteStepsError(
                f"{self.limit} steps in a row were skipped: each had a NaN or infinite loss or "
                f"gradient ({self.total} skipped in all), and left the model and optimizer as they "
                f"were. Look at the batches and the learning rate; "
                f"max_skips_in_a_row=None never stops the run."
            )
        if self.in_a_row & (self.in_a_row - 1) == 0:  # 1, 2, 4, 8, ...
            warnings.warn(
                f"substrax: a step was skipped, its loss or a gradient NaN or infinite "
                f"({self.in_a_row} in a row, {self.total} in all); the model and optimizer keep "
                f"their values.",
                SkippedStepWarning,
                stacklevel=4,
            )
