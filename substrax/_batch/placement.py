"""Put a host batch on a mesh: one global array a leaf, each on its sharding."""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from substrax._base.roles import axis_roles
from substrax._base.specs import check_fits, check_spec_axes, spec_axes
from substrax._base.trees import KeyPath, PyTree, broadcast_prefix, is_array, path_str
from substrax._batch.leaves import batch_partition_specs, warn_float64

__all__ = [
    "batch_partition_specs",  # imported from here by the steps; it lives in _batch_specs
    "check_replicated_equal",
    "create_data_parallel_sharding",
    "place_batch_on_shards",
    "place_process_rows",
    "row_axes",
]


def row_axes(mesh: Any, data_axis: str = "data", replica_axis: str = "replica") -> str | tuple[str, ...]:
    """The mesh axes a batch's rows are split over: ``data_axis``, after ``replica_axis`` where
    ``mesh`` has it (hybrid sharding: ``("replica", "data")``, replicas outer); an axis the mesh
    lacks left out (``AxisRoles.rows``). Raises ``axis_roles``'s errors."""
    return axis_roles(mesh, data_axis, replica_axis).rows


def create_data_parallel_sharding(
    mesh: Mesh, data_axis: str = "data", replica_axis: str = "replica"
) -> NamedSharding:
    """Create the sharding that splits a batch's leading axis over a mesh axis.

    Args:
      mesh: The device mesh to use for sharding.
      data_axis: The name of the mesh axis to use for data parallelism.
      replica_axis: On a mesh that also has this axis (hybrid sharding), the rows are
        split over ``(replica_axis, data_axis)``, replicas outer.

    Returns:
      ``NamedSharding(mesh, PartitionSpec(data_axis))`` (or the hybrid spec).

    Raises:
      ValueError: If ``data_axis`` is not an axis of ``mesh``; names the mesh's axes.
    """
    check_spec_axes(PartitionSpec(data_axis), mesh, where="create_data_parallel_sharding")
    return NamedSharding(mesh, PartitionSpec(row_axes(mesh, data_axis, replica_axis)))


def _fingerprint(leaf: Any) -> np.ndarray:
    """Two uint32s that differ, but for a 2**-64 chance, when a value's bytes, shape or dtype do."""
    value = np.require(leaf, requirements="C")
    digest = hashlib.blake2b(f"{value.dtype.str}{value.shape}".encode(), digest_size=8)
    digest.update(value.data)
    return np.frombuffer(digest.digest(), dtype=np.uint32)


def _host_leaves(
    batch: PyTree, sharding: Sharding | PyTree, refusal: str
) -> tuple[list[tuple[KeyPath, Any]], list[Sharding], Any]:
    """``(path, leaf)`` for every leaf of ``batch``, each leaf's sharding, and the tree's structure."""
    path_leaves, shardings, treedef = broadcast_prefix(
        sharding, batch, lambda s: isinstance(s, Sharding), what="sharding"
    )
    for path, leaf in path_leaves:
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(f"{path_str(path)} is a traced value: {refusal}")
    return path_leaves, shardings, treedef


