"""The ``CheckpointManager`` of a training run, and ``save`` and ``restore`` of one step."""

from __future__ import annotations

import os
import weakref
from types import TracebackType
from typing import Any, Self

import jax
import orbax.checkpoint as ocp
from flax import nnx

from substrax.checkpoint import _exit
from substrax.checkpoint._checksums import inspect_arrays
from substrax.checkpoint._errors import DamagedCheckpointError, NonFiniteStateError
from substrax.checkpoint._integrity import RECORD, checksum_record, read_step
from substrax.checkpoint._preemption import SIGTERM_EXIT, Sigterm
from substrax.checkpoint._state import BoundState, check_args, nest, slots_of, unpack
from substrax.checkpoint._upkeep import ManagerUpkeep

__all__ = ["CheckpointManager", "restore", "save"]


def _directory(directory: str | os.PathLike[str]) -> str:
    """``directory`` as orbax wants it: an absolute local path, or a URL as given."""
    text = os.fspath(directory)
    return text if "://" in text else os.path.abspath(text)


class CheckpointManager(ManagerUpkeep):
    """The checkpoints of one training run in ``directory``: keep the last few, save every n steps.

    A layer over ``orbax.checkpoint.CheckpointManager`` (``self.orbax``). Every process calls
    every method, in the same order. What it adds (a claim on the directory, no non-finite or
    repeated saves, checksums, save on SIGTERM, commit at exit): see the checkpoints guide,
    "Nothing saved is lost to a fault".

    Example::

        with CheckpointManager(directory, max_to_keep=3, save_interval_steps=100) as ckpt:
            start = ckpt.restore(model, optimizer) if ckpt.latest_step() is not None else 0
            with train_step.bind(model, optimizer) as fast:
                for step in range(start + 1, steps + 1):
                    loss = fast(next(batches))
                    ckpt.save(step, fast)   # syncs fast, then saves when step % 100 == 0
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        save_on_sigterm: bool = True,
        read_only: bool = False,
    ) -> None:
        """Open (or create) ``directory``, and claim it for this run unless ``read_only``.

        Args:
          directory: Where the steps are kept, one subdirectory each; a local path, or a
            URL orbax understands (``gs://...``; no claim is taken there).
          max_to_keep: How many of the latest steps to keep; ``None`` keeps all.
          save_interval_steps: ``save`` writes a multiple of this, the first step of an empty
            ``directory``, and the step after a SIGTERM; it skips the others unless forced.
          async_save: ``save`` returns once the arrays are off the devices (they may then be
            donated) and writes in the background; ``wait`` blocks until written.
          save_on_sigterm: After a SIGTERM, the next ``save`` saves its step, waits and raises
            ``SystemExit(143)`` (``close`` does, if no save comes). Main thread only; on
            several processes every ``save`` must be called at the same steps. See the
            checkpoints guide, "SIGTERM saves and exits".
          read_only: Open only to read: no claim, no SIGTERM handler; ``save`` refuses.

        Raises:
          DirectoryInUseError: If another run (or another manager of this process)
            holds ``directory``; the message names it (host, pid, since when).
        """
        self.directory = _directory(directory)
        self.read_only = read_only
        self._local = "://" not in self.directory
        self._primary = jax.process_index() == 0
        self._closed = False
        self._sweeper = None  # the thread deleting the trash
        self._hold(save_on_sigterm)  # the claim on the directory, and SIGTERM heard
        self._open_orbax(max_to_keep, save_interval_steps, async_save)
        self._kept = None  # the last state saved or restored: (step, its checksum record)
        self._repeated = None  # the step whose state later saves repeated (warned of)
        self._orphaned = weakref.finalize(self, _exit.orphan, self.orbax)
        self._orphaned.atexit = False
        _exit.register(self)
        self._sweep()  # a trash a killed run left

    def all_steps(self) -> list[int]:
        """The steps saved and committed, oldest first (a save still being written is not listed)."""
        steps = sorted(self.orbax.all_steps())
        if self._local:  # orbax lists a step as its save starts; it is committed once renamed
            return [s for s in steps if os.path.isdir(os.path.join(self.directory, str(s)))]
        return steps[:-1] if steps and self.orbax.is_saving_in_progress() else steps

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(
        self,
        step: int,
        model: nnx.Module | BoundState,
        optimizer: nnx.Optimizer | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Save the state of ``model`` and ``optimizer`` as ``step``, if the interval says so.

        A state that is not finite is refused; a state equal to the last one saved or restored
        is not saved again (one warning per run of them). See the checkpoints guide.

        Args:
          step: The training step the state is at (usually the number of steps taken).
          model: The model, or a ``BoundTrainStep`` in place of both (it is synced first).
          optimizer: Its optimizer; omitted with a bound step.
          force: Save even a step the interval would skip.

        Returns:
          Whether a save was started (a bound step is synced only then; ``False`` for
          a step the interval skips, or a state already saved).

        Raises:
          TypeError: If a bound step comes with an optimizer, or a model without one.
          ValueError: If a variable's array has been deleted (the model of a bound step
            that was not synced), naming it; or the manager is read-only.
          NonFiniteStateError: If an array holds a NaN or an infinity, naming the step,
            the first such arrays and the newest step kept; nothing is saved or deleted.
          SystemExit: With code 143 after a SIGTERM (``save_on_sigterm``), once this
            step is written.
        """
        check_args(model, optimizer)
        if self.read_only:
            raise ValueError(f"this manager of {self.directory} is read-only: it does not save.")
        notice = self._termination_notice(step)
        if not (force or notice) and not self.orbax.should_save(step):
            return False
        model, optimizer = unpack(model, optimizer)
        slots = slots_of(model, optimizer)
        arrays = [slot.saved() for slot in slots]
        finite, sums = inspect_arrays(arrays)
        if not finite.all():
            raise NonFiniteStateError(
                self._non_finite(step, [s.name for s, ok in zip(slots, finite) if not ok])
            )
        record = checksum_record(slots, arrays, sums)
        started, repeated = False, None
        if not (notice and step in self.orbax.all_steps()):
            self.orbax.wait_until_finished()  # as orbax's save would; then no deletion is under way
            self._sweep()
            repeated = self._repeats(step, record["arrays"])
            if repeated is None:
                started = bool(
                    self.orbax.save(
                        step,
                        args=ocp.args.StandardSave(nest({slot.key: x for slot, x in zip(slots, arrays)})),
                        force=force or notice,
                        custom_metadata={RECORD: record},
                    )
                )
            if started:
                self._kept, self._repeated = (step, record["arrays"]), None
        if notice:
            self._exit_on_notice(step, repeated)
        return started

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None) -> int:
        """Fill ``model`` and ``optimizer`` from a saved step, in the layout they have now.

        Any saved layout restores into any current one; every array is checked against its
        checksum. Restore before ``make_train_step(...).bind``. Waits for a save in progress.
        With ``step=None`` a damaged latest step is skipped (with a warning) for the newest
        whole one, and a manager that is not read-only moves it to ``.substrax-damaged/``.
        See the checkpoints guide.

        Args:
          model: The model to fill, built as the saved one was (the values are replaced).
          optimizer: Its optimizer, of the same kind as the saved one.
          step: Which step; ``None`` for the latest that is whole.

        Returns:
          The step restored.

        Raises:
          ValueError: If there is no checkpoint (or no such step), or a variable is missing
            from either side or of another shape, naming it.
          DamagedCheckpointError: If ``step`` (or, with ``step=None``, every step) is
            damaged, naming the step and the damage.
        """
        self.wait()
        slots = slots_of(model, optimizer)
        steps = self.all_steps()
        if not steps:
            raise ValueError(f"no checkpoint in {self.directory}: it holds no committed step.")
        if step is not None:
            if step not in steps:
                raise ValueError(f"no checkpoint of step {step} in {self.directory}; it holds steps {steps}.")
            arrays, record = read_step(self.orbax, self.directory, step, slots)
            self._fill(slots, arrays, step, record)
            return step
        damaged: list[DamagedCheckpointError] = []
        for candidate in reversed(steps):
            try:
                arrays, record = read_step(self.orbax, self.directory, candidate, slots)
            except DamagedCheckpointError as e:
                damaged.append(e)
                continue
            if damaged:
                self._skipped(candidate, damaged)
            self._fill(slots, arrays, candidate, record)
            return candidate
        if len(damaged) == 1:
            raise damaged[0]
        older = [e.step for e in damaged[1:]]
        raise DamagedCheckpointError(
            damaged[0].step, f"{damaged[0]} The older steps {older} are damaged too."
        ) from damaged[0]

    def _fill(self, slots: list[Any], arrays: list[jax.Array], step: int, record: Any) -> None:
        """Fill the slots from ``step``'s arrays; that state is then the one kept."""
        for slot, array in zip(slots, arrays, strict=True):
            slot.fill(array)
        self._kept, self._repeated = ((step, record) if record is not None else None), None

    def wait(self) -> None:
        """Block until every save started has been written and committed."""
        self.orbax.wait_until_finished()
        self._sweep()

    def close(self) -> None:
        """Wait for saves, delete the steps rotated out, release the claim and orbax's threads.

        Raises:
          SystemExit: With code 143 if a SIGTERM came while the manager was open (and no
            ``save`` ended the process first), once every save is written.
        """
        if self._closed:
            return
        self._closed = True
        _exit.unregister(self)
        self._orphaned.detach()
        try:
            self.orbax.close()
            self._sweep(block=True)
        finally:
            self._release()
        if self._listening and Sigterm.pending:
            raise SystemExit(SIGTERM_EXIT)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def save(
    directory: str | os.PathLike[str],
    step: int,
    model: nnx.Module | BoundState,
    optimizer: nnx.Optimizer | None = None,
) -> None:
    """Save ``model`` and ``optimizer`` as ``step`` in ``directory``, and wait until it is committed.

    Every process calls it. Earlier steps are kept; for a training loop use ``CheckpointManager``.

    Args:
      directory: Where the steps are kept, one subdirectory each.
      step: The step to save as; must not be in ``directory`` yet.
      model: The model, or a ``BoundTrainStep`` in place of both (it is synced first).
      optimizer: Its optimizer; omitted with a bound step.

    Raises:
      TypeError: If a bound step comes with an optimizer, or a model without one.
      ValueError: If ``step`` is already saved in ``directory``, or a variable's array
        has been deleted (a bound step's model, not synced), naming it.
      NonFiniteStateError: If an array holds a NaN or an infinity, naming it.
      DirectoryInUseError: If a run's ``CheckpointManager`` holds ``directory``.
    """
    with CheckpointManager(directory, max_to_keep=None, async_save=False, save_on_sigterm=False) as manager:
        if step in manager.all_steps():
            raise ValueError(f"step {step} is already saved in {manager.directory}.")
        manager.save(step, model, optimizer, force=True)


def restore(
    directory: str | os.PathLike[str], model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None
) -> int:
    """Fill ``model`` and ``optimizer`` from ``directory``, in the layout they have now.

    As ``CheckpointManager.restore``, but read-only: no claim (it reads a directory a run
    is writing), and damaged steps stay where they are.

    Args:
      directory: Where the steps are kept.
      model: The model to fill, built as the saved one was.
      optimizer: Its optimizer, of the same kind as the saved one.
      step: Which step; ``None`` for the latest that is whole.

    Returns:
      The step restored.

    Raises:
      ValueError: If ``directory`` holds no checkpoint (or not ``step``), or the
        checkpoint's arrays do not match the state's, naming the variable.
      DamagedCheckpointError: If ``step`` (with ``step=None``: every step) is damaged.
    """
    if "://" not in os.fspath(directory) and not os.path.isdir(directory):
        raise ValueError(f"no checkpoint in {_directory(directory)}: no such directory.")
    with CheckpointManager(directory, max_to_keep=None, async_save=False, read_only=True) as manager:
        return manager.restore(model, optimizer, step)
