"""``substrax.mesh.topology_mesh`` for NVIDIA GPUs: compile-only devices from jax's CUDA plugin (test-gpu)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import needs_cuda_plugin
from jax.sharding import AxisType

import substrax
from substrax.mesh import _gpu, compile_only, device_memory, topology_mesh


@needs_cuda_plugin
@pytest.mark.parametrize(
    ("topology", "shape", "hosts"),
    [
        ("h100:1x1x8", {"data": 8}, [0] * 8),
        ("h100:1x2x8", {"data": 16}, [0] * 8 + [1] * 8),
        ("h100:1x2x8", {"replica": 2, "data": 8}, [0] * 8 + [1] * 8),
    ],
)
def test_a_gpu_topology_mesh_holds_its_hosts_compile_only_h100s(
    topology: str, shape: dict, hosts: list
) -> None:
    mesh = topology_mesh(topology, shape)
    assert dict(mesh.shape) == shape and mesh.axis_types == (AxisType.Auto,) * len(shape)
    assert {d.platform for d in mesh.devices.flat} == {"gpu"}
    assert {d.device_kind for d in mesh.devices.flat} == {"NVIDIA H100 80GB HBM3"}
    assert [d.process_index for d in mesh.devices.flat] == hosts  # host after host: a replica a host
    assert compile_only(mesh)


@needs_cuda_plugin
def test_the_device_memory_is_the_plugins_description() -> None:
    text = _gpu.description("h100")
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text and "sm_9.0a" in text
    assert device_memory(topology_mesh("h100:1x1x8", {"data": 8})) == 84_942_979_072
    a100 = topology_mesh("a100:1x1x8", {"data": 8})
    assert {d.device_kind for d in a100.devices.flat} == {"NVIDIA A100-SXM4-80GB"}
    assert device_memory(a100) == 85_100_068_864  # its own description, not the H100's
    assert device_memory(substrax.mesh.create_device_mesh({"data": 8})) is None  # the CPU's: not described


@needs_cuda_plugin
def test_bad_gpus_and_topologies_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Unknown GPU 'NVIDIA Z1'.*'h100'.*NVIDIA H100 80GB HBM3"):
        _gpu.description("NVIDIA Z1")
    with pytest.raises(
        ValueError, match=r"GPU topology '8' must read slices x hosts x GPUs per host.*'1x1x8'"
    ):
        topology_mesh("h100:8", {"data": 8})
    with pytest.raises(ValueError, match=r"\{'data': 8\} holds 8 devices; 'h100:1x2x8' has 16"):
        topology_mesh("h100:1x2x8", {"data": 8})
    with pytest.raises(ValueError, match=r"slices is for TPU topologies.*'h100:1x2x8'"):
        topology_mesh("h100:1x1x8", {"data": 16}, slices=2)


def test_without_the_cuda_plugin_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    found = importlib.util.find_spec
    missing = lambda name, *a: None if name == "jax_plugins.xla_cuda13" else found(name, *a)
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    with pytest.raises(
        ImportError, match=r"CUDA plugin, which is not installed: pip install 'substrax\[gpu\]'"
    ):
        topology_mesh("h100:1x1x8", {"data": 8})


@needs_cuda_plugin
@pytest.mark.parametrize(
    ("absent", "says"),
    [
        ({"ptxas"}, r"needs CUDA's ptxas \(pip install nvidia-cuda-nvcc\), not found"),
        ({"libdevice"}, r"needs CUDA's libdevice \(pip install nvidia-nvvm\), not found"),
        (
            {"ptxas", "libdevice"},
            r"ptxas \(pip install nvidia-cuda-nvcc\) and libdevice \(pip install nvidia-nvvm\)",
        ),
    ],
)
def test_without_ptxas_or_libdevice_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, absent: set, says: str
) -> None:
    tools = _gpu.cuda_tools()
    assert tools["ptxas"] and tools["libdevice"]
    monkeypatch.setattr(_gpu, "cuda_tools", lambda: {k: None if k in absent else v for k, v in tools.items()})
    with pytest.raises(RuntimeError, match=says + r".*pip install 'substrax\[gpu\]' installs both"):
        topology_mesh("h100:1x1x8", {"data": 8})


@needs_cuda_plugin
def test_a_gpu_topology_after_jax_started_its_backends() -> None:
    """jax discovers its plugins once: where a backend started first (``jax.devices()``, with
    ``JAX_PLATFORMS`` unset), the CUDA plugin checked for a driver, found none and stayed unregistered,
    and the GPU topology failed ("topology not implemented for cuda")."""
    script = (
        "import jax\n"
        "jax.devices()\n"
        "from substrax.mesh import topology_mesh\n"
        "print(topology_mesh('h100:1x1x8', {'data': 8}).devices.flat[0].device_kind)\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    }
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("NVIDIA H100 80GB HBM3"), run.stdout
