"""Which link each collective crosses, and how long it takes there.

A mesh axis whose devices lie in different TPU slices spans the data-center network (``"dcn"``),
else the slice's ICI; on GPUs an axis whose devices lie on different hosts spans the network,
else NVLink. A collective crosses the slowest link its axes span. Its time is its kind's
algorithm over its group of ``n``: a ring all-reduce sends ``2 (n - 1) / n`` of its bytes, an
all-gather, a reduce-scatter and an all-to-all ``(n - 1) / n``, a permute, a send or a
broadcast its bytes once; at the link's bandwidth per chip, with no latency term.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["axis_links", "collective_seconds", "link_of"]

_WITHIN = {"tpu": "ici", "gpu": "nvlink", "cuda": "nvlink"}
_ACROSS = {
    "tpu": ("dcn", "slice_index"),
    "gpu": ("network", "process_index"),
    "cuda": ("network", "process_index"),
}
_SLOWER = ("dcn", "network")


def axis_links(mesh: Any) -> dict[str, str]:
    """Each axis of ``mesh``'s link kind (``"ici"``, ``"dcn"``, ``"nvlink"``, ``"network"``); ``{}`` on
    a platform with none (a CPU)."""
    devices = np.asarray(mesh.devices)
    platform = str(devices.flat[0].platform)
    if platform not in _WITHIN:
        return {}
    across, attribute = _ACROSS[platform]
    where = np.vectorize(lambda d: int(getattr(d, attribute, 0) or 0))(devices)
    return {
        name: across if np.ptp(where, axis=i).any() else _WITHIN[platform]
        for i, name in enumerate(mesh.axis_names)
    }


def link_of(row: Any, links: Mapping[str, str], within: str) -> str:
    """The link a census row crosses: the slowest its axes span; ``within`` (the in-slice or in-host
    link) where its axes are unnamed."""
    kinds = [links.get(a, within) for a in row.axes or ()]
    slow = [k for k in kinds if k in _SLOWER]
    return slow[0] if slow else within


def collective_seconds(row: Any, bandwidth: float, devices: int | None = None) -> float:
    """One execution of census row ``row`` at ``bandwidth`` bytes per second, by its kind's algorithm
    over its group (``devices`` where the group is unknown)."""
    n = row.group_size or devices or 1
    if row.kind == "all-reduce":
        share = 2 * (n - 1) / n
    elif row.kind in ("all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all"):
        share = (n - 1) / n
    else:  # collective-permute, send, recv, collective-broadcast: the buffer once
        share = 1.0
    return share * row.bytes / bandwidth
