"""Put a host batch and a model's state on a mesh."""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from substrax._tree import KeyPath, PyTree, broadcast_prefix, is_array, path_str

__all__ = [
    "batch_partition_specs",
    "check_batch_leaves",
    "check_replicated_equal",
    "create_data_parallel_sharding",
    "place_batch_on_shards",
    "place_nnx_state_on_shards",
    "warn_float64",
]


def create_data_parallel_sharding(mesh: Mesh, data_axis: str = "data") -> NamedSharding:
    """Create the sharding that splits a batch's leading axis over a mesh axis.

    Args:
      mesh: The device mesh to use for sharding.
      data_axis: The name of the mesh axis to use for data parallelism.

    Returns:
      A NamedSharding over ``mesh`` with spec ``PartitionSpec(data_axis)``.

    Raises:
      ValueError: If ``data_axis`` is not an axis of ``mesh``; names the mesh's axes.
    """
    check_spec_axes(PartitionSpec(data_axis), mesh, where="create_data_parallel_sharding")
    return NamedSharding(mesh, PartitionSpec(data_axis))


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axis names one PartitionSpec entry splits a dimension over."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def check_spec_axes(spec: PartitionSpec, mesh: Any, *, where: str) -> None:
    """Raise a ValueError naming any axis of ``spec`` that ``mesh`` lacks."""
    for entry in spec:
        for axis in spec_axes(entry):
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{where}: axis {axis!r} of {spec} is not in the mesh, whose axes are "
                    f"{tuple(mesh.axis_names)}. Use one of those axes, or build the mesh with "
                    f"{axis!r}."
                )


def check_fits(
    path: KeyPath,
    shape: tuple[int, ...],
    spec: PartitionSpec,
    mesh: Any,
    *,
    local: bool,
    root: str = "batch",
    replicate_hint: str = (
        "pass a pytree prefix of shardings with NamedSharding(mesh, PartitionSpec()) for it"
    ),
) -> None:
    """Raise a ValueError unless an array of ``shape`` can be split as ``spec`` says.

    Args:
      path: The leaf's key path, for the message.
      shape: The leaf's shape (this process's rows when ``local``).
      spec: The partition spec it goes on.
      mesh: The mesh (concrete for ``local``; abstract is fine otherwise).
      local: Whether ``shape`` is the process-local slice, split over the devices of
        this process only.
      root: What the tree is called in the message (``batch``, ``state``).
      replicate_hint: How the caller's user replicates a leaf instead, for the message.
    """
    partitioned = [i for i, entry in enumerate(spec) if spec_axes(entry)]
    if partitioned and len(shape) <= partitioned[-1]:
        raise ValueError(
            f"{path_str(path, root)} has shape {shape} ({len(shape)} dimensions), but {spec} "
            f"splits dimension {partitioned[-1]}. A value without that axis (a scalar, a "
            f"batch-level setting) must be replicated: {replicate_hint}."
        )
    sizes = mesh.local_mesh.shape if local else mesh.shape
    for dim in partitioned:
        axes = spec_axes(spec[dim])
        ways = math.prod(sizes[a] for a in axes)
        if shape[dim] % ways:
            axis_text = " x ".join(f"{a!r} ({mesh.shape[a]})" for a in axes)
            scope = " on this process" if local and jax.process_count() > 1 else ""
            what = " (the batch size: drop or pad the last rows)" if root == "batch" and dim == 0 else ""
            raise ValueError(
                f"{path_str(path, root)} has size {shape[dim]} along dimension {dim}{scope}, which "
                f"does not divide by {ways}, the size of mesh axis {axis_text} it is split "
                f"over. Make that size a multiple of {ways}{what}."
            )


def _is_python_number(x: Any) -> bool:
    """A Python or NumPy scalar, or what ``jax.jit`` makes of a Python number (a weakly typed 0-d value)."""
    if isinstance(x, (bool, int, float, complex, np.generic)):
        return True
    return isinstance(x, jax.Array) and np.ndim(x) == 0 and bool(getattr(x, "weak_type", False))


def _number_list(x: Any) -> bool:
    """A (nested) Python list whose leaves are all Python numbers: data jax would take as many scalars."""
    if not isinstance(x, list):
        return False
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(_is_python_number(leaf) for leaf in leaves)


def _cast_silently() -> bool:
    """Whether jax turns a float64 array into float32 (64-bit mode is off)."""
    return bool(jax.dtypes.canonicalize_dtype(np.float64) != np.dtype(np.float64))


