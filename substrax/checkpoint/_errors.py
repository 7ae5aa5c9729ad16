"""The errors of ``substrax.checkpoint``."""

from __future__ import annotations

__all__ = ["DamagedCheckpointError", "DirectoryInUseError", "NonFiniteStateError"]


class NonFiniteStateError(ValueError):
    """``save`` was given a state with a NaN or an infinity in a floating array; nothing was saved."""


class DamagedCheckpointError(ValueError):
    """A saved step does not read back as it was saved: a file is missing, cut short or altered.

    Attributes:
      step: The damaged step.
    """

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        return type(self), (self.step, str(self))


class DirectoryInUseError(RuntimeError):
    """The checkpoint directory is claimed by another run, or by another manager of this process."""
