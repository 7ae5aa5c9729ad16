"""The implicit data-parallel step: differentiate the global loss, let XLA all-reduce."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
from flax import nnx

from substrax._batch.placement import batch_partition_specs
from substrax._layout import check_mesh_axes, check_replica_axis
from substrax._shared.microbatch import check_microbatches, unfold_global_gather
from substrax._shared.options import ModeSteps, StepOptions, options_from
from substrax._shared.precision import MixedPrecision
from substrax._shared.update import update_step
from substrax.mesh import current_mesh, mesh_in_effect
from substrax.spmd._grad import global_value_and_grad
from substrax.spmd._metrics import reduce_metrics

PyTree = Any
M = TypeVar("M", bound=nnx.Module)


def check_placement(model: nnx.Module) -> None:
    """Nothing to refuse: XLA follows any sharding the arrays carry."""


def spmd_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    has_aux: bool = False,
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: Any = None,
    reduce: Mapping[str, str | None] | None = None,
    microbatches: int = 1,
    skip_nonfinite: bool = True,
    precision: MixedPrecision | None = None,
) -> jax.Array | tuple[jax.Array, Any]:
    """Execute a data-parallel training step using SPMD: XLA inserts the gradient all-reduce.

    Call it inside ``@nnx.jit`` with a mesh set: the batch is split over ``data_axis`` (on a
    mesh without it, not split: a data axis of one device) and ``shard_state``'s layout kept
    (see the modes guide); with no mesh set, a plain step. The keyword options are
    ``make_train_step``'s; here ``reduce=None`` returns ``aux`` as ``loss_fn`` gave it.

    Args:
      model: The NNX model to train.
      optimizer: The NNX optimizer wrapping the model.
      loss_fn: ``(model, batch) -> loss`` scalar; with ``has_aux``,
        ``(model, batch) -> (loss, aux)``.
      batch: The training batch (should be pre-sharded, see ``place_batch_on_shards``).

    Returns:
      The loss value; with ``has_aux``, ``(loss, aux)``.

    Example:
      With ``model``, its ``optimizer``, ``loss_fn`` and a host ``batch`` of 64 rows
      (``docs/snippets/setup.py`` builds them):

      >>> import jax
      >>> from flax import nnx
      >>> from substrax.mesh import DeviceMeshManager
      >>> from substrax.spmd import spmd_train_step
      >>> mesh = DeviceMeshManager.create_device_mesh({"data": jax.device_count()})
      >>> @nnx.jit
      ... def train_step(model, optimizer, batch):
      ...     return spmd_train_step(model, optimizer, loss_fn, batch)
      >>> with jax.set_mesh(mesh):
      ...     loss = train_step(model, optimizer, batch)
      >>> loss.shape
      ()
    """
    options = options_from(locals())  # the keywords above, checked once
    return run_step(model, optimizer, loss_fn, batch, options)[0]


def global_gradients(
    model: M, loss_fn: Callable[[M, PyTree], Any], batch: PyTree, options: StepOptions
) -> tuple[tuple[jax.Array, Any], nnx.State, int, Any]:
    """The step's gradient half: ``((loss, aux), grads, ways, mesh)``; ``ways``: the devices the
    rows are split over (with microbatches), ``mesh``: the one the batch is split over, or None."""
    o = options
    found = mesh_in_effect(o.mesh)  # the mesh the step runs on, or None: a plain step
    if found is None and (o.batch_spec is not None or o.microbatches > 1 or o.schedule is not None):
        current_mesh(o.mesh)  # raises, naming what is missing
    specs = None
    if found is not None:
        roles = o.roles(found, model)  # checked
        rows = roles.rows  # data, or (replica, data) for hybrid sharding
        check_mesh_axes(model, found, "model")
        check_replica_axis(model, o.replica_axis, rows)
        specs = batch_partition_specs(batch, o.batch_spec, found, rows)
        roles.check_batch(specs)
        check_microbatches(o.microbatches, batch, specs, found, rows)
        batch = jax.lax.with_sharding_constraint(batch, specs)
    out, grads, ways = global_value_and_grad(loss_fn, model, batch, o, found, specs)
    return out, grads, ways, found


def run_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    options: StepOptions,
) -> tuple[Any, jax.Array | None]:
    """``spmd_train_step`` with its keywords as one ``StepOptions``; also whether the update applied.

    Returns:
      ``(out, applied)``: what ``spmd_train_step`` returns, and ``apply_update``'s flag.
    """
    o = options
    out, applied, ways, found = update_step(_value_and_grad, model, optimizer, loss_fn, batch, o)
    if not o.has_aux or o.reduce is None:
        return out, applied
    loss, aux = out
    if o.microbatches > 1:
        aux = {n: unfold_global_gather(v, ways) if o.reduce.get(n) == "gather" else v for n, v in aux.items()}
    return (loss, reduce_metrics(aux, o.reduce, mesh=found)), applied


def _value_and_grad(
    model: M, optimizer: Any, loss_fn: Callable[..., Any], batch: PyTree, o: StepOptions
) -> Any:
    """``global_gradients`` as ``update_step`` takes it: ``(loss, aux, grads, ways, mesh)``."""
    (loss, aux), grads, ways, found = global_gradients(model, loss_fn, batch, o)
    return loss, aux, grads, ways, found


STEPS = ModeSteps(
    run_step, check_placement, lambda model, loss_fn, batch, o: global_gradients(model, loss_fn, batch, o)[1]
)