def check_batch_leaves(batch: PyTree, root: str = "batch") -> None:
    """Refuse a Python list of numbers in ``batch``; warn on a float64 leaf jax will cast.

    A Python list is a pytree node to jax, not an array: ``{"x": [[1.0, 2.0], ...]}``
    is a tree of separate scalars, which no sharding can split into rows. A float64
    NumPy array becomes float32 without a word when jax's 64-bit mode is off. Inside
    ``jax.jit`` the cast has already happened and no warning is possible.

    Raises:
      TypeError: If a leaf of ``batch`` is a (nested) Python list of numbers; names its
        path and type, and says to convert it with ``np.asarray`` or ``jnp.asarray``.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(batch, is_leaf=_number_list)
    for path, leaf in flat:
        if _number_list(leaf):
            count = len(jax.tree.leaves(leaf))
            raise TypeError(
                f"{path_str(tuple(path), root)} is a Python list (of {count} numbers), which jax "
                f"takes as a tree of {count} separate scalars, not as one array whose rows can be "
                f"split over the devices. Convert it to an array first: np.asarray(...) (on the "
                f"host, before place_batch_on_shards) or jnp.asarray(...), with the dtype you "
                f"want, such as np.asarray(x, dtype=np.float32)."
            )
    warn_float64(flat, root, stacklevel=4)  # the caller of batch_partition_specs


def warn_float64(
    path_leaves: Sequence[tuple[KeyPath, Any]], root: str = "batch", stacklevel: int = 3
) -> None:
    """Warn, naming each, about the float64 NumPy leaves jax will cast to float32 (64-bit mode off).

    ``stacklevel`` counts from this function: 3 points at the caller of its caller.
    """
    if not _cast_silently():
        return
    for path, leaf in path_leaves:
        if isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype == np.float64:
            warnings.warn(
                f"{path_str(tuple(path), root)} is float64, but jax's 64-bit mode is off "
                f"(jax_enable_x64): it will be cast to float32 silently. Cast it yourself, "
                f"x.astype(np.float32), to silence this, or enable 64-bit mode.",
                UserWarning,
                stacklevel=stacklevel,
            )


def batch_partition_specs(batch: PyTree, batch_spec: Any, mesh: Any, data_axis: str) -> PyTree:
    """One PartitionSpec per leaf of ``batch``: how a step splits it over the mesh.

    Args:
      batch: The global batch (arrays or tracers).
      batch_spec: One PartitionSpec or NamedSharding for every leaf, a pytree prefix of
        ``batch`` of them (the convention of ``place_batch_on_shards``), or ``None``
        for ``PartitionSpec(data_axis)`` on every leaf with at least one dimension and
        ``PartitionSpec()`` (replicated) on every 0-d leaf, which has no rows to split
        (a batch-level scalar; inside ``jax.jit`` the step cannot see how it was placed).
      mesh: The mesh.
      data_axis: The batch axis.

    Returns:
      A tree of PartitionSpecs with the structure of ``batch``.

    Raises:
      ValueError: If the prefix does not fit, a spec names an axis the mesh lacks, the
        leaves split over ``data_axis`` differ in their number of rows (names each leaf
        and its count), or a leaf cannot be split as its spec says; names the leaf's path.
      TypeError: If a leaf is a Python list of numbers (``check_batch_leaves``); names
        the leaf's path.
    """
    check_batch_leaves(batch)
    default = batch_spec is None
    if default:
        batch_spec = PartitionSpec(data_axis)
    path_leaves, prefix_leaves, treedef = broadcast_prefix(
        batch_spec, batch, lambda s: isinstance(s, (PartitionSpec, NamedSharding)), what="batch_spec"
    )
    specs = [s.spec if isinstance(s, NamedSharding) else s for s in prefix_leaves]
    if default:  # a 0-d leaf can never be split: replicate it
        specs = [
            PartitionSpec() if np.ndim(leaf) == 0 else spec
            for (_, leaf), spec in zip(path_leaves, specs, strict=True)
        ]
    for spec in specs:
        check_spec_axes(spec, mesh, where="batch_spec")
    check_same_rows(path_leaves, specs, data_axis)
    hint = (
        f"give the step batch_spec=, a prefix tree of PartitionSpecs with PartitionSpec() "
        f"for it, such as {{'rows': PartitionSpec({data_axis!r}), 'lam': PartitionSpec()}}"
    )
    for (path, leaf), spec in zip(path_leaves, specs, strict=True):
        check_fits(path, np.shape(leaf), spec, mesh, local=False, replicate_hint=hint)
    return jax.tree.unflatten(treedef, specs)


def _rows_over(shape: tuple[int, ...], spec: PartitionSpec, data_axis: str) -> int | None:
    """The size of the dimension ``spec`` splits over ``data_axis``: the leaf's rows (None if none)."""
    for dim, entry in enumerate(spec):
        if data_axis in spec_axes(entry) and dim < len(shape):
            return shape[dim]
    return None


