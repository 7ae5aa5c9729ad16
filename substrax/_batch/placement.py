"""Put a host batch on a mesh: one global array a leaf, each on its sharding."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from substrax._batch.axes import check_fits, check_spec_axes
from substrax._batch.leaves import batch_partition_specs, warn_float64
from substrax._tree import KeyPath, PyTree, broadcast_prefix, is_array, path_str

__all__ = [
    "batch_partition_specs",  # imported from here by the steps; it lives in _batch_specs
    "check_replicated_equal",
    "create_data_parallel_sharding",
    "place_batch_on_shards",
]


def create_data_parallel_sharding(mesh: Mesh, data_axis: str = "data", replica_axis: str = "replica") -> NamedSharding:
    """Create the sharding that splits a batch's leading axis over a mesh axis.

    Args:
      mesh: The device mesh to use for sharding.
      data_axis: The name of the mesh axis to use for data parallelism.
      replica_axis: On a mesh that also has this axis (hybrid sharding), the rows are
        split over it and ``data_axis`` together, replicas outer.

    Returns:
      A NamedSharding over ``mesh`` with spec ``PartitionSpec(data_axis)``, or
      ``PartitionSpec((replica_axis, data_axis))`` on a hybrid mesh.

    Raises:
      ValueError: If ``data_axis`` is not an axis of ``mesh``; names the mesh's axes.
    """
    check_spec_axes(PartitionSpec(data_axis), mesh, where="create_data_parallel_sharding")
    if replica_axis in mesh.axis_names and replica_axis != data_axis:
        return NamedSharding(mesh, PartitionSpec((replica_axis, data_axis)))
    return NamedSharding(mesh, PartitionSpec(data_axis))


def _fingerprint(leaf: Any) -> np.ndarray:
    """Two uint32s that differ, but for a 2**-64 chance, when a value's bytes, shape or dtype do."""
    value = np.require(leaf, requirements="C")
    digest = hashlib.blake2b(f"{value.dtype.str}{value.shape}".encode(), digest_size=8)
    digest.update(value.data)
    return np.frombuffer(digest.digest(), dtype=np.uint32)


def _host_leaves(
    batch: PyTree, sharding: Sharding | PyTree, refusal: str
) -> tuple[list[tuple[KeyPath, Any]], list[Sharding], Any]:
    """``(path, leaf)`` for every leaf of ``batch``, each leaf's sharding, and the tree's structure.

    Raises:
      ValueError: If the sharding tree does not fit the batch.
      TypeError: If a leaf is a traced value: ``refusal`` says what the caller does instead.
    """
    path_leaves, shardings, treedef = broadcast_prefix(
        sharding, batch, lambda s: isinstance(s, Sharding), what="sharding"
    )
    for path, leaf in path_leaves:
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(f"{path_str(path)} is a traced value: {refusal}")
    return path_leaves, shardings, treedef


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
        placed = jax.make_array_from_process_local_data([shardings[i] for i in todo], [out[i] for i in todo])
        for i, arr in zip(todo, placed, strict=True):
            out[i] = arr
    return jax.tree.unflatten(treedef, out)
