from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

from substrax.mesh import (
    DeviceMeshManager,
    create_data_parallel_mesh,
    create_device_mesh,
    current_mesh,
    mesh_info,
    use_cpu_devices,
)


def test_mapping_and_pairs_give_the_same_mesh() -> None:
    a = DeviceMeshManager.create_device_mesh({"data": 4, "model": 2})
    b = create_device_mesh([("data", 4), ("model", 2)])
    assert a.axis_names == b.axis_names == ("data", "model")
    assert dict(a.shape) == dict(b.shape) == {"data": 4, "model": 2}
    assert a.axis_types == (AxisType.Auto, AxisType.Auto)


def test_axis_types_can_be_chosen() -> None:
    mesh = create_device_mesh({"data": 2}, axis_types=AxisType.Explicit)
    assert mesh.axis_types == (AxisType.Explicit,)


def test_devices_argument_is_used_in_order() -> None:
    devices = jax.devices()[4:]
    mesh = create_device_mesh({"data": 4}, devices)
    assert set(mesh.devices.flat) == set(devices)


def test_data_parallel_mesh_defaults_to_every_device() -> None:
    assert dict(create_data_parallel_mesh().shape) == {"data": 8}
    assert dict(DeviceMeshManager.create_data_parallel_mesh(2).shape) == {"data": 2}


def test_mesh_info() -> None:
    info = mesh_info(create_device_mesh({"data": 4, "model": 2}))
    assert info["shape"] == {"data": 4, "model": 2}
    assert info["axis_types"] == {"data": "Auto", "model": "Auto"}
    assert info["num_devices"] == 8
    assert info["platform"] == "cpu"
    assert info["process_count"] == 1
    assert info["local_shape"] == {"data": 4, "model": 2}


def test_too_many_devices_names_shape_and_count() -> None:
    with pytest.raises(ValueError, match=r"\{'data': 16\} needs 16 devices, but 8 are available"):
        create_device_mesh({"data": 16})


@pytest.mark.parametrize("size", [0, -2, 2.0, True, "4"])
def test_size_must_be_a_positive_int(size: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"axis 'data' has size .* must be a positive int \(their product at most the 8 devices",
    ):
        create_device_mesh({"data": size})  # type: ignore[dict-item]


def test_repeated_axis_name() -> None:
    with pytest.raises(ValueError, match=r"\['data'\] repeat in mesh_shape .* \(8 devices available\)"):
        create_device_mesh([("data", 2), ("data", 2)])


def test_malformed_shape() -> None:
    with pytest.raises(ValueError, match="mapping from axis name to size"):
        create_device_mesh([4, 2])  # type: ignore[list-item]


def test_current_mesh_errors() -> None:
    with pytest.raises(ValueError, match=r"No mesh: pass mesh=, or call inside `with jax.set_mesh"):
        current_mesh()
    mesh = create_device_mesh({"data": 8})
    with jax.set_mesh(mesh):
        assert current_mesh() == mesh
        with pytest.raises(ValueError, match=r"Axis 'batch' is not in the mesh, whose axes are \('data',\)"):
            current_mesh(required_axes=("batch",))


def test_use_cpu_devices_after_start() -> None:
    use_cpu_devices(8)  # the count the backend already has: fine
    with pytest.raises(RuntimeError, match=r"already running with 8 cpu device\(s\).*use_cpu_devices\(4\)"):
        use_cpu_devices(4)
    with pytest.raises(ValueError, match="positive int"):
        use_cpu_devices(0)


def test_axis_names_must_be_strings() -> None:
    with pytest.raises(ValueError, match=r"Mesh axis names must be non-empty strings; got 0"):
        create_device_mesh([(0, 2)])  # type: ignore[list-item]


def test_axis_types_must_match_the_axes() -> None:
    with pytest.raises(ValueError, match=r"axis_types has 1 entries for 2 mesh axes \['data', 'model'\]"):
        create_device_mesh({"data": 2, "model": 2}, axis_types=[AxisType.Auto])
