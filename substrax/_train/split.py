"""A model and optimizer split once into a graph and a list of arrays, kept valid between steps.

``SplitState`` is what ``TrainStep`` keeps between calls; see the modes guide, "The three
spellings of a step", for what re-splits, what is read anew and when arrays are donated.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from substrax import _layout
from substrax._base.trees import adopt_assigned_arrays

__all__ = ["SplitState"]


def _mapping_of(node: Any) -> Any:
    """What holds ``node``'s children: a module's ``__dict__``, a state's ``raw_mapping`` (its
    items are views made afresh; the mapping under them is not), a dict or a list itself."""
    if isinstance(node, nnx.Pytree):
        return vars(node)
    if isinstance(node, nnx.State):
        return node.raw_mapping
    return node


def _items(node: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``node``'s keys and values (a list's length and elements), read anew."""
    held = _mapping_of(node)
    if isinstance(held, list):
        return (len(held),), tuple(held)
    return tuple(held), tuple(held.values())


def _same(
    now: tuple[tuple[Any, ...], tuple[Any, ...]], saved: tuple[tuple[Any, ...], tuple[Any, ...]]
) -> bool:
    """The same keys, each holding the same object (a module's own ``_pytree__state`` aside)."""
    if now[0] != saved[0]:
        return False
    if all(map(operator.is_, now[1], saved[1])):
        return True
    return all(a is b or k == "_pytree__state" for k, a, b in zip(now[0], now[1], saved[1]))


def _is_mutable_node(node: Any) -> bool:
    return isinstance(node, (nnx.Pytree, dict, list, nnx.State))


_values = operator.methodcaller("values")


class _Flat:
    """Every node's length, keys and values in flat lists, each read in one C-level pass.

    The per-node check (``_items`` and ``_same``) costs Python calls per node (~1 us, and on
    a loaded machine several: 2% of a 20 ms step for a transformer's 81 nodes); this one
    costs a few list builds and an identity compare. Each node's mapping (``_mapping_of``)
    is saved once; a state's is checked to be the same object each time.
    """

    def __init__(self, nodes: list[Any]) -> None:
        self.states = [(n, n.raw_mapping) for n in nodes if isinstance(n, nnx.State)]
        held = list(map(_mapping_of, nodes))
        self.mappings = [m for m in held if not isinstance(m, list)]
        self.lists = [m for m in held if isinstance(m, list)]
        self.saved = self.read()

    def read(self) -> tuple[list[int], list[Any], list[Any]]:
        """Each node's length (a key moved to another node changes two), the keys, the values."""
        return (
            [*map(len, self.mappings), *map(len, self.lists)],
            list(itertools.chain.from_iterable(self.mappings)),
            [
                *itertools.chain.from_iterable(map(_values, self.mappings)),
                *itertools.chain.from_iterable(self.lists),
            ],
        )

    def same(self) -> bool:
        """Whether every node holds the keys and the very values it held when saved."""
        if not all(n.raw_mapping is m for n, m in self.states):
            return False
        lengths, keys, values = self.read()
        saved_lengths, saved_keys, saved_values = self.saved
        # equal lengths: as many values as saved; str keys compare by identity first
        return (
            lengths == saved_lengths and keys == saved_keys and all(map(operator.is_, values, saved_values))
        )


