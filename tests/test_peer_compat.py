"""What code written for avitai/substrax calls: its mesh helpers, and prebuilt NNX shardings."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from models import Partitioned

from substrax.mesh import DeviceMeshManager, create_device_mesh
from substrax.spmd import place_nnx_state_on_shards


def test_model_parallel_mesh() -> None:
    mesh = DeviceMeshManager.create_model_parallel_mesh(num_devices=4)
    assert mesh.axis_names == ("model",) and mesh.devices.shape == (4,)
    assert mesh.axis_types == (AxisType.Auto,)
    with pytest.raises(ValueError, match=r"Not enough devices.*100"):
        DeviceMeshManager.create_model_parallel_mesh(num_devices=100)


def test_hybrid_mesh_on_one_process() -> None:
    mesh = DeviceMeshManager.create_hybrid_mesh(data_parallel_size=4, model_parallel_size=2)
    assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (4, 2)
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert DeviceMeshManager.get_mesh_info(mesh) == {"total_devices": 8, "axes": {"data": 4, "model": 2}}
    with pytest.raises(ValueError, match=r"Not enough devices.*100"):
        DeviceMeshManager.create_hybrid_mesh(data_parallel_size=10, model_parallel_size=10)
    with pytest.raises(ValueError, match=r"Mesh axis 'model' has size 0"):
        DeviceMeshManager.create_hybrid_mesh(data_parallel_size=2, model_parallel_size=0)


def test_get_mesh_info_single_axis() -> None:
    info = DeviceMeshManager.get_mesh_info(create_device_mesh({"data": 2}))
    assert info == {"total_devices": 2, "axes": {"data": 2}}


@pytest.fixture(scope="module")
def mesh_and_state() -> tuple[jax.sharding.Mesh, nnx.State]:
    mesh = create_device_mesh({"data": 2, "model": 4})
    with jax.set_mesh(mesh):
        return mesh, nnx.state(Partitioned())


def test_a_prebuilt_named_sharding_tree(mesh_and_state: tuple) -> None:
    mesh, state = mesh_and_state
    placed = place_nnx_state_on_shards(state, mesh, nnx.get_named_sharding(state, mesh))
    assert placed["wide"]["kernel"].get_value().sharding.spec == P(None, "model")
    assert placed["head"]["kernel"].get_value().sharding.is_fully_replicated
    np.testing.assert_array_equal(placed["wide"]["kernel"].get_value(), state["wide"]["kernel"].get_value())


def test_a_state_sharding_of_filters(mesh_and_state: tuple) -> None:
    mesh, state = mesh_and_state
    rules = nnx.StateSharding({nnx.PathContains("kernel"): NamedSharding(mesh, P("model")), ...: P()})
    placed = place_nnx_state_on_shards(state, mesh, rules)
    assert placed["head"]["kernel"].get_value().sharding.spec == P("model")
    assert placed["head"]["bias"].get_value().sharding.is_fully_replicated


def test_a_sharding_tree_must_cover_the_state_and_hold_shardings(mesh_and_state: tuple) -> None:
    mesh, state = mesh_and_state
    partial = nnx.get_named_sharding(nnx.state(state, nnx.Param), mesh)
    with pytest.raises(ValueError, match=r"no sharding for state\['count'\]"):
        place_nnx_state_on_shards(state, mesh, partial)
    with pytest.raises(TypeError, match=r"filter nnx.Param is 'model' \(str\), not a PartitionSpec"):
        place_nnx_state_on_shards(state, mesh, {nnx.Param: "model"})
