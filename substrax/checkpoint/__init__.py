"""Checkpoints of a model and its optimizer in any layout, written and read by orbax.

A checkpoint holds every array of ``nnx.state(model)`` and ``nnx.state(optimizer)``
(parameters, optimizer state, batch statistics, random-stream keys), each written by the
processes that hold its shards. ``restore`` reads it back into the model and optimizer
**in the layout they have now** (replicated, ZeRO-1 or FSDP, on this mesh or on one
device), whatever layout the checkpoint was saved from: each array is read straight into
the sharding of the array it replaces.

Orbax writes a step into a temporary directory and renames it when every process has
finished, so a save cut short (a killed process, a lost machine) leaves the earlier
checkpoints as they were, and the half-written one is never read. Beyond that, nothing
saved is lost to a fault:

- ``save`` refuses a state with a NaN or an infinity in a floating array
  (``NonFiniteStateError``), so a diverged state never rotates the finite steps out; and
  a manager does not save again the state it last saved or restored (a run of skipped
  steps), so copies of one state never rotate the distinct steps out either.
- Each step records a checksum of every array's values (in its ``_CHECKPOINT_METADATA``),
  and ``restore`` checks them: a step with a file altered, cut short or missing is
  refused with one line naming the step and the damage (``DamagedCheckpointError``);
  asked for the latest step, ``restore`` falls back to the newest step that is whole,
  with a warning. Orbax's own noise about a damaged step goes to the logger
  ``substrax.checkpoint`` at DEBUG.
- A ``CheckpointManager`` claims its directory for its run (the file ``substrax.lock``)
  until ``close``; another run's manager is refused (``DirectoryInUseError``).
- A step that ``max_to_keep`` rotates out is renamed out of the listing before it is
  deleted, so a kill during the deletion never leaves a half-deleted step listed.
- After a SIGTERM (to any process of a run), the next ``save`` saves its step and ends
  the processes with code 143.
- A manager left open when the script ends is closed as the script's code ends, so its
  save in flight is committed (Python's exit would stop it halfway).

The package, one concept a module: ``_manager`` (``CheckpointManager``, ``save``,
``restore``); ``_state`` (the state's variables as orbax writes and reads them, and a
bound step taken for its model and optimizer); ``_checksums`` (finiteness and checksums);
``_integrity`` (a step's record of checksums, and the read that checks it); ``_quiet``
(orbax's noise about a damaged step, at DEBUG); ``_claim`` (the directory's lock file);
``_preemption`` (SIGTERM, JAX's preemption notice); ``_exit`` (saves in flight as the
script ends); ``_errors``. It imports nothing of the training step: a bound step is
anything with ``model``, ``optimizer`` and ``sync()``.
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