class SplitState:
    """``model`` and ``optimizer`` split into a graph and arrays, with the jitted pure step.

    Args:
      model: The model.
      optimizer: Its optimizer.
      make_jitted: ``(graphdef, treedef, donate) -> jitted pure step`` for this graph.
      donate: Whether ``jitted`` (the step a ``bind`` runs) donates the arrays.
    """

    def __init__(
        self, model: nnx.Module, optimizer: nnx.Optimizer, make_jitted: Any, donate: bool = False
    ) -> None:
        adopt_assigned_arrays(optimizer)
        graphdef, state = nnx.split((model, optimizer))
        is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        # a variable without array leaves (optax.MaskedNode) has nothing to step
        self.variables: list[nnx.Variable[Any]] = [
            v for v in jax.tree.leaves(state, is_leaf=is_variable) if jax.tree.leaves(v)
        ]
        self.treedef = jax.tree.structure(state)
        self.graph = (graphdef, self.treedef)
        self._refs = (weakref.ref(model), weakref.ref(optimizer))
        self._nodes = [n for _, n in nnx.iter_graph((model, optimizer)) if _is_mutable_node(n)]
        self._snapshot = [_items(n) for n in self._nodes]
        self._flat = _Flat(self._nodes)
        self._epochs = (_layout.epoch(model), _layout.epoch(optimizer))
        self._written: list[Any] = [v.get_raw_value() for v in self.variables]
        self._make_jitted = make_jitted
        self._jitted: dict[bool, Any] = {}  # by donation: hashing the graph per call costs a millisecond
        self._probe = _one_check_for_all(self.variables)
        self.jitted = self.jitted_for(donate)

    def jitted_for(self, donate: bool) -> Any:
        """The jitted pure step for this graph, donating its arrays or not."""
        if donate not in self._jitted:
            self._jitted[donate] = self._make_jitted(*self.graph, donate)
        return self._jitted[donate]

    def place_uncommitted(self, mesh: jax.sharding.Mesh | None) -> None:
        """Put each uncommitted value on ``mesh``, replicated, where the step's first call would leave
        it, and give each committed one the spec the step writes it with (no trailing ``None``s).

        The first call then compiles the program every later call runs, not one of its own.
        """
        if mesh is None or not mesh.axis_names:
            return
        values = list(map(_raw_reader(), self.variables))
        respec = [_trimmed(v) for v in values]
        if all(getattr(v, "committed", True) for v in values) and not any(respec):
            return
        held = [c > _base_count() for c in _counts(values)]
        placed = [
            _replicated(v, mesh) if not getattr(v, "committed", True)
            else _resharded(v, s, copy=h) if s is not None else v
            for v, s, h in zip(values, respec, held, strict=True)
        ]  # fmt: skip
        for variable, array in zip(self.variables, placed, strict=True):
            variable.set_raw_value(array)
        self._written = placed

    def valid_for(self, model: nnx.Module, optimizer: nnx.Optimizer) -> bool:
        """Whether ``model`` and ``optimizer`` still have the graph this split saw."""
        if (
            self._refs[0]() is not model
            or self._refs[1]() is not optimizer
            or self._epochs != (_layout.epoch(model), _layout.epoch(optimizer))
        ):
            return False
        if self._flat.same():  # the common case, in two passes; else each node, as a node may differ
            return True
        if all(_same(_items(n), saved) for n, saved in zip(self._nodes, self._snapshot)):
            self._flat = _Flat(self._nodes)  # only a module's own _pytree__state changed: save it anew
            return True
        return False

    def arrays(self) -> list[jax.Array]:
        """The variables' current values; a value set since the last write is cast and placed like it."""
        values = list(map(_raw_reader(), self.variables))
        if all(map(operator.is_, values, self._written)):  # nothing set since: one pass, no copies
            return values
        return [v if v is last else _like(v, last) for v, last in zip(values, self._written, strict=True)]

    def donatable(self, arrays: list[jax.Array]) -> list[jax.Array]:
        """``arrays`` (from ``arrays()``) to donate to a step, each held by someone else copied first.

        The holders counted are the variable, this split's last write, the list itself
        and, for a value set since, not the last write; one more is someone else's, whose
        array the step must not delete. The program is the same whoever holds what (on
        several processes, where a save in flight holds arrays on some, it must be).
        """
        base = _base_count()
        counts = _counts(arrays)
        return [
            a if c <= base - (a is not w) else _resharded(a, copy=True)
            for c, a, w in zip(counts, arrays, self._written, strict=True)
        ]

    def write(self, arrays: list[jax.Array]) -> None:
        """Set each variable's value to the step's result.

        ``set_raw_value`` checks each variable's trace twice (~10 us each, ~1 ms a call for
        a hundred variables); where every variable could be set when the split was made, one
        check of one variable now says the same of all (``_one_check_for_all``).
        """
        probe = self._probe
        if probe is None:
            for variable, array in zip(self.variables, arrays, strict=True):
                variable.set_raw_value(array)
        else:
            probe._check_can_update()  # raises, as set_raw_value would, from another trace
            for variable, array in zip(self.variables, arrays, strict=True):
                object.__setattr__(variable, "_raw_value", array)
        self._written = arrays


