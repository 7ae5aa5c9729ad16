"""Compile-only NVIDIA GPU devices: XLA's device descriptions, read from the installed CUDA plugin.

No description is copied here: XLA's (H100, H200, A100, B200, ...) are text inside the plugin's
``xla_cuda_plugin.so``; ``description`` reads one out at run time. See the guide "Plan a pod from a
laptop".
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import re
import shutil
import sys
from typing import Any

__all__ = ["GPUS", "cuda_tools", "description", "device_memory", "gpu_devices"]

INSTALL = "pip install 'substrax[gpu]'"

# The names users know, to the name XLA's description gives (its ``device_description_str``).
GPUS = {
    "h100": "NVIDIA H100 80GB HBM3",
    "h100-pcie": "NVIDIA H100 PCIe",
    "h200": "NVIDIA H200 141GB HBM3e",
    "a100": "NVIDIA A100-SXM4-80GB",
    "a100-40gb": "NVIDIA A100-SXM4-40GB",
    "b200": "NVIDIA B200",
    "gb200": "NVIDIA GB200",
}

_PLUGIN = "jax_plugins.xla_cuda13"
_KEY = b'device_description_str: "'


def _plugin_spec() -> Any:
    """The plugin's module spec, or ``None`` where it (or its namespace, ``jax_plugins``) is absent."""
    try:
        return importlib.util.find_spec(_PLUGIN)
    except ModuleNotFoundError:  # find_spec imports the parent package first
        return None


def plugin_installed() -> bool:
    """Whether jax's CUDA plugin is installed (``pip install 'substrax[gpu]'``)."""
    return _plugin_spec() is not None


def _plugin_library() -> str:
    """The path of the installed plugin's ``xla_cuda_plugin.so``.

    Raises:
      ImportError: If the plugin is not installed; the message says what to install.
    """
    spec = _plugin_spec()
    path = (
        None
        if spec is None or not spec.origin
        else os.path.join(os.path.dirname(spec.origin), "xla_cuda_plugin.so")
    )
    if path is None or not os.path.exists(path):
        raise ImportError(
            "Compiling for NVIDIA GPUs without one needs jax's CUDA plugin, which is not installed: "
            f"{INSTALL} (or pip install jax-cuda13-plugin jax-cuda13-pjrt matching jax, without "
            "the with-cuda extra)."
        )
    return path


@functools.cache
def _descriptions(path: str) -> dict[str, str]:
    """Every GPU description in the plugin at ``path``, by name: each a NUL-ended text proto."""
    found = {}
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(_KEY)
        while at >= 0:
            name = data[at + len(_KEY) : data.find(b'"', at + len(_KEY))].decode()
            text = data[data.rfind(b"\0", 0, at) + 1 : data.find(b"\0", at)].decode(errors="replace")
            if "gpu_device_info {" in text and name not in found:
                found[name] = text[: text.index("\n", text.index(f'{_KEY.decode()}{name}"'))] + "\n"
            at = data.find(_KEY, at + len(_KEY))
    return found


def description(gpu: str) -> str:
    """XLA's description of ``gpu`` (a ``GPUS`` key or XLA's name), a ``GpuTargetConfigProto`` in text.

    Raises:
      ImportError: If the CUDA plugin is not installed.
      ValueError: If the plugin has no such GPU; the message lists the names it has.
    """
    name = GPUS.get(gpu.lower(), gpu)
    known = _descriptions(_plugin_library())
    if name not in known:
        nvidia = sorted(n for n in known if n.startswith(("NVIDIA", "Tesla")))
        raise ValueError(
            f"Unknown GPU {gpu!r}: write one of {sorted(GPUS)} or a name the installed CUDA plugin "
            f"describes: {nvidia}."
        )
    return known[name]


def _memory_of(text: str) -> int:
    return int(re.search(r"device_memory_size: (\d+)", text).group(1))  # type: ignore[union-attr]


# What a TPU chip reports as ``memory_stats()["bytes_limit"]``, for its compile-only devices, which
# report nothing: read on a borrowed v5e (jax 0.10.2, libtpu 0.0.42.1; its compiler's "available HBM
# (15.75G)"). Other kinds are left unknown rather than guessed from their data sheets.
TPU_BYTES = {"TPU v5 lite": 16_909_336_064}


