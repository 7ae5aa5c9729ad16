"""The mesh a step runs on and the platform a program is compiled for, as the census reads them."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from substrax._shared.options import StepOptions
from substrax.mesh import mesh_in_effect

__all__ = ["axis_sizes", "mesh_context", "mesh_of", "program_platform"]


def mesh_context(options: StepOptions) -> contextlib.AbstractContextManager[Any]:
    """``jax.set_mesh(options.mesh)``, or nothing when the step has no mesh of its own (as the step runs)."""
    return jax.set_mesh(options.mesh) if options.mesh is not None else contextlib.nullcontext()


def mesh_of(
    options: StepOptions, model: nnx.Module, optimizer: nnx.Optimizer[Any]
) -> jax.sharding.Mesh | None:
    """The concrete mesh the step runs on: its own, the state's, or the one set by ``jax.set_mesh``."""
    if isinstance(options.mesh, jax.sharding.Mesh):
        return options.mesh
    meshes = []
    for _, variable in nnx.to_flat_state(nnx.state((model, optimizer))):
        sharding = getattr(variable.get_value(), "sharding", None)
        mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        if isinstance(mesh, jax.sharding.Mesh):
            meshes.append(mesh)
    with_data = [m for m in meshes if options.data_axis in m.axis_names]  # a mesh may lack it (one device)
    found = (with_data or meshes or [mesh_in_effect()])[0]
    return found if isinstance(found, jax.sharding.Mesh) else None


def axis_sizes(options: StepOptions, model: nnx.Module, optimizer: nnx.Optimizer[Any]) -> dict[str, int]:
    """The sizes of the axes of the step's mesh (``mesh_of``), ``{}`` when none is known."""
    mesh = mesh_of(options, model, optimizer)
    return {} if mesh is None else dict(mesh.shape)


def program_platform(compiled: jax.stages.Compiled) -> str:
    """The platform ``compiled`` was compiled for (its devices': ``"tpu"`` for a topology mesh's),
    not the host's; jax's default backend for a program with neither arguments nor results."""
    for sharding in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings)):
        devices = getattr(sharding, "device_set", None)
        if devices:
            return str(next(iter(devices)).platform)
    return jax.default_backend()
