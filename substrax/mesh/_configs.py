"""How many devices each kind of parallelism spans (``ShardingConfig``) and its mesh (``ParallelismConfig``).

Part of the planning layer ``substrax.mesh.strategies``, which re-exports both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.sharding import Mesh

from substrax.mesh._meshes import create_device_mesh

__all__ = ["ParallelismConfig", "ShardingConfig"]


def _size(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int; got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"{what} must be at least 1; got {value}.")
    return value


def _name(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str; got {value!r} ({type(value).__name__}).")
    if not value:
        raise ValueError(f"{what} must be a non-empty str.")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardingConfig:
    """How many devices each kind of parallelism spans.

    Attributes:
      data_parallel_size: Devices the batch is split over.
      tensor_parallel_size: Devices a layer's weights are split over.
      pipeline_parallel_size: Pipeline stages.
      fsdp_enabled: Whether parameters are also split over the data-parallel devices.
      fsdp_min_weight_size: The smallest leading dimension FSDP splits.

    Raises:
      TypeError: If a size is not an int, or ``fsdp_enabled`` is not a bool.
      ValueError: If a size is below 1.
    """

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    fsdp_enabled: bool = False
    fsdp_min_weight_size: int = 1024

    def __post_init__(self) -> None:
        for field in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
            _size(getattr(self, field), f"ShardingConfig.{field}")
        _size(self.fsdp_min_weight_size, "ShardingConfig.fsdp_min_weight_size")
        if not isinstance(self.fsdp_enabled, bool):
            raise TypeError(f"ShardingConfig.fsdp_enabled must be a bool; got {self.fsdp_enabled!r}.")

    @property
    def total_device_count(self) -> int:
        """The devices the configuration spans: the product of the three sizes."""
        return self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def from_device_count(cls, device_count: int) -> ShardingConfig:
        """A rule of thumb for ``device_count`` devices: data parallel first, then tensor parallel.

        See the batches guide, "Sharding strategies"; ``substrax.plan`` measures the program.

        Raises:
          TypeError: If ``device_count`` is not an int.
          ValueError: If it is below 1.

        >>> config = ShardingConfig.from_device_count(8)
        >>> config.data_parallel_size, config.tensor_parallel_size
        (2, 4)
        """
        count = _size(device_count, "ShardingConfig.from_device_count: device_count")
        if count <= 4:
            return cls(data_parallel_size=count)
        limit = min(8, math.isqrt(2 * count))
        tensor = max(d for d in range(1, limit + 1) if count % d == 0)
        return cls(data_parallel_size=count // tensor, tensor_parallel_size=tensor)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelismConfig:
    """A ``ShardingConfig`` and the mesh that realises it.

    Attributes:
      mesh_shape: Devices per mesh axis.
      mesh_axis_names: One axis name per entry of ``mesh_shape``.
      sharding_config: The parallelism sizes.

    Raises:
      TypeError: If a size is not an int, a name not a str, or ``sharding_config`` not a
        ``ShardingConfig``.
      ValueError: If the shape and the names differ in length, a size is below 1, or a
        name is empty or repeats.
    """

    mesh_shape: tuple[int, ...]
    mesh_axis_names: tuple[str, ...]
    sharding_config: ShardingConfig

    def __post_init__(self) -> None:
        shape = tuple(_size(s, "ParallelismConfig.mesh_shape entries") for s in self.mesh_shape)
        names = tuple(_name(n, "ParallelismConfig.mesh_axis_names entries") for n in self.mesh_axis_names)
        if len(shape) != len(names):
            raise ValueError(
                f"ParallelismConfig: mesh_shape {shape} has {len(shape)} axes but mesh_axis_names "
                f"{names} has {len(names)}; give one name per axis."
            )
        if len(set(names)) != len(names):
            raise ValueError(f"ParallelismConfig: mesh_axis_names {names} repeat a name.")
        if not isinstance(self.sharding_config, ShardingConfig):
            raise TypeError(
                f"ParallelismConfig.sharding_config must be a ShardingConfig; got "
                f"{type(self.sharding_config).__name__}."
            )
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "mesh_axis_names", names)

    @property
    def is_valid(self) -> bool:
        """Whether the mesh has as many devices as ``sharding_config.total_device_count``."""
        return math.prod(self.mesh_shape) == self.sharding_config.total_device_count

    @classmethod
    def from_sharding_config(cls, config: ShardingConfig) -> ParallelismConfig:
        """One axis per size above 1: ``data``, ``model`` (tensor), ``pipeline``, in that order.

        A configuration of one device gets the mesh ``{"data": 1}``.

        Raises:
          TypeError: If ``config`` is not a ``ShardingConfig``.
        """
        if not isinstance(config, ShardingConfig):
            raise TypeError(
                f"ParallelismConfig.from_sharding_config: config must be a ShardingConfig; got "
                f"{type(config).__name__}."
            )
        sizes = {
            "data": config.data_parallel_size,
            "model": config.tensor_parallel_size,
            "pipeline": config.pipeline_parallel_size,
        }
        axes = {name: size for name, size in sizes.items() if size > 1} or {"data": 1}
        return cls(mesh_shape=tuple(axes.values()), mesh_axis_names=tuple(axes), sharding_config=config)

    def create_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The mesh, built by ``create_device_mesh`` (Auto axes) over ``devices`` or all of them.

        Raises:
          ValueError: If the configuration is not valid (names both device counts), or there
            are too few devices.
        """
        if not self.is_valid:
            raise ValueError(
                f"ParallelismConfig.create_mesh: mesh_shape {self.mesh_shape} holds "
                f"{math.prod(self.mesh_shape)} devices, but the sharding config spans "
                f"{self.sharding_config.total_device_count}."
            )
        return create_device_mesh(list(zip(self.mesh_axis_names, self.mesh_shape, strict=True)), devices)