def check_replicated_equal(batch: PyTree, sharding: Sharding | PyTree) -> None:
    """Check that every leaf bound for a replicated sharding is equal on every process.

    Hashes each such leaf and compares across processes in one ``process_allgather`` (see
    the processes guide). Every process must call it with the same tree; on a single
    process it returns at once.

    Args:
      batch: The batch this process loaded, as for ``place_batch_on_shards``.
      sharding: One sharding, or a pytree prefix of ``batch`` of shardings; a leaf is
        checked when its sharding is fully replicated (``PartitionSpec()``).

    Raises:
      ValueError: If a replicated leaf differs between processes (naming the leaf and the
        processes that differ from process 0), or the sharding tree does not fit the batch.
      TypeError: If a leaf is a traced value (the call is inside ``jax.jit``).
    """
    if jax.process_count() == 1:
        return
    path_leaves, shardings, _ = _host_leaves(
        batch, sharding, "check_replicated_equal checks host batches and must run outside jax.jit."
    )
    checked: list[KeyPath] = []
    prints: list[np.ndarray] = []
    for (path, leaf), s in zip(path_leaves, shardings, strict=True):
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

    Array leaves (``jax.Array``, NumPy arrays and scalars) are placed in one
    ``jax.make_array_from_process_local_data`` call, outside ``jax.jit``; other leaves are
    returned as they are. On several processes each passes its own rows, stitched in process
    order; where processes hold the same rows (an axis the rows are not split over, such as a
    pipeline's ``stage``, spans them) the rows are gathered first, so every process holds the
    whole batch (processes guide). A float64 leaf jax will cast is named in a ``UserWarning``.
    See the batches guide.

    Args:
      batch: The batch this process loaded.
      sharding: One sharding for every array leaf, or a pytree prefix of ``batch`` of
        shardings, each for its subtree (rows split, a batch-level field replicated).
      check_replicated: Whether to check (``check_replicated_equal``) that every leaf on a
        fully replicated sharding is equal on every process first.

    Returns:
      The batch with every array leaf replaced by the global array on its sharding.

    Raises:
      ValueError: If a leaf has fewer dimensions than its sharding splits, a split
        dimension does not divide by its mesh axes, or the sharding tree does not fit the
        batch (naming the path); with ``check_replicated``, if a replicated leaf differs
        between processes (naming it and the processes). Where rows are gathered: if a
        leaf's shape differs between processes, or it is split on several dimensions.
      TypeError: If a leaf is a traced value (the call is inside ``jax.jit``).
    """
    path_leaves, shardings, treedef = _host_leaves(
        batch,
        sharding,
        "place_batch_on_shards places host batches and must run outside jax.jit. Inside a "
        "jitted function use jax.lax.with_sharding_constraint.",
    )
    warn_float64(path_leaves)
    out = [leaf for _, leaf in path_leaves]
    todo: list[int] = []
    for i, ((path, leaf), s) in enumerate(zip(path_leaves, shardings, strict=True)):
        if not is_array(leaf):
            continue
        if isinstance(s, NamedSharding):
            check_fits(path, np.shape(leaf), s.spec, s.mesh, local=True)
        todo.append(i)
    if check_replicated:
        check_replicated_equal(batch, sharding)
    if todo:
        paths = [path_leaves[i][0] for i in todo]
        placed = _global_arrays(paths, [shardings[i] for i in todo], [out[i] for i in todo], checked=False)
        for i, arr in zip(todo, placed, strict=True):
            out[i] = arr
    return jax.tree.unflatten(treedef, out)


_DIMS = 8  # a shape as gathered: its rank, then 8 dimensions (any beyond folded into the last)


def _gathered_shapes(leaves: list[Any]) -> np.ndarray:
    """Every process's shape of each leaf, in one ``process_allgather``: ``(process, leaf, 1 + _DIMS)``."""
    rows = np.zeros((len(leaves), 1 + _DIMS), np.int32)
    for i, leaf in enumerate(leaves):
        shape = np.shape(leaf)
        dims = [*shape[: _DIMS - 1], math.prod(shape[_DIMS - 1 :])] if len(shape) >= _DIMS else shape
        rows[i, : 1 + len(dims)] = (len(shape), *dims)
    return np.asarray(multihost_utils.process_allgather(rows))


def _refuse_differing_shapes(path_leaves: list[tuple[KeyPath, Any]]) -> None:
    """Raise a ValueError naming each leaf whose shape differs between processes (one collective)."""
    every = _gathered_shapes([leaf for _, leaf in path_leaves])
    differ = [j for j in range(len(path_leaves)) if (every[:, j] != every[0, j]).any()]
    if differ:
        listing = "; ".join(
            f"{path_str(path_leaves[j][0])}: "
            + ", ".join(f"{_shape_text(every[p, j])} on process {p}" for p in range(every.shape[0]))
            for j in differ
        )
        raise ValueError(
            f"The batch's leaves differ in shape between processes ({listing}). On several "
            f"processes each passes the rows it loaded, and the step assembles them in process "
            f"order (as place_batch_on_shards does): every process must load the same number of "
            f"rows of each leaf, such as x[substrax.launch.process_slice(global_rows)], and the "
            f"same replicated values."
        )


@functools.lru_cache(maxsize=256)
def _sharers(sharding: NamedSharding) -> tuple[list[int], list[int] | None]:
    """The dimensions ``sharding`` splits, and two processes holding the same block of it (or None)."""
    ways = [math.prod(sharding.mesh.shape[a] for a in spec_axes(entry)) for entry in sharding.spec]
    split = [d for d, w in enumerate(ways) if w > 1]
    holders: dict[tuple[int, ...], set[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(ways)).items() if split else ():
        holders.setdefault(tuple(i.start or 0 for i in index), set()).add(device.process_index)
    return split, next((sorted(p)[:2] for p in holders.values() if len(p) > 1), None)


def _shared_dim(path: KeyPath, sharding: Sharding) -> int | None:
    """The dimension to assemble a leaf's rows along across processes, or None: each process's
    devices hold blocks of it no other process holds (or it is replicated), so its local data
    is its own block, as ``jax.make_array_from_process_local_data`` takes it.

    Where two processes hold the same block (an axis the leaf is not split over, such as
    ``stage``, spans the processes), the processes' rows are concatenated in process order
    along the one dimension the leaf is split on (processes guide).
    """
    if not isinstance(sharding, NamedSharding):
        return None
    split, shared = _sharers(sharding)
    if shared is None:
        return None
    if len(split) > 1:
        mesh = sharding.mesh
        hosts = np.vectorize(lambda d: d.process_index)(mesh.devices)
        used = {a for entry in sharding.spec for a in spec_axes(entry)}
        spanning = [
            a
            for k, a in enumerate(mesh.axis_names)
            if a not in used and (hosts != hosts.take([0], axis=k)).any()
        ]
        raise ValueError(
            f"{path_str(path)} is split over dimensions {split} ({sharding.spec}), and processes "
            f"{shared[0]} and {shared[1]} hold the same blocks of it: the mesh's "
            f"{', '.join(map(repr, spanning))} spans the processes and does not split it, so each "
            f"process's rows cannot be its own. Split it along one dimension (the processes' "
            f"rows are then concatenated in process order), or pass it as a global jax.Array."
        )
    return split[0]


def _global_arrays(
    paths: list[KeyPath], shardings: list[Sharding], leaves: list[Any], *, checked: bool
) -> list[jax.Array]:
    """Each leaf, this process's rows, as the global array on its sharding: the processes' rows
    in process order. ``checked``: the leaves' shapes are known to agree between processes."""
    if jax.process_count() == 1:
        return jax.make_array_from_process_local_data(shardings, leaves)
    dims = [_shared_dim(path, s) for path, s in zip(paths, shardings, strict=True)]
    out: list[Any] = [None] * len(leaves)
    own = [i for i, d in enumerate(dims) if d is None]
    if own:
        placed = jax.make_array_from_process_local_data([shardings[i] for i in own], [leaves[i] for i in own])
        for i, arr in zip(own, placed, strict=True):
            out[i] = arr
    shared = [i for i, d in enumerate(dims) if d is not None]
    if not shared:
        return out
    if not checked:
        _refuse_differing_shapes([(paths[i], leaves[i]) for i in shared])
    stacked = multihost_utils.process_allgather([np.asarray(leaves[i]) for i in shared])  # (process, ...)
    for i, every in zip(shared, stacked, strict=True):
        whole = np.concatenate(list(every), axis=dims[i])
        check_fits(paths[i], whole.shape, shardings[i].spec, shardings[i].mesh, local=False)
        out[i] = jax.make_array_from_callback(whole.shape, shardings[i], lambda index, w=whole: w[index])
    return out


def place_process_rows(batch: PyTree, batch_spec: Any, mesh: Mesh, rows: str | tuple[str, ...]) -> PyTree:
    """On several processes, a step's batch with each host leaf placed as ``place_batch_on_shards`` does.

    A host leaf (a NumPy array or scalar, a ``jax.Array`` on this process's devices) holds this
    process's rows, assembled in process order on its spec (gathered where processes hold the
    same rows, as ``place_batch_on_shards`` does); a global ``jax.Array`` is kept as
    it is. Every process must call it with the same tree (one ``process_allgather`` of the
    host leaves' shapes). On one process it returns ``batch``.

    Args:
      batch: The batch this process passed to the step.
      batch_spec: The step's ``batch_spec`` (a prefix tree of ``PartitionSpec`` or
        ``NamedSharding``), or ``None``: rows split over ``rows``, a 0-d leaf replicated.
      mesh: The step's mesh.
      rows: The mesh axes the rows are split over by default.

    Raises:
      ValueError: If a host leaf's shape differs between processes (naming the leaf and each
        process's shape), or it cannot be split as its spec says (naming the leaf), or processes
        hold the same blocks of a leaf split on several dimensions.
    """
    if jax.process_count() == 1:
        return batch
    default = batch_spec is None
    path_leaves, prefix, treedef = broadcast_prefix(
        PartitionSpec(rows) if default else batch_spec,
        batch,
        lambda s: isinstance(s, (PartitionSpec, NamedSharding)),
        what="batch_spec",
    )
    host = [
        i
        for i, (_, leaf) in enumerate(path_leaves)
        if is_array(leaf) and getattr(leaf, "is_fully_addressable", True)
    ]
    if not host:
        return batch
    _refuse_differing_shapes([path_leaves[i] for i in host])  # before any refusal: no process waits
    out = [leaf for _, leaf in path_leaves]
    shardings = []
    for i in host:
        path, leaf = path_leaves[i]
        spec = prefix[i].spec if isinstance(prefix[i], NamedSharding) else prefix[i]
        if default and np.ndim(leaf) == 0:
            spec = PartitionSpec()
        check_fits(path, np.shape(leaf), spec, mesh, local=True)
        shardings.append(NamedSharding(mesh, spec))
    paths = [path_leaves[i][0] for i in host]
    placed = _global_arrays(paths, shardings, [out[i] for i in host], checked=True)
    for i, arr in zip(host, placed, strict=True):
        out[i] = arr
    return jax.tree.unflatten(treedef, out)


def _shape_text(gathered: np.ndarray) -> str:
    """A gathered shape (``_gathered_shapes``' row) as a tuple."""
    rank = int(gathered[0])
    return str(tuple(int(d) for d in gathered[1 : 1 + min(rank, _DIMS)]))
