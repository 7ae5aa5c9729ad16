"""Sharding strategies: name an array's dimensions, get the ``PartitionSpec`` a parallelism gives it.

A planning layer (avitai/substrax's names); the steps do not read it. See the batches
guide, "Sharding strategies: a planning layer".

    >>> from substrax.mesh import DataParallelStrategy, TensorParallelStrategy
    >>> DataParallelStrategy().partition_spec(("batch", "sequence", "hidden"))
    P('data', None, None)
    >>> TensorParallelStrategy().partition_spec(("batch", "hidden"))
    P(None, 'model')
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from substrax._base.specs import spec_axes
from substrax.mesh._configs import ParallelismConfig, ShardingConfig, _name, _size
from substrax.mesh._dimensions import DimensionNames, checked_names, one_dimension, place, split_one

__all__ = [
    "DataParallelStrategy",
    "DimensionNames",
    "FSDPStrategy",
    "MultiDimensionalStrategy",
    "ParallelismConfig",
    "PipelineParallelStrategy",
    "ShardingConfig",
    "ShardingStrategy",
    "TensorParallelStrategy",
]


@runtime_checkable
class ShardingStrategy(Protocol):
    """What a strategy has: a mesh axis, a spec for named dimensions, and placement by it."""

    @property
    def axis_name(self) -> str:
        """The mesh axis the strategy splits over."""
        ...

    def partition_spec(self, dimension_names: DimensionNames) -> PartitionSpec:
        """The spec of an array whose dimensions have these logical names."""
        ...

    def shard(self, array: Any, mesh: Mesh) -> jax.Array:
        """The array placed on ``mesh`` as the strategy splits it."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class DataParallelStrategy:
    """Split the batch dimension over ``axis_name``; every other dimension stays whole.

    Attributes:
      axis_name: The mesh axis the batch is split over.
      batch_dimension: The logical name of the batch dimension.
    """

    axis_name: str = "data"
    batch_dimension: str = "batch"

    def __post_init__(self) -> None:
        _name(self.axis_name, "DataParallelStrategy.axis_name")
        _name(self.batch_dimension, "DataParallelStrategy.batch_dimension")

    def partition_spec(self, dimension_names: DimensionNames) -> PartitionSpec:
        """``axis_name`` on the dimension named ``batch_dimension``, ``None`` elsewhere.

        Raises:
          TypeError: If ``dimension_names`` is not a sequence of str.
          ValueError: If it names the batch dimension twice.
        """
        who = "DataParallelStrategy.partition_spec"
        names = checked_names(dimension_names, who)
        return one_dimension(names, self.batch_dimension, self.axis_name, who)

    def shard(self, array: Any, mesh: Mesh) -> jax.Array:
        """The array placed with its first dimension (the batch) split over ``axis_name``.

        Raises:
          TypeError: If ``mesh`` is not a ``jax.sharding.Mesh``.
          ValueError: If the array is 0-d, the mesh lacks ``axis_name``, or the first
            dimension does not divide by the axis size.
        """
        return split_one(array, mesh, self.axis_name, 0, "DataParallelStrategy.shard", "batch dimension")