def check_same_rows(
    path_leaves: Sequence[tuple[KeyPath, Any]], specs: Sequence[PartitionSpec], data_axis: str
) -> None:
    """Raise a ValueError unless every leaf split over ``data_axis`` has the same number of rows.

    Leaves split over the data axis are the examples' fields: each device takes the same
    block of rows from each. A leaf with fewer rows (one label per device, say) would be
    split into fewer rows per device than the others and silently broadcast against them.

    Args:
      path_leaves: ``(path, leaf)`` for every leaf of the batch.
      specs: The PartitionSpec of each leaf.
      data_axis: The batch axis.

    Raises:
      ValueError: If two leaves split over ``data_axis`` differ in their number of rows;
        names every such leaf with its row count.
    """
    rows = [
        (path, n)
        for (path, leaf), spec in zip(path_leaves, specs, strict=True)
        if (n := _rows_over(np.shape(leaf), spec, data_axis)) is not None
    ]
    if len({n for _, n in rows}) > 1:
        listing = ", ".join(f"{path_str(path)} has {n}" for path, n in rows)
        raise ValueError(
            f"The batch's leaves split over {data_axis!r} do not have the same number of rows "
            f"({listing}); each device would take a different number of rows from each, and "
            f"they would be broadcast against each other. Give every per-example field one row "
            f"per example, and replicate a batch-level value with PartitionSpec() (batch_spec=, "
            f"or a prefix of place_batch_on_shards shardings)."
        )


def _named_spec(sharding: Sharding) -> tuple[PartitionSpec, Any] | None:
    return (sharding.spec, sharding.mesh) if isinstance(sharding, NamedSharding) else None


def _fingerprint(leaf: Any) -> np.ndarray:
    """Two uint32s that differ, but for a 2**-64 chance, when a value's bytes, shape or dtype do."""
    value = np.require(leaf, requirements="C")
    digest = hashlib.blake2b(f"{value.dtype.str}{value.shape}".encode(), digest_size=8)
    digest.update(value.data)
    return np.frombuffer(digest.digest(), dtype=np.uint32)


def check_replicated_equal(batch: PyTree, sharding: Sharding | PyTree) -> None:
    """Check that every leaf bound for a replicated sharding is equal on every process.

    ``place_batch_on_shards`` puts each process's own value of a replicated leaf on that
    process's devices, so processes that loaded different values (an unseeded random
    draw, a per-process counter) would silently hold different "replicated" arrays.
    This compares a hash of each such leaf's bytes, shape and dtype across processes,
    with one ``process_allgather`` for the whole batch. Every process must call it, with
    the same tree. On a single process it returns at once.

    Args:
      batch: The batch this process loaded, as for ``place_batch_on_shards``.
      sharding: One sharding, or a pytree prefix of ``batch`` of shardings; a leaf is
        checked when its sharding is fully replicated (``PartitionSpec()``).

    Raises:
      ValueError: If a replicated leaf differs between processes; the message names the
        leaf's path and the processes whose value differs from process 0's. Also if the
        sharding tree does not fit the batch.
      TypeError: If a leaf is a traced value (the call is inside ``jax.jit``).
    """
    if jax.process_count() == 1:
        return
    path_leaves, shardings, _ = broadcast_prefix(
        sharding, batch, lambda s: isinstance(s, Sharding), what="sharding"
    )
    checked: list[KeyPath] = []
    prints: list[np.ndarray] = []
    for (path, leaf), s in zip(path_leaves, shardings, strict=True):
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(
                f"{path_str(path)} is a traced value: check_replicated_equal checks host "
                f"batches and must run outside jax.jit."
            )
        if is_array(leaf) and s.is_fully_replicated:
            checked.append(path)
            prints.append(_fingerprint(leaf))
    if not checked:
        return
    every = np.asarray(multihost_utils.process_allgather(np.stack(prints)))  # (process, leaf, 2)
    for j, path in enumerate(checked):
        differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p, j], every[0, j])]
        if differ:
            which = ", ".join(map(str, differ))
            raise ValueError(
                f"{path_str(path)} is on a replicated sharding but is not equal on every "
                f"process: process(es) {which} hold a different value from process 0 (of "
                f"{every.shape[0]}). Load a replicated value identically on every process "
                f"(same seed, same source), or shard it along the batch axis."
            )


