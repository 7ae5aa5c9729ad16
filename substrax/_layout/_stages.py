"""Pipeline stages: the stack ``shard_state(..., stages=...)`` splits on its layer axis over ``stage``.

Each parameter of the staged stack records the stack's path in its metadata
(``pipeline_stack``); the steps read it back (``staged_stack``). See the pipelines guide.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from substrax._base.roles import STAGE_AXIS
from substrax._base.trees import KeyPath, path_str
from substrax._layout._units import UnitsSpec, matched_modules, stacked_modules

__all__ = [
    "CHUNKS_KEY",
    "STAGE_AXIS",
    "STAGE_KEY",
    "find_stages",
    "mark_stages",
    "staged_chunks",
    "staged_stack",
]

STAGE_KEY = "pipeline_stack"
CHUNKS_KEY = "pipeline_chunks"


def find_stages(
    model: nnx.Module, stages: UnitsSpec, mesh: Any, axis: str = STAGE_AXIS, virtual_stages: int = 1
) -> KeyPath | None:
    """The path of the stack ``stages`` matches, checked against ``mesh``'s ``axis`` (None: no pipeline).

    Raises:
      TypeError: If ``stages`` is not a module type, a tuple of them or a predicate, or
        ``virtual_stages`` not an int.
      ValueError: If ``virtual_stages`` is below 1, or above 1 without ``stages``; the mesh has
        ``axis`` but ``stages`` is None, or ``stages`` is given on
        a mesh without it; ``stages`` matches nothing (naming the module types), a module
        that is not a stack of layers (``nnx.vmap``), or two stacks; or the stages do not
        divide the stack's layers (naming the stack, its layers and the stages).
    """
    names = tuple(getattr(mesh, "axis_names", ()))
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
        raise TypeError(f"virtual_stages must be an int (chunks a stage); got {virtual_stages!r}.")
    if virtual_stages < 1 or (virtual_stages > 1 and stages is None):
        raise ValueError(
            f"virtual_stages={virtual_stages}: the chunks of the staged stack each stage runs, at least 1 "
            f"and only with stages= (shard_state(..., stages=Block, virtual_stages=2))."
        )
    if stages is None:
        if axis in names:
            raise ValueError(
                f"The mesh {dict(mesh.shape)} has a {axis!r} axis, the pipeline's, but shard_state was not "
                f"told which stack of layers to split over it. Pass stages= the stacked block's type "
                f"(shard_state(..., stages=Block)), or build the mesh without {axis!r}."
            )
        return None
    if axis not in names:
        raise ValueError(
            f"stages= splits a stack of layers over the mesh's {axis!r} axis, which the mesh "
            f"{dict(mesh.shape)} lacks. Build the mesh with it (create_device_mesh({{{axis!r}: S, "
            f"'data': D}})), or drop stages=."
        )
    found = matched_modules(model, stages, "stages")
    stacks = stacked_modules(model, found)
    for path in found:
        if path not in stacks or len(found) > 1:
            break
    else:
        return _checked_depth(model, found[0], mesh.shape[axis], axis, virtual_stages)
    if len(found) > 1:
        raise ValueError(
            f"stages= matched {len(found)} modules ({', '.join(path_str(p, 'model') for p in found[:4])}); a "
            f"pipeline splits one stack of layers. Stack the blocks into one module with nnx.vmap (the "
            f"Flax NNX idiom), or name one of them with a function (path, module) -> bool."
        )
    raise ValueError(
        f"stages= matched {path_str(found[0], 'model')}, which is not a stack of layers: its parameters do "
        f"not share a leading layer axis. Build the stack with nnx.vmap (transform_metadata={{nnx."
        f"PARTITION_NAME: None}}) and apply it with substrax.nn.scan_layers."
    )


def _checked_depth(model: nnx.Module, path: KeyPath, stages: int, axis: str, virtual: int) -> KeyPath:
    from substrax._base.trees import node_at

    leaves = [v for _, v in nnx.to_flat_state(nnx.state(node_at(model, path), nnx.Param))]
    layers = int(np.shape(leaves[0].get_value())[0])
    if virtual > 1 and layers % (stages * virtual):
        fits = [v for v in range(1, layers // stages + 1) if not layers % (v * stages)]
        raise ValueError(
            f"The stack {path_str(path, 'model')} has {layers} layers, which {stages} stages of {axis!r} x "
            f"virtual_stages={virtual} chunks do not divide (each chunk runs layers / (stages x "
            f"virtual_stages) consecutive layers). Use a depth that is a multiple of {stages * virtual}, or "
            f"virtual_stages among {fits}."
        )
    if layers % stages:
        fits = [n for n in range(1, layers + 1) if layers % n == 0]
        raise ValueError(
            f"The stack {path_str(path, 'model')} has {layers} layers, which the {stages} stages of {axis!r} "
            f"do not divide (each stage runs layers / stages consecutive layers). Use a {axis!r} size among "
            f"{fits}, or a depth that is a multiple of {stages}."
        )
    return path


def mark_stages(model: nnx.Module, path: KeyPath | None, virtual_stages: int = 1) -> None:
    """Write on each parameter of the stack at ``path`` its path (``STAGE_KEY``) and its chunks a
    stage (``CHUNKS_KEY``, above 1 only); clear them elsewhere."""
    for p, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        inside = path is not None and tuple(p)[: len(path)] == path
        if inside:
            variable.set_metadata(**{STAGE_KEY: path})
        elif variable.get_metadata().get(STAGE_KEY) is not None:
            variable.set_metadata(**{STAGE_KEY: None})
        if variable.get_metadata().get(CHUNKS_KEY) is not None or (inside and virtual_stages > 1):
            variable.set_metadata(**{CHUNKS_KEY: virtual_stages if inside and virtual_stages > 1 else None})


def staged_stack(model: nnx.Module) -> KeyPath | None:
    """The path of the stack ``shard_state`` split over ``stage``, read from the parameters, or None."""
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = variable.get_metadata().get(STAGE_KEY)
        if path is not None:
            return tuple(path)
    return None


def staged_chunks(model: nnx.Module) -> int:
    """The chunks a stage runs (``shard_state(..., virtual_stages=)``), read from the parameters (1 unset)."""
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        chunks = variable.get_metadata().get(CHUNKS_KEY)
        if chunks is not None:
            return int(chunks)
    return 1
