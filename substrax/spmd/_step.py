"""The implicit data-parallel step: differentiate the global loss, let XLA all-reduce."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, overload

import jax
import jax.numpy as jnp
from flax import nnx

from substrax._microbatch import check_microbatches, split_global_microbatches, unfold_global_gather
from substrax._placement import batch_partition_specs
from substrax._reductions import split_loss_output
from substrax._update import apply_update, state_values
from substrax.mesh import current_mesh
from substrax.spmd._metrics import reduce_metrics

PyTree = Any
M = TypeVar("M", bound=nnx.Module)


def _mesh_or_none(mesh: Any, data_axis: str) -> Any:
    """The mesh the step splits the batch over: ``mesh``, or the current one when it has ``data_axis``."""
    if mesh is not None:
        return current_mesh(mesh, required_axes=(data_axis,))
    try:
        found = current_mesh(None)
    except ValueError:
        return None
    return found if data_axis in found.axis_names else None


def _accumulated_value_and_grad(
    model: nnx.Module, loss_fn: Callable[..., Any], batch: PyTree, specs: PyTree, ways: int, microbatches: int
) -> tuple[Any, nnx.State]:
    """The mean loss (and stacked aux) and mean gradient over ``microbatches`` slices, in a ``lax.scan``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    slices = split_global_microbatches(batch, specs, ways, microbatches)

    def body(carry: tuple[Any, Any, Any], piece: PyTree) -> tuple[tuple[Any, Any, Any], Any]:
        params, rest, total = carry
        m = nnx.merge(graphdef, params, rest)
        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(m, piece)
        total = jax.tree.map(jnp.add, total, grads)
        return (params, nnx.state(m, nnx.Not(nnx.Param)), total), (loss, aux)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (_, rest, total), (losses, aux) = jax.lax.scan(body, (params, rest, zeros), slices)
    nnx.update(model, rest)
    return (jnp.mean(losses), aux), jax.tree.map(lambda g: g / microbatches, total)


@overload
def spmd_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], jax.Array],
    batch: PyTree,
    *,
    has_aux: Literal[False] = False,
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: Any = None,
    reduce: Mapping[str, str | None] | None = None,
    microbatches: int = 1,
    skip_nonfinite: bool = True,
) -> jax.Array: ...


@overload
def spmd_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], tuple[jax.Array, Any]],
    batch: PyTree,
    *,
    has_aux: Literal[True],
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: Any = None,
    reduce: Mapping[str, str | None] | None = None,
    microbatches: int = 1,
    skip_nonfinite: bool = True,
) -> tuple[jax.Array, Any]: ...


@overload
def spmd_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    has_aux: bool,
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: Any = None,
    reduce: Mapping[str, str | None] | None = None,
    microbatches: int = 1,
    skip_nonfinite: bool = True,
) -> jax.Array | tuple[jax.Array, Any]: ...


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
) -> jax.Array | tuple[jax.Array, Any]:
    """Execute a data-parallel training step using SPMD.

    Uses ``nnx.value_and_grad`` for automatic differentiation. The XLA compiler handles
    gradient AllReduce automatically when model parameters are sharded across devices
    via ``jax.set_mesh`` or explicit ``NamedSharding``: ``loss_fn`` sees the global
    batch, so its gradient is already the full one and needs no reduction.

    This function should be called inside an ``@nnx.jit`` decorated function with a
    mesh context active. When that mesh has ``data_axis``, the batch is constrained to
    be split over it (a host batch would otherwise run whole on every device), and
    every variable placed by ``substrax.shard_state`` is constrained to stay as placed,
    so a ZeRO-1 or FSDP layout survives the step.

    Args:
      model: The NNX model to train.
      optimizer: The NNX optimizer wrapping the model.
      loss_fn: Function ``(model, batch) -> loss`` scalar; with ``has_aux``,
        ``(model, batch) -> (loss, aux)``.
      batch: The training batch (should be pre-sharded, see ``place_batch_on_shards``).
      has_aux: Whether ``loss_fn`` also returns auxiliary values (metrics).
      mesh: The mesh; ``None`` takes the one set by ``jax.set_mesh``, if any.
      data_axis: The mesh axis the batch is split over.
      batch_spec: How the batch is split (see ``substrax.explicit.batch_partition_specs``).
      reduce: With ``has_aux``: ``None`` returns ``aux`` as ``loss_fn`` gave it; a
        mapping reduces a flat metrics mapping by name as ``make_train_step`` does
        (unlisted names get ``"mean"``).
      microbatches: Split the batch into this many microbatches, each holding every
        device's next rows, and accumulate their gradients in a ``lax.scan`` (see
        ``make_train_step``). ``aux`` then gains a leading microbatch axis, unless
        ``reduce`` reduces it.
      skip_nonfinite: Skip the update, in the graph, when the loss or a gradient is
        not finite: the model and optimizer keep their values and the step returns
        the non-finite loss (see ``substrax._update``).

    Returns:
      The loss value; with ``has_aux``, ``(loss, aux)``.

    Example:
      >>> mesh = DeviceMeshManager.create_device_mesh({"data": 4})
      >>> @nnx.jit
      ... def train_step(model, optimizer, batch):
      ...     return spmd_train_step(model, optimizer, my_loss_fn, batch)
      >>> with jax.set_mesh(mesh):
      ...     loss = train_step(model, optimizer, batch)
    """
    if reduce is not None and not has_aux:
        raise ValueError("reduce= says how to reduce metrics, which loss_fn returns only with has_aux=True.")
    check_microbatches(microbatches)
    found = _mesh_or_none(mesh, data_axis)
    if found is None and (batch_spec is not None or microbatches > 1):
        current_mesh(mesh, required_axes=(data_axis,))  # raises, naming what is missing
    specs = None
    if found is not None:
        specs = batch_partition_specs(batch, batch_spec, found, data_axis)
        check_microbatches(microbatches, batch, specs, found, data_axis)
        batch = jax.lax.with_sharding_constraint(batch, specs)

    before = state_values((model, optimizer)) if skip_nonfinite else None

    def checked_loss(model: M, batch: PyTree) -> tuple[Any, Any]:
        loss, aux = split_loss_output(loss_fn(model, batch), has_aux)
        return loss, aux

    if microbatches == 1:
        (loss, aux), grads = nnx.value_and_grad(checked_loss, has_aux=True)(model, batch)
        ways = 1
    else:
        ways = found.shape[data_axis]
        (loss, aux), grads = _accumulated_value_and_grad(
            model, checked_loss, batch, specs, ways, microbatches
        )
    apply_update(model, optimizer, grads, loss, before)
    if not has_aux:
        return loss
    if reduce is not None:
        if microbatches > 1:
            aux = {
                n: unfold_global_gather(v, ways) if reduce.get(n) == "gather" else v for n, v in aux.items()
            }
        aux = reduce_metrics(aux, reduce, mesh=found)
    return loss, aux
