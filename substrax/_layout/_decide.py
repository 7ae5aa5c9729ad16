"""What ``shard_state`` decides before anything moves: each array's spec, the units, the stages."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from substrax._base.specs import spec_axes
from substrax._base.trees import path_str
from substrax._layout._owners import flat_state, follow_dim, optimizer_followers, optimizer_mirrors
from substrax._layout._report import LayoutKind, LeftWhole
from substrax._layout._specs import (
    check_declared_rank,
    choose_split_dim,
    declared_spec,
    with_axis,
    without_axis,
)
from substrax._layout._stages import STAGE_AXIS, find_stages
from substrax._layout._units import UnitsSpec, find_units, stacked_modules

__all__ = ["ShardDecision", "decide"]

KeyPath = tuple[Any, ...]
Spec = tuple[Any, ...]
Leaf = tuple[str, KeyPath]  # ("model" or "optimizer", the variable's path)
Variables = dict[str, dict[KeyPath, nnx.Variable[Any]]]


@dataclasses.dataclass(frozen=True)
class ShardDecision:
    """What ``shard_state`` places where, decided from the state without moving it.

    Attributes:
      mesh: The concrete mesh.
      layout: The layout asked for.
      kind: The layout the state gets: ``layout``, or ``"replicated"`` when no parameter splits.
      axis: The data axis.
      min_size: Parameters with fewer elements stay replicated.
      replica_axis: ``"hsdp"``'s outer axis, recorded on the parameters.
      specs: Each array's spec by ``(owner, path)``, in the order placed.
      declared: The ``declared_sharding`` metadata to set by ``(owner, path)``: a variable's
        own declaration where the mesh lacks an axis of it, else ``None`` (cleared).
      units: The FSDP units' paths.
      reshard_after_forward: With ``units``: gather a unit again for its backward pass.
      prefetch: With ``units``: a stacked unit gathers layer i+1 while layer i computes.
      stage: The pipelined stack's path, or ``None``.
      virtual_stages: The chunks of the stack each stage runs (an interleaved schedule's).
      left_whole: The parameters a splitting layout leaves whole, and why.
    """

    mesh: Mesh
    layout: LayoutKind
    kind: LayoutKind
    axis: str
    min_size: int
    replica_axis: str
    specs: dict[Leaf, Spec]
    declared: dict[Leaf, Spec | None]
    units: tuple[KeyPath, ...]
    reshard_after_forward: bool
    prefetch: bool
    stage: KeyPath | None
    left_whole: tuple[LeftWhole, ...]
    virtual_stages: int = 1

    @property
    def size(self) -> int:
        """The data axis's size (1 on a mesh without it)."""
        return int(self.mesh.shape.get(self.axis, 1))


def _joined(kept: list[tuple[str, ...]]) -> Spec:
    """Each dimension's kept axes as one spec entry: ``None``, one axis, or a tuple of them."""
    return tuple(None if not k else k[0] if len(k) == 1 else k for k in kept)


def _without_stage(spec: Spec | None) -> Spec | None:
    """A declared spec without the ``stage`` axis: the pipeline's split is the layout's, placed anew."""
    if spec is None:
        return None
    return _joined([tuple(a for a in spec_axes(e) if a != STAGE_AXIS) for e in spec])


def _base(variable: nnx.Variable[Any], said: Spec | None, axis: str, mesh: Mesh) -> Spec:
    """The variable's own splits over the mesh's other axes (one over an axis it lacks: none)."""
    spec = without_axis(said, np.ndim(variable.get_value()), axis)
    return _joined([tuple(a for a in spec_axes(e) if a in mesh.axis_names) for e in spec])


def _why_whole(shape: tuple[int, ...], size: int, min_size: int) -> Any:
    """Why a parameter no dimension of which the layout may take stays whole."""
    if not shape or math.prod(shape) < min_size:
        return "small"
    return "taken" if choose_split_dim(shape, size, min_size) is not None else "indivisible"


def _follower_spec(shape: tuple[int, ...], leaf_shape: tuple[int, ...], split: Spec, mesh: Mesh) -> Spec:
    """An optimizer leaf of another shape than its parameter: split where it follows ``split``."""
    spec: list[Any] = [None] * len(leaf_shape)
    for d, entry in enumerate(split):
        on = follow_dim(shape, leaf_shape, d if entry is not None else None)
        ways = math.prod(mesh.shape[a] for a in spec_axes(entry))
        if on is not None and leaf_shape[on] % ways == 0:
            spec[on] = entry
    return tuple(spec)


def _declared(variables: Variables, said: dict[Leaf, Spec | None], mesh: Mesh) -> dict[Leaf, Spec | None]:
    """Each declaration kept across meshes that lack an axis of it; one the mesh covers, cleared."""
    declared = {}
    for (owner, path), spec in said.items():
        lacking = any(a not in mesh.axis_names for e in spec or () for a in spec_axes(e))
        if lacking or variables[owner][path].get_metadata().get("declared_sharding") is not None:
            declared[owner, path] = spec if lacking else None
    return declared


def decide(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    mesh: Mesh,
    *,
    layout: LayoutKind,
    axis: str,
    min_size: int,
    units: UnitsSpec,
    reshard_after_forward: bool,
    prefetch: bool,
    replica_axis: str,
    stages: UnitsSpec,
    virtual_stages: int = 1,
) -> ShardDecision:
    """``shard_state``'s decision for a checked ``layout`` on a concrete ``mesh``; moves nothing.

    Raises ``shard_state``'s errors about ``stages``, ``units``, ``prefetch``, the optimizer
    and the declared ranks.
    """
    stage = find_stages(model, stages, mesh, virtual_stages=virtual_stages)
    if stage is not None and prefetch:
        raise ValueError(
            "prefetch=True runs a stacked unit in the step's own loop, and stages= runs the stack as a "
            "pipeline, each stage its layers; they do not combine. Drop prefetch= (units= alone gathers "
            "each layer just in time within a stage)."
        )
    mirrors = optimizer_mirrors(model, optimizer)
    followers = optimizer_followers(model, optimizer)
    variables: Variables = {"model": dict(flat_state(model)), "optimizer": dict(flat_state(optimizer))}
    said = {  # each variable's own declaration, kept across meshes that lack an axis of it
        (owner, path): _without_stage(v.get_metadata().get("declared_sharding") or declared_spec(v))
        for owner, of_owner in variables.items()
        for path, v in of_owner.items()
    }
    for path, variable in variables["model"].items():  # a stacked layer's declaration one dimension off
        check_declared_rank(variable, said["model", path] or (), path_str(path, "model"))
    unit_list = find_units(model, units, reshard_after_forward, prefetch)
    stacks = stacked_modules(model, unit_list + ([stage] if stage is not None else []))
    size = mesh.shape.get(axis, 1)
    splitting = layout != "replicated" and axis in mesh.axis_names  # without the data axis: nothing splits
    bases = {p: _base(variables["model"][p], said["model", p], axis, mesh) for p in mirrors}
    specs: dict[Leaf, Spec] = {}
    left_whole = []
    for path, mirror_paths in mirrors.items():
        shape = tuple(np.shape(variables["model"][path].get_value()))
        base = bases[path]  # the layer's own (model-axis) splits
        if stage is not None and path[: len(stage)] == stage:
            base = (STAGE_AXIS, *base[1:])  # the pipeline's: consecutive layers a stage
        # a stack's layer axis stays whole over data: nnx.scan hands each layer its slice
        taken = ("layers", *base[1:]) if any(path[: len(u)] == u for u in stacks) else base
        dim = choose_split_dim(shape, size, min_size, taken) if splitting else None
        if dim is None and splitting:
            left_whole.append(LeftWhole(path_str(path, "model"), shape, _why_whole(shape, size, min_size)))
        split = with_axis(base, dim, axis)
        specs["model", path] = split if layout in ("fsdp", "hsdp") else base
        specs.update({("optimizer", m): split for m in mirror_paths})
        for f in followers[path]:
            leaf_shape = tuple(np.shape(variables["optimizer"][f].get_value()))
            specs["optimizer", f] = _follower_spec(shape, leaf_shape, split, mesh)
    for owner, of_owner in variables.items():
        for path, variable in of_owner.items():  # everything else: replicated on the mesh
            if (owner, path) not in specs and hasattr(variable.get_value(), "shape"):
                specs[owner, path] = _base(variable, said[owner, path], axis, mesh)
                staged = stage is not None and path[: len(stage)] == stage and variable.get_value().shape
                if owner == "model" and staged:  # a stacked random stream: a stage's layers' counts
                    specs[owner, path] = (STAGE_AXIS, *specs[owner, path][1:])
    shapes = {p: tuple(np.shape(variables["model"][p].get_value())) for p in mirrors}
    splits = axis in mesh.axis_names and any(
        choose_split_dim(shapes[p], size, min_size, bases[p]) is not None for p in mirrors
    )
    return ShardDecision(
        mesh, layout, layout if splits else "replicated", axis, min_size, replica_axis, specs,
        _declared(variables, said, mesh), tuple(unit_list), reshard_after_forward, prefetch, stage,
        tuple(left_whole), virtual_stages,
    )  # fmt: skip
