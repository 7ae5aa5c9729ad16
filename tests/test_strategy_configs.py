"""substrax.mesh's sharding configs: ``ShardingConfig`` (sizes per kind of parallelism, the
rule of thumb by device count) and ``ParallelismConfig`` (the mesh they make); errors name
the field."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from substrax.mesh import ParallelismConfig, ShardingConfig

# ShardingConfig


def test_sharding_config_defaults_to_one_device_and_is_frozen() -> None:
    config = ShardingConfig()
    assert config.total_device_count == 1 and not config.fsdp_enabled
    assert (
        ShardingConfig(
            data_parallel_size=2, tensor_parallel_size=3, pipeline_parallel_size=4
        ).total_device_count
        == 24
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.data_parallel_size = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        ShardingConfig(2)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(
    ("count", "data", "tensor"),
    [
        (1, 1, 1),
        (3, 3, 1),
        (4, 4, 1),
        (5, 5, 1),
        (6, 2, 3),
        (7, 7, 1),
        (8, 2, 4),
        (12, 3, 4),
        (16, 4, 4),
        (32, 4, 8),
        (64, 8, 8),
        (256, 32, 8),
    ],
)
def test_from_device_count_rule_of_thumb(count: int, data: int, tensor: int) -> None:
    config = ShardingConfig.from_device_count(count)
    assert (config.data_parallel_size, config.tensor_parallel_size, config.pipeline_parallel_size) == (
        data,
        tensor,
        1,
    )


def test_from_device_count_uses_every_device_tensor_at_most_8() -> None:
    for count in range(1, 513):
        config = ShardingConfig.from_device_count(count)
        assert config.total_device_count == count
        assert config.tensor_parallel_size <= 8


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"data_parallel_size": 0},
            ValueError,
            r"ShardingConfig.data_parallel_size must be at least 1; got 0",
        ),
        (
            {"tensor_parallel_size": 2.0},
            TypeError,
            r"ShardingConfig.tensor_parallel_size must be an int; got 2.0",
        ),
        (
            {"pipeline_parallel_size": True},
            TypeError,
            r"pipeline_parallel_size must be an int; got True \(bool\)",
        ),
        ({"fsdp_min_weight_size": -1}, ValueError, r"fsdp_min_weight_size must be at least 1; got -1"),
        ({"fsdp_enabled": 1}, TypeError, r"ShardingConfig.fsdp_enabled must be a bool; got 1"),
    ],
)
def test_sharding_config_errors_name_the_field(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ShardingConfig(**kwargs)


def test_from_device_count_errors() -> None:
    with pytest.raises(ValueError, match=r"from_device_count: device_count must be at least 1; got 0"):
        ShardingConfig.from_device_count(0)
    with pytest.raises(TypeError, match=r"from_device_count: device_count must be an int; got '8'"):
        ShardingConfig.from_device_count("8")  # type: ignore[arg-type]


# ParallelismConfig


@pytest.mark.parametrize(
    ("sizes", "shape", "names"),
    [
        ({}, (1,), ("data",)),
        ({"data_parallel_size": 8}, (8,), ("data",)),
        ({"tensor_parallel_size": 8}, (8,), ("model",)),
        ({"data_parallel_size": 2, "tensor_parallel_size": 4}, (2, 4), ("data", "model")),
        (
            {"data_parallel_size": 2, "pipeline_parallel_size": 2, "tensor_parallel_size": 2},
            (2, 2, 2),
            ("data", "model", "pipeline"),
        ),
    ],
)
def test_from_sharding_config_names_an_axis_per_parallel_size(
    sizes: dict, shape: tuple, names: tuple
) -> None:
    config = ParallelismConfig.from_sharding_config(ShardingConfig(**sizes))
    assert (config.mesh_shape, config.mesh_axis_names) == (shape, names)
    assert config.is_valid
    mesh = config.create_mesh()
    assert mesh.axis_names == names and mesh.devices.shape == shape
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * len(names)


def test_parallelism_config_validity_is_the_device_count() -> None:
    dp8 = ShardingConfig(data_parallel_size=8)
    assert ParallelismConfig(mesh_shape=[4, 2], mesh_axis_names=["a", "b"], sharding_config=dp8).is_valid
    config = ParallelismConfig(mesh_shape=(2, 2), mesh_axis_names=("data", "model"), sharding_config=dp8)
    assert config.mesh_shape == (2, 2) and not config.is_valid
    with pytest.raises(
        ValueError, match=r"mesh_shape \(2, 2\) holds 4 devices, but the sharding config spans 8"
    ):
        config.create_mesh()
    needs16 = ParallelismConfig.from_sharding_config(ShardingConfig(data_parallel_size=16))
    with pytest.raises(ValueError, match=r"Not enough devices"):
        needs16.create_mesh()


def test_create_mesh_takes_devices() -> None:
    devices = jax.devices()[4:]
    mesh = ParallelismConfig.from_sharding_config(ShardingConfig(data_parallel_size=4)).create_mesh(devices)
    assert list(mesh.devices.flat) == devices


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"mesh_shape": (2,), "mesh_axis_names": ("a", "b")},
            ValueError,
            r"mesh_shape \(2,\) has 1 axes but mesh_axis_names \('a', 'b'\) has 2",
        ),
        ({"mesh_shape": (2, 2), "mesh_axis_names": ("a", "a")}, ValueError, r"\('a', 'a'\) repeat a name"),
        (
            {"mesh_shape": (0,), "mesh_axis_names": ("a",)},
            ValueError,
            r"mesh_shape entries must be at least 1",
        ),
        ({"mesh_shape": (2,), "mesh_axis_names": (1,)}, TypeError, r"mesh_axis_names entries must be a str"),
        (
            {"mesh_shape": (2,), "mesh_axis_names": ("",)},
            ValueError,
            r"mesh_axis_names entries must be a non-empty",
        ),
        (
            {"mesh_shape": (2,), "mesh_axis_names": ("a",), "sharding_config": {"data_parallel_size": 2}},
            TypeError,
            r"sharding_config must be a ShardingConfig; got dict",
        ),
    ],
)
def test_parallelism_config_errors(kwargs: dict, error: type, match: str) -> None:
    kwargs = {"sharding_config": ShardingConfig(), **kwargs}
    with pytest.raises(error, match=match):
        ParallelismConfig(**kwargs)


def test_from_sharding_config_takes_a_sharding_config() -> None:
    with pytest.raises(TypeError, match=r"from_sharding_config: config must be a ShardingConfig; got int"):
        ParallelismConfig.from_sharding_config(8)  # type: ignore[arg-type]
