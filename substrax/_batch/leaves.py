"""A step's batch: its leaves checked as jax will read them, and one PartitionSpec each."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from substrax._base.specs import check_fits, check_spec_axes, spec_axes
from substrax._base.trees import KeyPath, PyTree, broadcast_prefix, path_str

__all__ = ["BatchSpec", "batch_partition_specs", "check_batch_leaves", "check_same_rows", "warn_float64"]

BatchSpec = PartitionSpec | NamedSharding | PyTree  # a batch's placement: one spec, or a prefix tree of them


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

    See the batches guide.

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


def batch_partition_specs(
    batch: PyTree, batch_spec: Any, mesh: Any, data_axis: str | tuple[str, ...]
) -> PyTree:
    """One PartitionSpec per leaf of ``batch``: how a step splits it over the mesh.

    Args:
      batch: The global batch (arrays or tracers).
      batch_spec: One PartitionSpec or NamedSharding, a pytree prefix of ``batch`` of them,
        or ``None``: ``PartitionSpec(data_axis)`` on every leaf with a dimension and
        ``PartitionSpec()`` on every 0-d leaf.
      mesh: The mesh.
      data_axis: The batch axis, or a tuple of them (rows over ``("replica", "data")``).

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


def _rows_over(shape: tuple[int, ...], spec: PartitionSpec, data_axis: str | tuple[str, ...]) -> int | None:
    """The leaf's rows: the size of the dimension ``spec`` splits over ``data_axis`` (None if none)."""
    wanted = set(spec_axes(data_axis))
    for dim, entry in enumerate(spec):
        if wanted & set(spec_axes(entry)) and dim < len(shape):
            return shape[dim]
    return None


def check_same_rows(
    path_leaves: Sequence[tuple[KeyPath, Any]], specs: Sequence[PartitionSpec], data_axis: str
) -> None:
    """Raise a ValueError, naming each leaf and its rows, unless the leaves split over ``data_axis`` agree.

    Args:
      path_leaves: ``(path, leaf)`` for every leaf of the batch.
      specs: The PartitionSpec of each leaf.
      data_axis: The batch axis.
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
