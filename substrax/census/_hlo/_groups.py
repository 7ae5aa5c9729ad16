"""A collective's replica groups, in any of HLO's three forms, and the mesh axes they span."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

import numpy as np

from ._module import closing

_MESH_GROUPS = re.compile(r"mesh\[(?P<axes>[^\]]*)\](?P<suffix>\S*)\s*\{(?P<selected>[^}]*)\}")
_IOTA_GROUPS = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")

Groups = tuple[tuple[int, ...], ...]


def _attribute(attrs: str, key: str) -> str | None:
    """The text after ``key=`` in an instruction's attributes (to their end), ``None`` when absent."""
    at = attrs.find(key + "=")
    return None if at < 0 else attrs[at + len(key) + 1 :]


def replica_groups(attrs: str, num_devices: int | None) -> tuple[str, Groups | None, tuple[str, ...] | None]:
    """The raw replica groups, the groups as device ids, and the axes the HLO names."""
    value = _attribute(attrs, "replica_groups")
    if value is None:
        return "", None, None
    mesh_form = _MESH_GROUPS.match(value)
    if mesh_form:
        return mesh_form[0], *_mesh_groups(mesh_form)
    iota = _IOTA_GROUPS.match(value)
    if iota:
        return iota[0], _iota_groups(iota), None
    if value.startswith("{"):
        raw = value[: closing(value, 0) + 1]
        listed = tuple(
            tuple(int(d) for d in re.findall(r"\d+", g)) for g in re.findall(r"\{([\d,\s]*)\}", raw[1:-1])
        )
        if listed:
            return raw, listed, None
        return raw, (tuple(range(num_devices)),) if num_devices else None, None
    return value.split(",")[0], None, None


def _mesh_groups(match: re.Match[str]) -> tuple[Groups | None, tuple[str, ...]]:
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']*)'\s*=\s*(\d+)", match["axes"])]
    selected = tuple(re.findall(r"'([^']*)'", match["selected"]))
    names = [name for name, _ in axes]
    if match["suffix"] or not axes or any(s not in names for s in selected):
        return None, selected  # a device order given after the mesh: not read here
    return _groups_over(axes, selected), selected


def _groups_over(axes: Sequence[tuple[str, int]], selected: Sequence[str]) -> Groups:
    """Logical device ids grouped over ``selected`` axes of a row-major mesh."""
    names = [name for name, _ in axes]
    ids = np.arange(math.prod(size for _, size in axes)).reshape([size for _, size in axes])
    moved = np.moveaxis(ids, [names.index(s) for s in selected], range(-len(selected), 0))
    size = math.prod(dict(axes)[s] for s in selected)
    return tuple(tuple(int(i) for i in g) for g in moved.reshape(-1, size))


def _iota_groups(match: re.Match[str]) -> Groups:
    shape = [int(d) for d in match["shape"].split(",")]
    dims = [int(d) for d in match["dims"].split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match["perm"]:
        ids = ids.transpose([int(p) for p in match["perm"].split(",")])
    return tuple(tuple(int(i) for i in g) for g in ids.reshape(shape[0], -1))


def source_target_pairs(attrs: str) -> tuple[tuple[int, int], ...] | None:
    """A collective-permute's ``(source, target)`` pairs, ``None`` when it states none."""
    value = _attribute(attrs, "source_target_pairs")
    if value is None:
        return None
    raw = value[: closing(value, 0) + 1]
    return tuple((int(s), int(t)) for s, t in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", raw))


def mesh_axes(
    groups: Groups | None,
    pairs: tuple[tuple[int, int], ...] | None,
    hlo_axes: tuple[str, ...] | None,
    mesh: tuple[tuple[str, int], ...] | None,
) -> tuple[str, ...] | None:
    """The axes of ``mesh`` (``(name, size)`` pairs) the groups or pairs span, else those the HLO names."""
    if mesh is not None and groups is not None:
        named = _axes_of_groups(groups, mesh)
        if named is not None:
            return named
    if mesh is not None and pairs:
        return _axes_of_pairs(pairs, mesh)
    return hlo_axes


def _axes_of_groups(groups: Groups, mesh: tuple[tuple[str, int], ...]) -> tuple[str, ...] | None:
    want = {frozenset(g) for g in groups}
    moving = [name for name, size in mesh if size > 1]
    for n in range(len(moving) + 1):
        for subset in itertools.combinations(moving, n):
            if {frozenset(g) for g in _groups_over(mesh, subset)} == want:
                return subset
    return None


def _axes_of_pairs(
    pairs: tuple[tuple[int, int], ...], mesh: tuple[tuple[str, int], ...]
) -> tuple[str, ...] | None:
    sizes = [size for _, size in mesh]
    total = math.prod(sizes)
    if any(not (0 <= s < total and 0 <= t < total) for s, t in pairs):
        return None
    differ: set[int] = set()
    for s, t in pairs:
        a, b = np.unravel_index(s, sizes), np.unravel_index(t, sizes)
        differ |= {i for i in range(len(sizes)) if a[i] != b[i]}
    return tuple(mesh[i][0] for i in sorted(differ))


def pair_shift(
    pairs: tuple[tuple[int, int], ...] | None, mesh: tuple[tuple[str, int], ...] | None
) -> int | None:
    """The one step every pair of a permute moves along the one mesh axis it moves on (``+1``: to
    the next index, no wrap-around), ``None`` when the pairs or the mesh do not say one."""
    if not pairs or mesh is None:
        return None
    sizes = [size for _, size in mesh]
    total = math.prod(sizes)
    if any(not (0 <= s < total and 0 <= t < total) for s, t in pairs):
        return None
    steps = set()
    for s, t in pairs:
        moved = np.asarray(np.unravel_index(t, sizes)) - np.asarray(np.unravel_index(s, sizes))
        axes = np.flatnonzero(moved)
        steps.add((int(axes[0]), int(moved[axes[0]])) if len(axes) == 1 else None)
    if len(steps) != 1 or None in steps:
        return None
    return next(iter(steps))[1]