def place_batch_on_shards(
    batch: PyTree, sharding: Sharding | PyTree, *, check_replicated: bool = False
) -> PyTree:
    """Turn this process's batch into global arrays, each subtree on its sharding.

    Array leaves, whether ``jax.Array``, a NumPy array as a host data loader yields it,
    or a NumPy scalar, go to ``jax.make_array_from_process_local_data`` in one call. On a
    single process that is one batched ``jax.device_put``. On several processes each
    process passes the slice of the global batch it loaded, and jax stitches the slices
    into one global array in process order; a leaf on a replicated sharding must be
    equal on every process (``substrax.spmd.check_replicated_equal`` checks it). Any
    other leaf, such as a string, is returned as it is. Call it on the host batches a
    loader yields, outside ``jax.jit``. A float64 NumPy leaf that jax will cast to
    float32 (64-bit mode off) is named in a ``UserWarning``.

    Args:
      batch: The batch this process loaded.
      sharding: One sharding for every array leaf, or a pytree prefix of ``batch`` whose
        leaves are shardings, each applying to its subtree: rows sharded on the batch
        axis and a batch-level field without one replicated, for example.
      check_replicated: Whether to check, with ``check_replicated_equal``, that every
        leaf on a fully replicated sharding is equal on every process before placing
        it (one small cross-process gather; nothing on a single process).

    Returns:
      The batch with every array leaf replaced by the global array on its sharding.

    Raises:
      ValueError: If a leaf has fewer dimensions than its sharding partitions (a scalar
        under a sharding that splits the batch axis), if a split dimension does not
        divide by its mesh axes, or if the sharding tree does not fit the batch; the
        message names the leaf's path or the subtree; with ``check_replicated``, if a
        replicated leaf differs between processes, naming the leaf and the processes.
      TypeError: If a leaf is a traced value (the call is inside ``jax.jit``).
    """
    path_leaves, shardings, treedef = broadcast_prefix(
        sharding, batch, lambda s: isinstance(s, Sharding), what="sharding"
    )
    warn_float64(path_leaves)
    out = [leaf for _, leaf in path_leaves]
    todo: list[int] = []
    for i, ((path, leaf), s) in enumerate(zip(path_leaves, shardings, strict=True)):
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(
                f"{path_str(path)} is a traced value: place_batch_on_shards places host "
                f"batches and must run outside jax.jit. Inside a jitted function use "
                f"jax.lax.with_sharding_constraint."
            )
        if not is_array(leaf):
            continue
        named = _named_spec(s)
        if named is not None:
            check_fits(path, np.shape(leaf), named[0], named[1], local=True)
        todo.append(i)
    if check_replicated:
        check_replicated_equal(batch, sharding)
    if todo:
        placed = jax.make_array_from_process_local_data(
            [shardings[i] for i in todo], [out[i] for i in todo]
        )
        for i, arr in zip(todo, placed, strict=True):
            out[i] = arr
    return jax.tree.unflatten(treedef, out)


FilterSharding = (
    PartitionSpec
    | Sharding
    | Mapping[Any, PartitionSpec | Sharding]
    | Sequence[tuple[Any, PartitionSpec | Sharding]]
    | nnx.StateSharding
    | nnx.State
    | None
)


def _as_sharding(spec: Any, mesh: Mesh, where: str) -> Sharding:
    """``spec`` as a Sharding on ``mesh``; a TypeError names ``where`` it came from otherwise."""
    if isinstance(spec, PartitionSpec):
        check_spec_axes(spec, mesh, where="place_nnx_state_on_shards")
        return NamedSharding(mesh, spec)
    if isinstance(spec, Sharding):
        return spec
    raise TypeError(
        f"place_nnx_state_on_shards: {where} is {spec!r} ({type(spec).__name__}), not a "
        f"PartitionSpec or a Sharding."
    )