def _replicated(value: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
    """A copy of ``value`` on every device of ``mesh``: donated with the state, it deletes nobody's array.

    ``device_put`` to the mesh reuses the value's buffer for its device, ``may_alias=False`` or not
    (jax 0.12), so the value is first copied where it is.
    """
    copy = jax.device_put(value, next(iter(value.devices())), may_alias=False)
    return jax.device_put(copy, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def uncommitted_as_replicated(arrays: list[Any], mesh: jax.sharding.Mesh | None) -> list[Any]:
    """``arrays`` with each uncommitted one as its replicated shape on ``mesh``, to lower a step for."""
    if mesh is None or not mesh.axis_names:
        return arrays
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return [
        a
        if getattr(a, "committed", True)
        else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated, weak_type=a.weak_type)
        for a in arrays
    ]


def _one_check_for_all(variables: list[nnx.Variable[Any]]) -> nnx.Variable[Any] | None:
    """A variable whose trace check stands for every one's, or None to check each.

    A variable (not in ref mode) can be set in the trace it was made in. If every one can be
    set now, all were made in this trace; later, one that can be set shows the trace is the
    same, so all can. ``None`` where that does not hold, or where this flax keeps the value
    elsewhere than ``_raw_value``.
    """
    if not _raw_value_is_the_value():
        return None
    try:
        for variable in variables:
            variable._check_can_update()
    except Exception:  # noqa: BLE001  (a trace error: each write checks each variable)
        return None
    checked = [v for v in variables if not getattr(v, "ref", False)]
    return checked[0] if checked else None


@functools.cache
def _raw_reader() -> Any:
    """A reader of a variable's value: its ``_raw_value`` attribute where that is the value
    (flax 0.12; a method call per variable costs more than the step's other host work)."""
    if _raw_value_is_the_value():
        return operator.attrgetter("_raw_value")
    return operator.methodcaller("get_raw_value")


@functools.cache
def _raw_value_is_the_value() -> bool:
    """Whether setting ``_raw_value`` is what ``set_raw_value`` does (flax 0.12)."""
    variable = nnx.Param(np.zeros(()))
    value = np.ones(())
    try:
        variable._check_can_update()
        object.__setattr__(variable, "_raw_value", value)
    except Exception:  # noqa: BLE001
        return False
    return variable.get_raw_value() is value


def _counts(arrays: list[Any]) -> list[int]:
    """Each array's reference count, read the same way for the probe and for a split."""
    return [sys.getrefcount(a) for a in arrays]


@functools.cache
def _base_count() -> int:
    """The count of an array held only by its variable, a split's last write and one list."""
    variable = nnx.Param(np.zeros(()))
    written = [variable.get_raw_value()]
    arrays = [variable.get_raw_value()]
    assert written[0] is arrays[0]
    return _counts(arrays)[0]


def _trimmed(value: Any) -> jax.sharding.NamedSharding | None:
    """``value``'s sharding as jit writes a step's results (``_layout.trimmed``); None where that
    is the sharding it has."""
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or not sharding.spec:
        return None
    spec = _layout.trimmed(sharding.spec, sharding.mesh)
    if spec == sharding.spec:
        return None
    return jax.sharding.NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


def _resharded(array: Any, sharding: jax.sharding.Sharding | None = None, *, copy: bool) -> Any:
    """``array`` under ``sharding`` (an equal one; its own by default): its own buffers, or with
    ``copy`` copies made on each device from its own shard (no collective) for a step to donate."""
    if not isinstance(array, jax.Array):
        return array  # not a buffer the step could delete
    shards = [s.data for s in array.addressable_shards]
    if copy:
        shards = jax.device_put(shards, [s.device for s in array.addressable_shards], may_alias=False)
    return jax.make_array_from_single_device_arrays(array.shape, sharding or array.sharding, shards)


def _like(value: Any, last: jax.Array) -> Any:
    """``value`` with ``last``'s dtype, weak type and sharding where only those differ (no recompile)."""
    if not isinstance(last, jax.Array) or np.shape(value) != last.shape:
        return value  # a new shape is a new program
    if last.weak_type and last.ndim == 0:  # optax keeps a hyperparameter weak-typed; jit keys on it
        value = jnp.asarray(np.asarray(value).item())
    if not isinstance(value, jax.Array) or value.dtype != last.dtype:
        value = jnp.asarray(value, dtype=last.dtype)
    if value.sharding != last.sharding:
        value = jax.device_put(value, last.sharding)
    return value
