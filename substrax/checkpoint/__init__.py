"""Checkpoints of a model and its optimizer in any layout, written and read by orbax.

``save``, ``restore`` and ``CheckpointManager``: see the checkpoints guide. A bound step is
anything with ``model``, ``optimizer`` and ``sync()`` (nothing of the training step is imported).
"""

from substrax.checkpoint._errors import DamagedCheckpointError, DirectoryInUseError, NonFiniteStateError
from substrax.checkpoint._manager import CheckpointManager, restore, save

__all__ = [
    "CheckpointManager",
    "DamagedCheckpointError",
    "DirectoryInUseError",
    "NonFiniteStateError",
    "restore",
    "save",
]
