"""The accelerators a step can be predicted for: each one's peak, memory bandwidth and links.

Every number is a public one, from the maker's data sheet (the sources are listed in the planning
guide, "The targets"); ``Target`` is a frozen dataclass, so a user overrides a number with
``dataclasses.replace(TARGETS["v5e"], hbm_bytes_per_s=...)`` and passes it as ``target=``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["LINKS", "TARGETS", "Target", "target_of"]

LINKS = ("ici", "dcn", "nvlink", "network")
"""The link kinds: within a TPU slice (ICI), across TPU slices (the data-center network, DCN),
within a GPU host (NVLink), across GPU hosts (the network)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One accelerator's numbers, per chip (TPU) or GPU, as the step's time model reads them.

    Attributes:
      name: Its short name (``"v5e"``, ``"h100"``).
      device_kinds: The ``device_kind`` strings jax gives its devices (``"TPU v5 lite"``).
      flops: Peak dense bfloat16 matrix FLOP/s.
      f32_flops: FLOP/s of a float32 matrix product at the default precision (a TPU runs it in
        one bfloat16 pass, at ``flops``; a GPU in TF32).
      hbm_bytes_per_s: Memory (HBM) bandwidth, bytes per second.
      links: Bytes per second one chip moves in one direction over each link kind it has
        (``LINKS``): within a TPU slice the all-reduce bandwidth per chip the maker gives (ICI);
        across slices, hosts or within a GPU host, the chip's share of the network or NVLink.
      sources: Where each number comes from (the data sheets' addresses).
    """

    name: str
    device_kinds: tuple[str, ...]
    flops: float
    f32_flops: float
    hbm_bytes_per_s: float
    links: Mapping[str, float]
    sources: tuple[str, ...] = ()

    def link(self, kind: str) -> float:
        """The bandwidth of link ``kind``; raises ``ValueError`` naming the kinds it has."""
        if kind not in self.links:
            raise ValueError(
                f"target {self.name!r} has no {kind!r} link; it has {sorted(self.links)}: give one with "
                f"dataclasses.replace(target, links={{**target.links, {kind!r}: BYTES_PER_S}})."
            )
        return self.links[kind]


_GOOGLE = "https://cloud.google.com/tpu/docs/"
_TB, _GB = 1e12, 1e9

TARGETS: dict[str, Target] = {
    # ICI: the all-reduce bandwidth per Pod over the Pod's chips (v4: 1.1 PB/s over 4,096; v5e: 51.2 TB/s
    # over 256; v6e: 102.4 TB/s over 256); v5p: its 4,800 Gbps. DCN: the data-center network bandwidth
    # per Pod over its chips (v5e: 6.4 Tbps, v6e: 25.6 Tbps), v5p's 50 Gbps per chip; v4 states none
    # (v5p's taken).
    "v4": Target("v4", ("TPU v4",), 275e12, 275e12, 1200 * _GB,
                 {"ici": 1.1e15 / 4096, "dcn": 50e9 / 8}, (_GOOGLE + "v4", _GOOGLE + "v5p")),
    "v5e": Target("v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 197e12, 819 * _GB,
                  {"ici": 51.2 * _TB / 256, "dcn": 6.4e12 / 8 / 256}, (_GOOGLE + "v5e",)),
    "v5p": Target("v5p", ("TPU v5", "TPU v5p"), 459e12, 459e12, 2765 * _GB,
                  {"ici": 4800e9 / 8, "dcn": 50e9 / 8}, (_GOOGLE + "v5p",)),
    "v6e": Target("v6e", ("TPU v6 lite", "TPU v6e"), 918e12, 918e12, 1638 * _GB,
                  {"ici": 102.4 * _TB / 256, "dcn": 25.6e12 / 8 / 256}, (_GOOGLE + "v6e",)),
    # NVLink: the GPU's NVLink bandwidth in one direction (half the data sheet's bidirectional figure);
    # network: one 200 Gb/s (A100, DGX A100) or 400 Gb/s (H100, H200, B200: DGX) adapter per GPU.
    "a100": Target("a100", ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB"), 312e12, 156e12, 2039 * _GB,
                   {"nvlink": 300 * _GB, "network": 200e9 / 8},
                   ("https://www.nvidia.com/en-us/data-center/a100/",)),
    "h100": Target("h100", ("NVIDIA H100 80GB HBM3",), 989.4e12, 494.7e12, 3.35 * _TB,
                   {"nvlink": 450 * _GB, "network": 400e9 / 8},
                   ("https://www.nvidia.com/en-us/data-center/h100/",)),
    "h200": Target("h200", ("NVIDIA H200", "NVIDIA H200 141GB HBM3e"), 989.4e12, 494.7e12, 4.8 * _TB,
                   {"nvlink": 450 * _GB, "network": 400e9 / 8},
                   ("https://www.nvidia.com/en-us/data-center/h200/",)),
    "b200": Target("b200", ("NVIDIA B200",), 2.25e15, 1.125e15, 8 * _TB,
                   {"nvlink": 900 * _GB, "network": 400e9 / 8},
                   ("https://www.nvidia.com/en-us/data-center/hgx/",)),
}  # fmt: skip
"""The targets by short name. TPU v4, v5e, v5p, v6e; NVIDIA A100, H100, H200 (SXM), B200 (HGX)."""


def target_of(devices: Any, target: Target | str | None = None) -> Target | None:
    """The ``Target`` of a mesh's (or a device's) kind, ``target`` itself where given (a ``TARGETS``
    key or a ``Target``); ``None`` for a kind the table lacks (a CPU).

    Raises:
      TypeError: If ``target`` is neither a ``Target``, a name nor ``None``.
      ValueError: If ``target`` names no ``TARGETS`` entry.
    """
    if isinstance(target, Target):
        return target
    if isinstance(target, str):
        if target.lower() not in TARGETS:
            raise ValueError(f"unknown target {target!r}: name one of {sorted(TARGETS)}, or pass a Target.")
        return TARGETS[target.lower()]
    if target is not None:
        raise TypeError(f"target= takes a Target, one of {sorted(TARGETS)}, or None; got {target!r}.")
    flat = getattr(getattr(devices, "devices", None), "flat", None)
    kind = getattr(flat[0] if flat is not None else devices, "device_kind", "")
    return next((t for t in TARGETS.values() if kind in t.device_kinds), None)
