"""Put a Flax NNX state on a mesh: by its declared partitioning, one spec, filters, or a tree of shardings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from substrax._base.specs import check_fits, check_spec_axes
from substrax._base.trees import is_array, path_str
from substrax._layout._specs import trimmed

__all__ = ["FilterSharding", "place_nnx_state_on_shards"]


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
        return NamedSharding(mesh, trimmed(spec, mesh))
    if isinstance(spec, Sharding):
        return spec
    raise TypeError(
        f"place_nnx_state_on_shards: {where} is {spec!r} ({type(spec).__name__}), not a "
        f"PartitionSpec or a Sharding."
    )


def _declared_shardings(state: nnx.State, mesh: Mesh) -> list[Sharding]:
    declared = jax.tree.leaves(nnx.get_partition_spec(state), is_leaf=lambda x: isinstance(x, PartitionSpec))
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
      filter_sharding: ``None``: the variables' declared sharding metadata
        (``nnx.get_partition_spec``), others replicated. One ``PartitionSpec`` or
        ``Sharding``: every variable. A mapping or sequence of pairs (or an
        ``nnx.StateSharding``) from an NNX filter to a spec or sharding: the first match
        decides, others replicated. An ``nnx.State`` of shardings at ``state``'s paths
        (``nnx.get_named_sharding(state, mesh)``).

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
                    path,
                    np.shape(value),
                    s.spec,
                    mesh,
                    local=False,
                    root="state",
                    replicate_hint="give it a spec with no more dimensions than it has",
                )
            var = var.replace(jax.device_put(value, s))
        placed.append((path, var))
    return nnx.from_flat_state(placed)
