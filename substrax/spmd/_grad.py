"""The implicit gradient rule: differentiate the global loss; XLA inserts the reduction.

Under ``jax.jit`` with the batch split, ``grad`` of the mean over the global batch is
already the full-batch gradient: no ``pmean`` is written (see the modes guide, "The
gradient rule"). The twin of ``substrax.explicit._grad``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax._base.specs import spec_axes
from substrax._base.trees import PyTree
from substrax._layout import spec_tuple, without_axes
from substrax._shared.loss import loss_and_metrics
from substrax._shared.microbatch import microbatched, split_global_microbatches
from substrax._shared.options import StepOptions
from substrax._shared.pipeline import pipeline_of
from substrax.spmd._pipeline import pipelined_value_and_grad

__all__ = ["gathered_for_use", "global_value_and_grad"]


def gathered_for_use(model: nnx.Module, mesh: jax.sharding.Mesh, rows: tuple[str, ...]) -> None:
    """Constrain each parameter split over ``rows`` (the batch's axes) whole over them, where it is used.

    XLA then gathers the parameter and reduces its gradient, as the layout says, instead of
    moving activations (the layouts guide). Other axes (a layer's own ``model`` split) are kept.
    """
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        spec = spec_tuple(variable)
        if not spec or not set(rows) & {a for e in spec for a in spec_axes(e)}:
            continue
        kept = PartitionSpec(*without_axes(spec, rows))
        variable.set_value(jax.lax.with_sharding_constraint(variable.get_value(), NamedSharding(mesh, kept)))


def global_value_and_grad(
    loss_fn: Callable[..., Any],
    model: nnx.Module,
    batch: PyTree,
    options: StepOptions,
    mesh: jax.sharding.Mesh | None,
    specs: PyTree,
) -> tuple[tuple[jax.Array, Any], nnx.State, int]:
    """``((loss, aux), grads, ways)`` of ``loss_fn`` on the global ``batch``.

    With ``options.microbatches > 1`` the batch (placed by ``specs`` on ``mesh``) is cut into
    that many slices of every device's rows and the gradient accumulated; ``ways`` is the
    number of devices the rows are split over (1 without microbatches).
    """
    o = options
    run_loss = loss_fn if o.precision is None else o.precision.loss_fn(loss_fn, o.has_aux)

    def checked_loss(model: nnx.Module, batch: PyTree) -> tuple[Any, Any]:
        if mesh is not None:
            gathered_for_use(model, mesh, spec_axes(o.row_axes(mesh)))
        return loss_and_metrics(run_loss(model, batch), o.has_aux)

    if o.precision is None:
        value_and_grad = nnx.value_and_grad(checked_loss, has_aux=True)
    else:
        value_and_grad = o.precision.value_and_grad(checked_loss)
    stack = pipeline_of(o, mesh, model)  # the staged stack's path, or None: no pipeline
    if o.microbatches == 1 and stack is None:
        out, grads = value_and_grad(model, batch)
        return out, grads, 1
    assert mesh is not None  # run_step refuses microbatches without a mesh
    rows = spec_axes(o.row_axes(mesh))
    ways = math.prod(mesh.shape[a] for a in rows)
    slices = split_global_microbatches(batch, specs, ways, o.microbatches, rows)
    if stack is not None:
        out, grads = pipelined_value_and_grad(
            checked_loss, model, slices, mesh=mesh, rows=rows, schedule=o.schedule,
            microbatches=o.microbatches, stack_path=stack,
        )  # fmt: skip
        return out, grads, ways
    out, grads = microbatched(value_and_grad, model, slices)
    return out, grads, ways
