"""Meshes of compile-only TPU and NVIDIA GPU devices: compile a step for a pod from a machine without one.

See the guide "Plan a pod from a laptop".
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import AxisType, Mesh

from substrax.mesh._gpu import GPUS, gpu_devices
from substrax.mesh._meshes import _axes, _checked_axes, create_device_mesh

__all__ = ["compile_only", "topology_mesh"]

INSTALL = "pip install 'substrax[tpu]'"


def compile_only(mesh: Any) -> bool:
    """Whether ``mesh``'s devices can compile a program but not run one (``topology_mesh``'s)."""
    devices = getattr(mesh, "devices", None)
    if devices is None or not getattr(devices, "size", 0):
        return False
    client = getattr(devices.flat[0], "client", None)
    return type(client).__name__ == "CompileOnlyPyClient"


def _check_count(mesh_shape: Any, devices: Sequence[Any], topology: str, slices: int) -> None:
    axes = _axes(mesh_shape)
    sizes = [s for _, s in axes]
    counted = all(isinstance(s, int) and not isinstance(s, bool) for s in sizes)
    if counted and math.prod(sizes) != len(devices):
        where = f" ({slices} slices of {len(devices) // slices})" if slices > 1 else ""
        raise ValueError(
            f"mesh_shape {dict(axes)} holds {math.prod(sizes)} devices; {topology!r} has "
            f"{len(devices)}{where}. Give sizes whose product is {len(devices)}."
        )


def _check_args(topology: Any, slices: Any) -> None:
    if not isinstance(topology, str):
        raise TypeError(
            f"topology must be a TPU or GPU topology name such as 'v5e:2x4' or 'h100:1x1x8'; "
            f"got {topology!r}."
        )
    if isinstance(slices, bool) or not isinstance(slices, int):
        raise TypeError(f"slices must be an int (the number of TPU slices); got {slices!r}.")
    if slices < 1:
        raise ValueError(f"slices must be >= 1; got {slices}.")


def _tpu_devices(topology: str, slices: int) -> list[Any]:
    """The compile-only devices of ``slices`` TPU slices of ``topology``, from libtpu."""
    if importlib.util.find_spec("libtpu") is None:
        raise ImportError(
            f"topology_mesh({topology!r}) compiles for TPU devices through libtpu, which is not "
            f"installed: {INSTALL} (or pip install libtpu)."
        )
    from jax.experimental import topologies

    # libtpu takes a lock file for the one process that may drive a TPU; compiling drives none
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    _quiet_libtpu()
    try:
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", num_slices=slices)
    except Exception as error:  # a JaxRuntimeError
        if "INVALID_ARGUMENT" not in str(error):
            raise
        raise ValueError(
            f"Unknown TPU topology {topology!r}: write the TPU type and its chips per dimension, "
            f"such as 'v5e:2x4', 'v5e:16x16', 'v5e:1x1' or 'v4:2x2x1'. libtpu said: {error}"
        ) from None
    return list(desc.devices)


# Where libtpu, on a machine with no TPU, looks for the hosts of one it could drive, fails, and
# prints it (an INVALID_ARGUMENT about TPU_WORKER_HOSTNAMES with a source trace, a "host bounds"
# warning) on every compile-only run. A compile-only topology drives no host: this one and a
# 1x1x1 block of chips. Measured (libtpu 0.0.52): the programs compiled the same with them.
_NO_TPU_HOST = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def _quiet_libtpu() -> None:
    """Give libtpu the hosts of a machine without a TPU (``_NO_TPU_HOST``) before it first loads,
    where none is set and this machine has no TPU chip (on a TPU VM libtpu finds its own)."""
    try:
        from jax._src import hardware_utils  # jax's own test for TPU chips (cloud_tpu_init's)

        chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    except Exception:  # noqa: BLE001  (another jax: leave libtpu as it is)
        return
    if chips == 0 and not any(k in os.environ for k in _NO_TPU_HOST):
        os.environ.update(_NO_TPU_HOST)


def _sliced_mesh(axes: list[tuple[str, Any]], devices: list[Any], slices: int, axis_types: Any) -> Mesh:
    """A mesh over several slices: the first axis spans them (over DCN), the others stay within one."""
    sizes = [s for _, s in axes]
    _checked_axes(axes, devices)
    if sizes[0] % slices:
        raise ValueError(
            f"The first mesh axis {axes[0][0]!r} spans the {slices} slices (over DCN): its size "
            f"{sizes[0]} must be a multiple of {slices}."
        )
    from jax.experimental import mesh_utils

    grid = mesh_utils.create_hybrid_device_mesh(
        (sizes[0] // slices, *sizes[1:]), (slices, *[1] * (len(sizes) - 1)), devices
    )
    types = AxisType.Auto if axis_types is None else axis_types
    types = (types,) * len(axes) if isinstance(types, AxisType) else tuple(types)
    return Mesh(grid, tuple(n for n, _ in axes), axis_types=types)


def topology_mesh(
    topology: str,
    mesh_shape: Mapping[str, int] | Sequence[tuple[str, int]],
    *,
    slices: int = 1,
    axis_types: Sequence[AxisType] | AxisType | None = None,
) -> Mesh:
    """A mesh of the compile-only devices of a TPU or GPU topology: steps lower and compile for it, none runs.

    The state to place on it is abstract (``nnx.eval_shape``); see the guide "Plan a pod
    from a laptop". A TPU needs ``libtpu`` (``pip install 'substrax[tpu]'``), a GPU jax's
    CUDA plugin, ``ptxas`` and ``libdevice`` (``pip install 'substrax[gpu]'``); neither a
    TPU nor a GPU, and ``JAX_PLATFORMS=cpu`` for the GPU's.

    Args:
      topology: The slice's TPU type and chips, e.g. ``"v5e:2x4"`` (8 chips, 2 hosts),
        ``"v5e:16x16"`` or ``"v5e:1x1"`` (one chip); or a GPU and its slices x hosts x
        GPUs per host, e.g. ``"h100:1x1x8"`` (one host of 8 H100s), ``"h100:1x2x8"`` (two);
        the GPUs are ``substrax.mesh._gpu.GPUS``' keys (``h100``, ``h200``, ``a100``,
        ``b200``, ...), described by the installed CUDA plugin.
      mesh_shape: Axis name to size, as ``create_device_mesh`` takes it; the sizes multiply
        to the topology's devices (times ``slices``).
      slices: TPU slices joined over the data-center network (DCN); the first axis spans
        them (its size a multiple of ``slices``), the others stay within a slice. A GPU's
        hosts are in its topology; its devices are laid out host after host.
      axis_types: As ``create_device_mesh``; ``AxisType.Auto`` by default.

    Returns:
      A ``jax.sharding.Mesh`` over the topology's devices.

    Raises:
      ImportError: If ``libtpu`` (TPU) or jax's CUDA plugin (GPU) is not installed (the
        message says what to install).
      RuntimeError: For a GPU, if ``ptxas`` or ``libdevice`` is missing (says what to install).
      TypeError: If ``topology`` is not a string or ``slices`` not an int.
      ValueError: If the topology is unknown, ``slices`` is below 1, the sizes do not multiply
        to the device count, or the first axis does not divide by ``slices``.
    """
    _check_args(topology, slices)
    gpu, _, chips = topology.partition(":")
    if gpu.lower() in GPUS:
        if slices != 1:
            raise ValueError(
                "slices is for TPU topologies; write a GPU's hosts in the topology, such as 'h100:1x2x8'."
            )
        devices = gpu_devices(gpu, chips)
        _check_count(mesh_shape, devices, topology, 1)
        return create_device_mesh(mesh_shape, devices, axis_types=axis_types)
    devices = _tpu_devices(topology, slices)
    axes = _axes(mesh_shape)
    _check_count(mesh_shape, devices, topology, slices)
    if slices == 1:
        return create_device_mesh(axes, devices, axis_types=axis_types)
    return _sliced_mesh(axes, devices, slices, axis_types)
