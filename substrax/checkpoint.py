"""Checkpoints of a model and its optimizer in any layout, written and read by orbax.

A checkpoint holds every array of ``nnx.state(model)`` and ``nnx.state(optimizer)``
(parameters, optimizer state, batch statistics, random-stream keys), each written by the
processes that hold its shards. ``restore`` reads it back into the model and optimizer
**in the layout they have now** (replicated, ZeRO-1 or FSDP, on this mesh or on one
device), whatever layout the checkpoint was saved from: each array is read straight into
the sharding of the array it replaces.

Orbax writes a step into a temporary directory and renames it when every process has
finished, so a save cut short (a killed process, a lost machine) leaves the earlier
checkpoints as they were, and the half-written one is never read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from substrax._train_step import BoundTrainStep
from substrax._tree import path_str

__all__ = ["CheckpointManager", "restore", "save"]

Key = tuple[str, ...]
_ROOTS = ("model", "optimizer")


class _Slot:
    """One variable of the state: where it lives, and its array as orbax reads and writes it."""

    def __init__(self, root: str, path: tuple[Any, ...], variable: nnx.Variable[Any]) -> None:
        self.key: Key = (root, *map(str, path))
        self.name = path_str(path, root)  # as the user reads it: model['hidden']['kernel']
        self.variable = variable
        self.value = variable.get_raw_value()

    @property
    def is_key(self) -> bool:
        """Whether the value is a typed PRNG key array (stored as its raw ``uint32`` data)."""
        return isinstance(self.value, jax.Array) and jnp.issubdtype(self.value.dtype, jax.dtypes.prng_key)

    def saved(self) -> jax.Array:
        """The array to write."""
        value = self.value
        if isinstance(value, jax.Array) and value.is_deleted():
            raise ValueError(
                f"{self.name} has been deleted (donated to a step): a model bound by "
                f"make_train_step(...).bind holds no state until the bound step's sync(); call "
                f"fast.sync() first, or pass the bound step to save in place of the model and optimizer."
            )
        return jax.random.key_data(value) if self.is_key else jnp.asarray(value)

    def target(self) -> jax.ShapeDtypeStruct:
        """What to read: the shape, dtype and sharding of the array held now."""
        if isinstance(self.value, jax.Array) and self.value.is_deleted():
            raise ValueError(
                f"{self.name} has been deleted (donated to a step): its model is bound by "
                f"make_train_step(...).bind, whose step would not see restored values. Restore "
                f"before binding, or bind again after restoring."
            )
        value = jax.random.key_data(self.value) if self.is_key else jnp.asarray(self.value)
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)

    def fill(self, array: jax.Array) -> None:
        """Put the restored ``array`` in the variable, with the current value's key type.

        A value not committed to a device (an unplaced model's: jit may move it to the
        step's mesh) is replaced by one that is not committed either.
        """
        if not getattr(self.value, "committed", False):
            array = jax.device_put(np.asarray(array))
        if self.is_key:
            array = jax.random.wrap_key_data(array, impl=jax.random.key_impl(self.value))
        self.variable.set_raw_value(array)


def _slots(model: nnx.Module, optimizer: nnx.Optimizer) -> list[_Slot]:
    """Every variable of ``model`` and ``optimizer``, keyed ``("model", *path)`` or ``("optimizer", *path)``.

    Path entries are strings (an optax state's tuple index ``0`` becomes ``"0"``), so the
    keys are those of the nested dict orbax writes.
    """
    out = []
    for root, obj in zip(_ROOTS, (model, optimizer), strict=True):
        for path, variable in nnx.to_flat_state(nnx.state(obj)):
            out.append(_Slot(root, tuple(path), variable))
    return out


def _nest(flat: Mapping[Key, Any]) -> dict[str, Any]:
    """A nested dict of string keys from a flat mapping of key tuples."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return tree


def _flatten(tree: Any, prefix: Key = ()) -> Iterator[tuple[Key, Any]]:
    """The leaves of a nested mapping with their key tuples, in insertion order."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _flatten(v, (*prefix, str(k)))
    else:
        yield prefix, tree


def _check_args(model: Any, optimizer: Any) -> None:
    """Refuse a bound step given with an optimizer, or a model without one."""
    if isinstance(model, BoundTrainStep) and optimizer is not None:
        raise TypeError("pass a bound step alone, in place of the model and optimizer.")
    if not isinstance(model, BoundTrainStep) and optimizer is None:
        raise TypeError("save needs the optimizer too (or a bound step in place of both).")


def _unpack(model: Any, optimizer: Any) -> tuple[nnx.Module, nnx.Optimizer]:
    """``(model, optimizer)``, from a bound step (synced first) or as given."""
    if isinstance(model, BoundTrainStep):
        model.sync()
        return model.model, model.optimizer
    return model, optimizer


def _directory(directory: str | os.PathLike[str]) -> str:
    """``directory`` as orbax wants it: an absolute local path, or a URL as given."""
    text = os.fspath(directory)
    return text if "://" in text else os.path.abspath(text)


def _check_tree(step: int, slots: list[_Slot], saved: dict[Key, Any], directory: str) -> None:
    """Refuse a checkpoint whose arrays do not match the state's, naming the first difference."""
    where = f"the checkpoint at step {step} in {directory}"
    have = {slot.key: slot for slot in slots}
    for slot in slots:
        if slot.key not in saved:
            raise ValueError(f"{slot.name} is in the model or optimizer but not in {where}.")
    for key in saved:
        if key not in have:
            raise ValueError(
                f"{path_str(key[1:], key[0])} is in {where} but not in the model or optimizer "
                f"(a parameter the model lacks, or an optimizer of another kind)."
            )
    for slot in slots:
        want, got = tuple(slot.target().shape), tuple(getattr(saved[slot.key], "shape", ()))
        if want != got:
            raise ValueError(
                f"{slot.name} has shape {want}, but {where} holds it with shape {got}; a model "
                f"of another size, or a checkpoint of another model."
            )


class CheckpointManager:
    """The checkpoints of one training run in ``directory``: keep the last few, save every n steps.

    A thin layer over ``orbax.checkpoint.CheckpointManager`` (``self.orbax``), which
    does the work: sharded writes (each process writes only the shards it holds),
    asynchronous saves, atomic commits, and deleting old steps. Every process calls
    every method, in the same order.

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
    ) -> None:
        """Open (or create) ``directory``.

        Args:
          directory: Where the steps are kept, one subdirectory each; a local path, or a
            URL orbax understands (``gs://...``).
          max_to_keep: How many of the latest steps to keep; ``None`` keeps all.
          save_interval_steps: ``save`` writes a step that is a multiple of this, the
            first step it is given when ``directory`` holds none, and the step after a
            preemption notice jax received (SIGTERM on a multi-process run); it skips
            the others unless forced.
          async_save: Whether ``save`` returns once the arrays are copied off the
            devices, writing them in the background (``wait`` blocks until written).
            The state may be stepped (its arrays donated) as soon as ``save`` returns.
        """
        self.directory = _directory(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.orbax = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )

    def all_steps(self) -> list[int]:
        """The steps saved and committed, oldest first."""
        return sorted(self.orbax.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        return self.orbax.latest_step()

    def save(
        self,
        step: int,
        model: nnx.Module | BoundTrainStep,
        optimizer: nnx.Optimizer | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Save the state of ``model`` and ``optimizer`` as ``step``, if the interval says so.

        Args:
          step: The training step the state is at (usually the number of steps taken).
          model: The model, or a ``BoundTrainStep`` in place of both (it is synced first).
          optimizer: Its optimizer; omitted with a bound step.
          force: Save even a step the interval would skip.

        Returns:
          Whether a save was started (a bound step is synced only then).

        Raises:
          TypeError: If a bound step comes with an optimizer, or a model without one.
          ValueError: If a variable's array has been deleted (the model of a bound step
            that was not synced), naming it.
        """
        _check_args(model, optimizer)
        if not force and not self.orbax.should_save(step):
            return False
        model, optimizer = _unpack(model, optimizer)
        tree = _nest({slot.key: slot.saved() for slot in _slots(model, optimizer)})
        return bool(self.orbax.save(step, args=ocp.args.StandardSave(tree), force=force))

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None) -> int:
        """Fill ``model`` and ``optimizer`` from a saved step, in the layout they have now.

        Each array is read into the sharding (and dtype) of the array it replaces, so a
        checkpoint saved from one layout (replicated, ZeRO-1, FSDP; any number of
        processes) is restored into another; each process reads only the slices its
        devices hold. A model never placed (its arrays not committed to a device) gets
        uncommitted arrays back, which a step moves to its mesh. Restore before
        ``make_train_step(...).bind``: a bound step keeps its own arrays. Waits for a save
        in progress first.

        Args:
          model: The model to fill, built as the saved one was (the values are replaced).
          optimizer: Its optimizer, of the same kind as the saved one.
          step: Which step; ``None`` for the latest.

        Returns:
          The step restored.

        Raises:
          ValueError: If there is no checkpoint (or no such step), or the checkpoint's
            arrays do not match the state's: a variable missing from either, or of
            another shape; each message names the variable.
        """
        self.wait()
        step = self._step(step)
        slots = _slots(model, optimizer)
        metadata = self.orbax.item_metadata(step)
        saved = dict(_flatten(getattr(metadata, "tree", metadata)))
        _check_tree(step, slots, saved, self.directory)
        targets = _nest({slot.key: slot.target() for slot in slots})
        restored = dict(_flatten(self.orbax.restore(step, args=ocp.args.StandardRestore(targets))))
        for slot in slots:
            slot.fill(restored[slot.key])
        return step

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise ValueError(f"no checkpoint in {self.directory}: it holds no committed step.")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise ValueError(f"no checkpoint of step {step} in {self.directory}; it holds steps {steps}.")
        return step

    def wait(self) -> None:
        """Block until every save started has been written and committed."""
        self.orbax.wait_until_finished()

    def close(self) -> None:
        """Wait for saves in progress, then release orbax's threads."""
        self.orbax.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def save(
    directory: str | os.PathLike[str],
    step: int,
    model: nnx.Module | BoundTrainStep,
    optimizer: nnx.Optimizer | None = None,
) -> None:
    """Save ``model`` and ``optimizer`` as ``step`` in ``directory``, and wait until it is committed.

    Every process calls it; each writes the shards it holds. Earlier steps in
    ``directory`` are kept. For a training loop, ``CheckpointManager`` saves in the
    background and deletes old steps.

    Args:
      directory: Where the steps are kept, one subdirectory each.
      step: The step to save as; must not be in ``directory`` yet.
      model: The model, or a ``BoundTrainStep`` in place of both (it is synced first).
      optimizer: Its optimizer; omitted with a bound step.

    Raises:
      TypeError: If a bound step comes with an optimizer, or a model without one.
      ValueError: If ``step`` is already saved in ``directory``, or a variable's array
        has been deleted (a bound step's model, not synced), naming it.
    """
    with CheckpointManager(directory, max_to_keep=None, async_save=False) as manager:
        if step in manager.all_steps():
            raise ValueError(f"step {step} is already saved in {manager.directory}.")
        manager.save(step, model, optimizer, force=True)


def restore(
    directory: str | os.PathLike[str], model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None
) -> int:
    """Fill ``model`` and ``optimizer`` from ``directory``, in the layout they have now.

    See ``CheckpointManager.restore``: any saved layout restores into any current one.

    Args:
      directory: Where the steps are kept.
      model: The model to fill, built as the saved one was.
      optimizer: Its optimizer, of the same kind as the saved one.
      step: Which step; ``None`` for the latest.

    Returns:
      The step restored.

    Raises:
      ValueError: If ``directory`` holds no checkpoint (or not ``step``), or the
        checkpoint's arrays do not match the state's, naming the variable.
    """
    if "://" not in os.fspath(directory) and not os.path.isdir(directory):
        raise ValueError(f"no checkpoint in {_directory(directory)}: no such directory.")
    with CheckpointManager(directory, max_to_keep=None, async_save=False) as manager:
        return manager.restore(model, optimizer, step)