def _declared_shardings(state: nnx.State, mesh: Mesh) -> list[Sharding]:
    declared = jax.tree.leaves(
        nnx.get_partition_spec(state), is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    return [_as_sharding(spec, mesh, "a declared partition spec") for spec in declared]


def _tree_shardings(tree: nnx.State, flat: list[tuple[Any, Any]], mesh: Mesh) -> list[Sharding]:
    """One sharding per variable of ``flat``, read at its path in ``tree`` (a State of shardings)."""
    by_path = {
        tuple(path): leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        for path, leaf in nnx.to_flat_state(tree)
    }
    missing = [path_str(tuple(path), "state") for path, _ in flat if tuple(path) not in by_path]
    if missing:
        raise ValueError(
            f"The sharding tree has no sharding for {', '.join(missing)}. Build it from the same "
            f"state (nnx.get_named_sharding(state, mesh)), or pass a mapping from filters to specs."
        )
    return [_as_sharding(by_path[tuple(path)], mesh, path_str(tuple(path), "state")) for path, _ in flat]


def _filter_name(f: Any) -> str:
    return f"nnx.{f.__name__}" if isinstance(f, type) else repr(f)


def _filter_shardings(filter_sharding: Any, flat: list[tuple[Any, Any]], mesh: Mesh) -> list[Sharding]:
    """One sharding per variable of ``flat``: the first matching filter's, else replicated."""
    rules: list[tuple[Any, Any]]
    if isinstance(filter_sharding, (PartitionSpec, Sharding)):
        rules = [(..., filter_sharding)]
    elif isinstance(filter_sharding, nnx.StateSharding):
        rules = list(zip(filter_sharding.filters, filter_sharding.shardings, strict=True))
    elif isinstance(filter_sharding, Mapping):
        rules = list(filter_sharding.items())
    else:
        rules = list(filter_sharding)
    matchers = [
        (nnx.filterlib.to_predicate(f), _as_sharding(s, mesh, f"the sharding for filter {_filter_name(f)}"))
        for f, s in rules
    ]
    replicated = NamedSharding(mesh, PartitionSpec())
    return [next((s for match, s in matchers if match(path, var)), replicated) for path, var in flat]


def place_nnx_state_on_shards(state: nnx.State, mesh: Mesh, filter_sharding: FilterSharding) -> nnx.State:
    """Shard a Flax NNX state tree using current NNX sharding helpers.

    Args:
      state: An ``nnx.State`` (from ``nnx.state(model)`` or ``nnx.split``).
      mesh: The mesh to place it on.
      filter_sharding: Where each variable goes. ``None`` uses the sharding metadata
        the variables were declared with (``nnx.with_partitioning``), as
        ``nnx.get_partition_spec`` reads it; variables without any are replicated. One
        ``PartitionSpec`` or ``Sharding`` places every variable so. A mapping, or a
        sequence of pairs, from an NNX filter (``nnx.Param``,
        ``nnx.PathContains("kernel")``, ``...``) to a ``PartitionSpec`` or ``Sharding``,
        or an ``nnx.StateSharding`` of such pairs: the first filter that matches a
        variable decides, and unmatched variables are replicated. An ``nnx.State`` of
        shardings with ``state``'s paths, such as ``nnx.get_named_sharding(state, mesh)``
        returns: each variable goes on the sharding at its path.

    Returns:
      The state, same structure, with every variable's array placed by
      ``jax.device_put``.

    Raises:
      ValueError: If a spec names an axis the mesh lacks, a variable cannot be split
        as its spec says, or a tree of shardings lacks a variable's path; the message
        names the variable's path.
      TypeError: If ``state`` is a module rather than its state, or a sharding is
        neither a ``PartitionSpec`` nor a ``Sharding`` (names where it was found).
    """
    if isinstance(state, nnx.Module):
        raise TypeError(
            f"place_nnx_state_on_shards takes a state, not the module {type(state).__name__}: "
            f"pass nnx.state(model), and nnx.update(model, placed) to put the result back."
        )
    flat = list(nnx.to_flat_state(state))
    if filter_sharding is None:
        shardings = _declared_shardings(state, mesh)
    elif isinstance(filter_sharding, nnx.State):
        shardings = _tree_shardings(filter_sharding, flat, mesh)
    else:
        shardings = _filter_shardings(filter_sharding, flat, mesh)

    placed = []
    for (path, var), s in zip(flat, shardings, strict=True):
        value = var.get_value()
        if is_array(value):
            if isinstance(s, NamedSharding):
                check_fits(
                    path, np.shape(value), s.spec, mesh, local=False, root="state",
                    replicate_hint="give it a spec with no more dimensions than it has",
                )
            var = var.replace(jax.device_put(value, s))
        placed.append((path, var))
    return nnx.from_flat_state(placed)
