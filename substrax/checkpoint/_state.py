"""The state a checkpoint holds: every variable of a model and its optimizer, as orbax writes and reads it.

A ``Slot`` is one variable (its key ``("model" | "optimizer", *path)``, its name, its
array); a bound step (``BoundState``) stands for both the model and the optimizer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from substrax._base.trees import adopt_assigned_arrays, path_str

__all__ = [
    "ROOTS",
    "BoundState",
    "Key",
    "Slot",
    "check_args",
    "check_tree",
    "flatten",
    "is_bound",
    "nest",
    "slots_of",
    "unpack",
]


Key = tuple[str, ...]
ROOTS = ("model", "optimizer")


class Slot:
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

    def target(self, dtype: Any = None) -> jax.ShapeDtypeStruct:
        """What to read: the shape and sharding of the array held now, in ``dtype`` or its own."""
        if isinstance(self.value, jax.Array) and self.value.is_deleted():
            raise ValueError(
                f"{self.name} has been deleted (donated to a step): its model is bound by "
                f"make_train_step(...).bind, whose step would not see restored values. Restore "
                f"before binding, or bind again after restoring."
            )
        value = jax.random.key_data(self.value) if self.is_key else jnp.asarray(self.value)
        return jax.ShapeDtypeStruct(value.shape, dtype or value.dtype, sharding=value.sharding)

    def fill(self, array: jax.Array) -> None:
        """Put the restored ``array`` in the variable, with the current value's dtype and key type.

        A value not committed to a device (an unplaced model's: jit may move it to the
        step's mesh) is replaced by one that is not committed either.
        """
        dtype = self.target().dtype
        if array.dtype != dtype:
            array = array.astype(dtype)
        if not getattr(self.value, "committed", False):
            array = jax.device_put(np.asarray(array))
        if self.is_key:
            array = jax.random.wrap_key_data(array, impl=jax.random.key_impl(self.value))
        self.variable.set_raw_value(array)


def slots_of(model: nnx.Module, optimizer: nnx.Optimizer) -> list[Slot]:
    """Every variable of ``model`` and ``optimizer``, keyed ``("model", *path)`` or ``("optimizer", *path)``.

    Path entries are strings (an optax state's tuple index ``0`` becomes ``"0"``), so the
    keys are those of the nested dict orbax writes. A variable with no array
    (``optax.MaskedNode``, as muon and ``multi_transform`` hold) has nothing to write; an
    array assigned where the optimizer held a variable is adopted as one first.
    """
    adopt_assigned_arrays(optimizer)
    out = []
    for root, obj in zip(ROOTS, (model, optimizer), strict=True):
        for path, variable in nnx.to_flat_state(nnx.state(obj)):
            if jax.tree.leaves(variable.get_raw_value()):
                out.append(Slot(root, tuple(path), variable))
    return out


def nest(flat: Mapping[Key, Any]) -> dict[str, Any]:
    """A nested dict of string keys from a flat mapping of key tuples."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return tree


def flatten(tree: Any, prefix: Key = ()) -> Iterator[tuple[Key, Any]]:
    """The leaves of a nested mapping with their key tuples, in insertion order."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from flatten(v, (*prefix, str(k)))
    else:
        yield prefix, tree


def check_tree(step: int, slots: list[Slot], saved: Mapping[Key, tuple[int, ...]], directory: str) -> None:
    """Refuse a checkpoint whose arrays (``saved``: their shapes) do not match the state's, naming the
    first."""
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
        want, got = tuple(slot.target().shape), tuple(saved[slot.key])
        if want != got:
            raise ValueError(
                f"{slot.name} has shape {want}, but {where} holds it with shape {got}; a model "
                f"of another size, or a checkpoint of another model."
            )


class BoundState(Protocol):
    """What ``save`` takes in place of a model and optimizer: a ``BoundTrainStep``, or any
    object that holds them as ``model`` and ``optimizer`` and writes its current state into
    them on ``sync()``."""

    model: nnx.Module
    optimizer: nnx.Optimizer

    def sync(self) -> None: ...


def is_bound(obj: Any) -> bool:
    """Whether ``obj`` stands for a model and its optimizer (``BoundState``), not a model."""
    return not isinstance(obj, nnx.Module) and all(
        hasattr(obj, name) for name in ("model", "optimizer", "sync")
    )


def check_args(model: Any, optimizer: Any) -> None:
    """Refuse a bound step given with an optimizer, or a model without one."""
    if is_bound(model) and optimizer is not None:
        raise TypeError("pass a bound step alone, in place of the model and optimizer.")
    if not is_bound(model) and optimizer is None:
        raise TypeError("save needs the optimizer too (or a bound step in place of both).")


def unpack(model: Any, optimizer: Any) -> tuple[nnx.Module, nnx.Optimizer]:
    """``(model, optimizer)``, from a bound step (synced first) or as given."""
    if is_bound(model):
        model.sync()
        return model.model, model.optimizer
    return model, optimizer
