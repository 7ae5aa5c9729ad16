"""The optimizer update compiled alone: its census, and what the step should communicate for it."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax._base import scopes
from substrax._base.trees import KeyPath
from substrax._layout import gradient_spec
from substrax._shared.compiled import cached
from substrax._shared.compiler import compiler_options
from substrax._shared.options import StepOptions
from substrax._shared.update import apply_update, donated_state, state_values
from substrax.census._expected import ExpectedCollective
from substrax.census._items import update_dims
from substrax.census._platform import mesh_context, mesh_of
from substrax.census._report import CensusReport, census
from substrax.census._text import short_op

__all__ = ["update_census", "update_items"]


def update_census(
    options: StepOptions, model: nnx.Module, optimizer: nnx.Optimizer[Any], loss_dtype: Any
) -> CensusReport | None:
    """The census of the step's optimizer update, lowered and compiled alone.

    Its arguments are placed as the step hands them over: the model's and the
    optimizer's state as placed, the gradients split over the data axis where the
    optimizer updates slices (``update_dims``) and replicated elsewhere, the loss a
    replicated scalar. ``None`` when no mesh is known.
    """
    mesh = mesh_of(options, model, optimizer)
    if mesh is None:
        return None
    axis = options.data_axis
    dims = update_dims(model, optimizer, axis)
    graphdef, state = nnx.split((model, optimizer))
    treedef = jax.tree.structure(state)
    arrays = jax.tree.leaves(state)

    def placed(path: KeyPath, variable: nnx.Variable[Any]) -> nnx.Variable[Any]:
        value = variable.get_value()
        spec = gradient_spec(variable, dims[path], axis)
        return variable.replace(
            jax.ShapeDtypeStruct(np.shape(value), value.dtype, sharding=NamedSharding(mesh, spec))
        )

    grads = nnx.from_flat_state(
        [(p, placed(tuple(p), v)) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    )
    loss = jax.ShapeDtypeStruct((), loss_dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    def update(arrays: list[jax.Array], grads: nnx.State, loss: jax.Array) -> list[jax.Array]:
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
        before = state_values((model, optimizer)) if options.skip_nonfinite else None
        with donated_state(True):  # the update the step runs after its gradients, as it runs: donated
            apply_update(model, optimizer, grads, loss, before)
        return jax.tree.leaves(nnx.state((model, optimizer)))

    pinned = compiler_options(mesh, options.mode)  # compiled as the step is (its TPU options)
    with mesh_context(options):
        lowered = jax.jit(update, donate_argnums=0, compiler_options=pinned).lower(arrays, grads, loss)
        compiled = cached(lowered, None, lowered.compile)  # once per program: plan's, then the census's
    return census(compiled, mesh=mesh)


def update_items(
    options: StepOptions, model: nnx.Module, optimizer: nnx.Optimizer[Any], loss_dtype: Any
) -> list[ExpectedCollective]:
    """What the update communicates, one expected buffer per buffer of ``update_census``.

    Each keeps the library scope it was compiled under (``substrax.update``,
    ``substrax.finite``), and must be compiled under the same one in the step; one the
    update runs in a loop of its own (muon's Newton-Schulz iterations in optax 0.2.5) is
    expected in a loop, with its bytes per step.
    """
    report = update_census(options, model, optimizer, loss_dtype)
    if report is None:
        return []
    return [
        ExpectedCollective(
            part.kind,
            f"update: {_operation(part.op_name)}",
            part.bytes_per_step,
            "update",
            scopes=(part.scope,),
            buffer=str(part.buffer),
            in_loop=part.row.in_loop,
        )
        for part in (p for row in report.rows for p in row.parts)
    ]


def _operation(op_name: str) -> str:
    """An operation's name from its library scope on (``substrax.update/...``), else its last steps."""
    at = op_name.find(scopes.PREFIX)
    return op_name[at:] if at >= 0 else short_op(op_name)
