"""``substrax.mesh.topology_mesh``: meshes of compile-only TPU devices (libtpu, no TPU; make test-tpu)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import optax
import pytest
from conftest import MLP, needs_libtpu
from flax import nnx
from jax.sharding import AxisType

import substrax
from substrax.mesh import compile_only, topology_mesh


@needs_libtpu
@pytest.mark.parametrize(
    ("topology", "shape", "devices"),
    [
        ("v5e:2x4", {"data": 8}, 8),
        ("v5e:1x1", {"data": 1}, 1),
        ("v5e:16x16", {"replica": 2, "data": 128}, 256),
    ],
)
def test_a_topology_mesh_holds_the_compile_only_tpu_devices(topology: str, shape: dict, devices: int) -> None:
    mesh = topology_mesh(topology, shape)
    assert dict(mesh.shape) == shape and mesh.size == devices
    assert {d.platform for d in mesh.devices.flat} == {"tpu"}
    assert {d.device_kind for d in mesh.devices.flat} == {"TPU v5 lite"}
    assert len({d.id for d in mesh.devices.flat}) == devices
    assert compile_only(mesh) and not compile_only(substrax.mesh.create_device_mesh({"data": 8}))
    assert mesh.axis_types == (AxisType.Auto,) * len(shape)


@needs_libtpu
def test_slices_are_the_first_axis() -> None:
    mesh = topology_mesh("v5e:2x4", {"replica": 2, "data": 8}, slices=2)
    slices = [[d.slice_index for d in row] for row in mesh.devices]
    assert slices == [[0] * 8, [1] * 8]
    assert len({d.id for d in mesh.devices.flat}) == 16
    wide = topology_mesh("v5e:2x4", {"data": 16, "model": 2}, slices=4)
    assert [{d.slice_index for d in row} for row in wide.devices] == [{i // 4} for i in range(16)]


@needs_libtpu
def test_bad_topologies_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Unknown TPU topology 'v9z:2x4'.*'v5e:2x4'"):
        topology_mesh("v9z:2x4", {"data": 8})
    with pytest.raises(ValueError, match=r"\{'data': 4\} holds 4 devices; 'v5e:2x4' has 8"):
        topology_mesh("v5e:2x4", {"data": 4})
    with pytest.raises(ValueError, match=r"has 16 \(2 slices of 8\)"):
        topology_mesh("v5e:2x4", {"data": 8}, slices=2)
    with pytest.raises(ValueError, match=r"first mesh axis 'data' spans the 4 slices.*size 2"):
        topology_mesh("v5e:2x4", {"data": 2, "model": 16}, slices=4)
    with pytest.raises(ValueError, match=r"repeat"):
        topology_mesh("v5e:2x4", [("data", 4), ("data", 2)])
    with pytest.raises(TypeError, match=r"topology must be a TPU or GPU topology name"):
        topology_mesh(8, {"data": 8})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"slices must be an int"):
        topology_mesh("v5e:2x4", {"data": 8}, slices=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"slices must be >= 1"):
        topology_mesh("v5e:2x4", {"data": 8}, slices=0)


def test_without_libtpu_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    found = importlib.util.find_spec
    missing = lambda name, *a: None if name == "libtpu" else found(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    with pytest.raises(ImportError, match=r"libtpu, which is not installed: pip install 'substrax\[tpu\]'"):
        topology_mesh("v5e:2x4", {"data": 8})


@needs_libtpu
def test_arrays_on_a_compile_only_mesh_are_refused_naming_the_leaf() -> None:
    mesh = topology_mesh("v5e:2x4", {"data": 8})
    model = MLP(16, 64, 4)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"compile-only.*model\['hidden'\]\['bias'\] is one.*nnx.eval_shape"):
        substrax.shard_state(model, optimizer, mesh=mesh)


@needs_libtpu
def test_libtpu_prints_no_hostname_error_for_a_compile_only_topology() -> None:
    """Before: libtpu's INVALID_ARGUMENT about TPU_WORKER_HOSTNAMES, its source trace and a host
    bounds warning on stderr, every run (a fresh process: libtpu loads once); a real error still
    comes through (an unknown topology, with libtpu's message)."""
    script = (
        "from substrax.mesh import topology_mesh\n"
        "topology_mesh('v5e:2x4', {'data': 8})\n"
        "try:\n"
        "    topology_mesh('v9z:2x4', {'data': 8})\n"
        "except ValueError as e:\n"
        "    print('refused:', str(e)[:60])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")} | {"JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "refused: Unknown TPU topology 'v9z:2x4'" in run.stdout
    for noise in ("TPU_WORKER_HOSTNAMES", "Source Location Trace", "host bounds"):
        assert noise not in run.stderr, run.stderr