def device_memory(mesh: Any) -> int | None:
    """The memory in bytes of each device of ``mesh`` (or of one device); ``None`` where unknown.

    A GPU's from its description in the CUDA plugin (an H100 80GB: 84,942,979,072 B), for
    compile-only devices too (the GPU compiler compiles what does not fit); else what the
    device reports (``memory_stats()["bytes_limit"]``; a CPU reports nothing), or for a
    compile-only TPU what its kind reported on a chip (``TPU_BYTES``: a v5e's 16,909,336,064 B).
    """
    devices = getattr(mesh, "devices", None)
    device = devices.flat[0] if devices is not None and hasattr(devices, "flat") else mesh
    if getattr(device, "platform", None) == "gpu":
        try:
            text = _descriptions(_plugin_library()).get(getattr(device, "device_kind", ""))
        except ImportError:
            text = None
        if text is not None:
            return _memory_of(text)
    try:
        stats = device.memory_stats() or {}
    except (RuntimeError, NotImplementedError, AttributeError):  # compile-only devices have none
        stats = {}
    limit = stats.get("bytes_limit") or (
        TPU_BYTES.get(getattr(device, "device_kind", ""))
        if getattr(device, "platform", None) == "tpu"
        else None
    )
    return int(limit) if limit else None


def _site_packages_cuda() -> list[str]:
    """The CUDA directories of the ``nvidia-cuda-nvcc`` and ``nvidia-nvvm`` wheels (``nvidia/cu13``)."""
    roots = []
    for entry in sys.path:
        for sub in ("nvidia/cu13", "nvidia/cuda_nvcc"):
            if os.path.isdir(os.path.join(entry, sub)):
                roots.append(os.path.join(entry, sub))
    return roots


def cuda_tools() -> dict[str, str | None]:
    """Where ``ptxas`` and ``libdevice`` are, as XLA looks for them: the wheels, ``CUDA_HOME``, the system."""
    roots = [*_site_packages_cuda()]
    for variable in ("CUDA_HOME", "CUDA_PATH", "CUDA_DIR"):
        if os.environ.get(variable):
            roots.append(os.environ[variable])
    roots.append("/usr/local/cuda")
    ptxas = next(
        (os.path.join(r, "bin", "ptxas") for r in roots if os.path.exists(os.path.join(r, "bin", "ptxas"))),
        None,
    ) or shutil.which("ptxas")
    libdevice = next(
        (
            os.path.join(r, "nvvm", "libdevice", "libdevice.10.bc")
            for r in roots
            if os.path.exists(os.path.join(r, "nvvm", "libdevice", "libdevice.10.bc"))
        ),
        None,
    )
    return {"ptxas": ptxas, "libdevice": libdevice}


def gpu_devices(gpu: str, topology: str) -> list[Any]:
    """The compile-only devices of ``topology`` (``"1x1x8"``: slices x hosts x GPUs per host) of ``gpu``.

    Raises:
      ImportError: If the plugin is not installed.
      RuntimeError: If ``ptxas`` or ``libdevice`` is missing; the message says what to install.
      ValueError: If the GPU or the topology is unknown.
    """
    text = description(gpu)
    if not re.fullmatch(r"[1-9]\d*x[1-9]\d*x[1-9]\d*", topology):
        raise ValueError(
            f"GPU topology {topology!r} must read slices x hosts x GPUs per host, such as '1x1x8' "
            f"(one host of 8) or '1x2x8' (two hosts of 8)."
        )
    tools = cuda_tools()
    missing = [
        f"{what} (pip install {wheel})"
        for what, wheel in (("ptxas", "nvidia-cuda-nvcc"), ("libdevice", "nvidia-nvvm"))
        if tools[what] is None
    ]
    if missing:
        raise RuntimeError(
            f"Compiling for {gpu} needs CUDA's {' and '.join(missing)}, not found in the nvidia wheels, "
            f"CUDA_HOME or /usr/local/cuda: {INSTALL} installs both."
        )
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no GPU, no driver to check
    _register_plugin()
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="cuda", target_config=text, topology=topology).devices)


def _register_plugin() -> None:
    """Register the CUDA plugin where jax found its plugins before the constraints check was skipped.

    jax discovers its plugins once per process; where that ran first (any backend started with
    ``JAX_PLATFORMS`` unset: ``jax.devices()``), the plugin checked the CUDA driver, found none
    and stayed unregistered: no topology for ``cuda``. Initialized again, now without the check.
    """
    from jax._src import xla_bridge  # private: where another jax lacks these, the topology call says why

    discover = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    factories = getattr(xla_bridge, "_topology_factories", None)
    if discover is None or factories is None:
        return
    discover()
    if "cuda" not in factories:
        importlib.import_module(_PLUGIN).initialize()