@dataclass(frozen=True, slots=True, kw_only=True)
class FSDPStrategy:
    """Split a parameter's leading dimension over ``axis_name`` when it is large enough.

    Attributes:
      axis_name: The mesh axis parameters are split over (the data axis, in FSDP).
      min_weight_size: The smallest leading dimension that is split.
      sharded_dimensions: The logical names of leading dimensions ``partition_spec`` splits.
    """

    axis_name: str = "data"
    min_weight_size: int = 1024
    sharded_dimensions: frozenset[str] = frozenset({"out_features", "features", "hidden"})

    def __post_init__(self) -> None:
        _name(self.axis_name, "FSDPStrategy.axis_name")
        _size(self.min_weight_size, "FSDPStrategy.min_weight_size")
        dims = self.sharded_dimensions
        if isinstance(dims, str) or not isinstance(dims, Iterable):
            raise TypeError(f"FSDPStrategy.sharded_dimensions must be a set of str; got {dims!r}.")
        names = frozenset(dims)
        for name in names:
            _name(name, "FSDPStrategy.sharded_dimensions entries")
        object.__setattr__(self, "sharded_dimensions", names)

    def should_shard(self, weight: Any) -> bool:
        """Whether ``weight`` has a leading dimension of at least ``min_weight_size``."""
        shape = np.shape(weight)
        return bool(shape) and shape[0] >= self.min_weight_size

    def partition_spec(self, dimension_names: DimensionNames) -> PartitionSpec:
        """``axis_name`` on the first dimension if its name is in ``sharded_dimensions``.

        Raises:
          TypeError: If ``dimension_names`` is not a sequence of str.
        """
        names = checked_names(dimension_names, "FSDPStrategy.partition_spec")
        if not names:
            return PartitionSpec()
        first = self.axis_name if names[0] in self.sharded_dimensions else None
        return PartitionSpec(first, *[None] * (len(names) - 1))

    def shard(self, array: Any, mesh: Mesh) -> jax.Array:
        """The array split on its first dimension if ``should_shard`` and it divides, else replicated.

        Raises:
          TypeError: If ``mesh`` is not a ``jax.sharding.Mesh``.
          ValueError: If the array is split and the mesh lacks ``axis_name``.
        """
        shape = np.shape(array)
        split = self.should_shard(array)
        if split and isinstance(mesh, Mesh) and self.axis_name in mesh.axis_names:
            split = shape[0] % mesh.shape[self.axis_name] == 0
        spec = PartitionSpec(*[self.axis_name if split and dim == 0 else None for dim in range(len(shape))])
        return place(array, mesh, spec, "FSDPStrategy.shard")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelStrategy:
    """Split one feature dimension of each array over ``axis_name``.

    Attributes:
      axis_name: The mesh axis the features are split over.
      shard_dimension: The logical name of the dimension to split. ``None`` splits
        ``hidden`` where an array has it, else ``out_features``.
    """

    axis_name: str = "model"
    shard_dimension: str | None = None

    def __post_init__(self) -> None:
        _name(self.axis_name, "TensorParallelStrategy.axis_name")
        if self.shard_dimension is not None:
            _name(self.shard_dimension, "TensorParallelStrategy.shard_dimension")

    def partition_spec(self, dimension_names: DimensionNames) -> PartitionSpec:
        """``axis_name`` on the dimension named ``shard_dimension`` (see above), ``None`` elsewhere.

        Raises:
          TypeError: If ``dimension_names`` is not a sequence of str.
          ValueError: If it names that dimension twice.
        """
        who = "TensorParallelStrategy.partition_spec"
        names = checked_names(dimension_names, who)
        target = self.shard_dimension or ("hidden" if "hidden" in names else "out_features")
        return one_dimension(names, target, self.axis_name, who)

    @property
    def linear_weight_spec(self) -> PartitionSpec:
        """The spec of a weight stored ``(out_features, in_features)``, as PyTorch stores it.

        ``shard_dimension="in_features"`` splits the inputs (row-parallel); any other the outputs.
        """
        if self.shard_dimension == "in_features":
            return PartitionSpec(None, self.axis_name)
        return PartitionSpec(self.axis_name, None)

    @property
    def attention_qkv_spec(self) -> PartitionSpec:
        """The spec of a query, key or value kernel ``(in, out)``: its outputs (the heads) split."""
        return PartitionSpec(None, self.axis_name)

    @property
    def attention_output_spec(self) -> PartitionSpec:
        """The spec of the attention output kernel ``(in, out)``: its inputs (the heads) split."""
        return PartitionSpec(self.axis_name, None)

    def shard(self, array: Any, mesh: Mesh) -> jax.Array:
        """A 2-d array placed by ``linear_weight_spec``; any other split on its last dimension.

        Raises:
          TypeError: If ``mesh`` is not a ``jax.sharding.Mesh``.
          ValueError: If the array is 0-d, the mesh lacks ``axis_name``, or the split
            dimension does not divide by the axis size.
        """
        who = "TensorParallelStrategy.shard"
        if np.ndim(array) == 2:
            return place(array, mesh, self.linear_weight_spec, who)
        return split_one(array, mesh, self.axis_name, -1, who, "feature dimension")


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineParallelStrategy:
    """Give whole layers to ``num_stages`` stages; arrays inside a stage are not split.

    Attributes:
      axis_name: The mesh axis of the stages.
      num_stages: How many stages.
    """

    axis_name: str = "pipeline"
    num_stages: int

    def __post_init__(self) -> None:
        _name(self.axis_name, "PipelineParallelStrategy.axis_name")
        _size(self.num_stages, "PipelineParallelStrategy.num_stages")

    def assign_layers(self, num_layers: int) -> tuple[int, ...]:
        """How many of ``num_layers`` layers each stage holds: even, the first stages one more.

        Raises:
          TypeError: If ``num_layers`` is not an int.
          ValueError: If it is below 1.

        >>> PipelineParallelStrategy(num_stages=4).assign_layers(10)
        (3, 3, 2, 2)
        """
        layers = _size(num_layers, "PipelineParallelStrategy.assign_layers: num_layers")
        base, extra = divmod(layers, self.num_stages)
        return tuple(base + (stage < extra) for stage in range(self.num_stages))

    @property
    def forward_communication_pattern(self) -> tuple[tuple[int, int], ...]:
        """The ``(from, to)`` stage pairs of the forward pass: each stage to the next."""
        return tuple((stage, stage + 1) for stage in range(self.num_stages - 1))

    @property
    def backward_communication_pattern(self) -> tuple[tuple[int, int], ...]:
        """The ``(from, to)`` stage pairs of the backward pass: each stage to the previous."""
        return tuple((stage + 1, stage) for stage in range(self.num_stages - 1))

    def partition_spec(self, dimension_names: DimensionNames) -> PartitionSpec:
        """``None`` for every dimension: a pipeline places layers, not array dimensions.

        Raises:
          TypeError: If ``dimension_names`` is not a sequence of str.
        """
        names = checked_names(dimension_names, "PipelineParallelStrategy.partition_spec")
        return PartitionSpec(*[None] * len(names))

    def shard(self, array: Any, mesh: Mesh) -> jax.Array:
        """The array replicated over ``mesh``.

        Raises:
          TypeError: If ``mesh`` is not a ``jax.sharding.Mesh``.
        """
        return place(array, mesh, PartitionSpec(*[None] * np.ndim(array)), "PipelineParallelStrategy.shard")


_SHARE_AN_AXIS = (DataParallelStrategy, FSDPStrategy)


def _rank(strategy: object) -> int:
    """Which claim on a dimension wins: tensor parallel, then FSDP, then the first other."""
    if isinstance(strategy, TensorParallelStrategy):
        return 0
    return 1 if isinstance(strategy, FSDPStrategy) else 2


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiDimensionalStrategy:
    """Strategies on several mesh axes, merged into one spec per array.

    Attributes:
      strategies: The strategies, by name.
      config: The parallelism configuration they realise (kept, not checked).

    Raises:
      TypeError: If a strategy does not follow ``ShardingStrategy``, or ``config`` is not a
        ``ParallelismConfig``.
      ValueError: If two strategies share a mesh axis ("Conflicting strategies"; names
        both); only a ``DataParallelStrategy`` and an ``FSDPStrategy`` may.

    >>> combined = MultiDimensionalStrategy(
    ...     strategies={"data": DataParallelStrategy(), "model": TensorParallelStrategy()},
    ...     config=ParallelismConfig.from_sharding_config(ShardingConfig.from_device_count(8)),
    ... )
    >>> combined.partition_spec(("batch", "hidden"))
    P('data', 'model')
    """

    strategies: Mapping[str, ShardingStrategy]
    config: ParallelismConfig

    def __post_init__(self) -> None:
        if not isinstance(self.strategies, Mapping):
            raise TypeError(
                f"MultiDimensionalStrategy.strategies must be a mapping from name to strategy; got "
                f"{type(self.strategies).__name__}."
            )
        for key, strategy in self.strategies.items():
            if not isinstance(strategy, ShardingStrategy):
                raise TypeError(
                    f"MultiDimensionalStrategy.strategies[{key!r}] is a {type(strategy).__name__}, "
                    f"which lacks axis_name, partition_spec or shard (see ShardingStrategy)."
                )
        if not isinstance(self.config, ParallelismConfig):
            raise TypeError(
                f"MultiDimensionalStrategy.config must be a ParallelismConfig; got "
                f"{type(self.config).__name__}."
            )
        object.__setattr__(self, "strategies", dict(self.strategies))
        seen: dict[str, tuple[str, object]] = {}
        for key, strategy in self.strategies.items():
            axis = strategy.axis_name
            if axis not in seen:
                seen[axis] = (key, strategy)
                continue
            other_key, other = seen[axis]
            kinds = f"{other_key!r} ({type(other).__name__}) and {key!r} ({type(strategy).__name__})"
            may_share = isinstance(other, _SHARE_AN_AXIS) and isinstance(strategy, _SHARE_AN_AXIS)
            if type(other) is type(strategy):
                raise ValueError(
                    f"Conflicting strategies: {kinds} are of one kind on mesh axis {axis!r}; keep one."
                )
            if not may_share:
                raise ValueError(
                    f"Conflicting strategies: {kinds} both use mesh axis {axis!r}; only data "
                    f"parallelism and FSDP may share an axis."
                )

    def partition_spec(self, dimension_names: DimensionNames) -> PartitionSpec:
        """Every strategy's spec for these names, merged by ``resolve_sharding_conflicts``.

        Raises:
          TypeError: If ``dimension_names`` is not a sequence of str.
          ValueError: As ``resolve_sharding_conflicts``.
        """
        names = checked_names(dimension_names, "MultiDimensionalStrategy.partition_spec")
        proposed = {key: s.partition_spec(names) for key, s in self.strategies.items()}
        return self.resolve_sharding_conflicts(proposed, ndim=len(names))

    def resolve_sharding_conflicts(
        self, proposed_specs: Mapping[str, PartitionSpec], *, ndim: int
    ) -> PartitionSpec:
        """Merge specs dimension by dimension; tensor parallel wins a dimension, then FSDP, then the first.

        Raises:
          ValueError: If a spec has more than ``ndim`` entries, or the merged spec splits
            two dimensions over one mesh axis (names the axis and the dimensions).
        """
        merged: list[Any] = [None] * ndim
        ranks = [3] * ndim
        for key, spec in proposed_specs.items():
            entries = tuple(spec)
            if len(entries) > ndim:
                raise ValueError(
                    f"MultiDimensionalStrategy: the spec {spec} of {key!r} has {len(entries)} "
                    f"entries for an array of {ndim} dimensions."
                )
            rank = _rank(self.strategies.get(key))
            for dim, entry in enumerate(entries):
                if spec_axes(entry) and rank < ranks[dim]:
                    merged[dim], ranks[dim] = entry, rank
        used: dict[str, int] = {}
        for dim, entry in enumerate(merged):
            for axis in spec_axes(entry):
                if axis in used:
                    raise ValueError(
                        f"MultiDimensionalStrategy: mesh axis {axis!r} would split dimensions "
                        f"{used[axis]} and {dim} of {PartitionSpec(*merged)}; a mesh axis splits "
                        f"one dimension of an array."
                    )
                used[axis] = dim
        return PartitionSpec(*merged)
