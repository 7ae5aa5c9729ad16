"""The explicit data-parallel step: the same step as ``spmd_train_step``, under ``jax.shard_map``.

Every collective the step runs is written here: the loss is ``pmean``-ed over the data
axis before ``grad`` (the gradient of the replicated parameters then arrives whole, see
``substrax.explicit._grad``), and metrics are reduced with the ``reduce_*_collective``
functions and ``all_gather``. ``check_vma=True`` is pinned, since the gradient rule
depends on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax._placement import batch_partition_specs
from substrax._tree import PyTree, path_str
from substrax.explicit._grad import data_parallel_value_and_grad, varying_axes
from substrax.explicit._metrics import reduce_metrics_collective
from substrax.mesh import current_mesh

__all__ = ["explicit_train_step", "explicit_value_and_grad"]

M = TypeVar("M", bound=nnx.Module)
BatchSpec = PartitionSpec | NamedSharding | PyTree


def _split_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., tuple[Any, Any]]:
    if has_aux:
        return loss_fn
    return lambda model, batch: (loss_fn(model, batch), {})


def explicit_value_and_grad(
    model: M,
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: BatchSpec | None = None,
) -> tuple[jax.Array, nnx.State]:
    """The global loss and the gradient of ``model``'s parameters, computed under shard_map.

    The gradient half of ``explicit_train_step``, without the update: what
    ``compare_gradients`` checks against the implicit path and a one-device reference.

    Args:
      model: The NNX model, its parameters replicated.
      loss_fn: ``(model, batch) -> loss``, on one device's shard.
      batch: The global batch.
      mesh: The mesh; ``None`` takes the one set by ``jax.set_mesh``.
      data_axis: The mesh axis the batch is split over.
      batch_spec: How to split the batch (see ``batch_partition_specs``).

    Returns:
      ``(loss, grads)``: the loss on the global batch and an ``nnx.State`` of gradients
      with respect to ``nnx.Param``, both replicated.
    """
    mesh = current_mesh(mesh, required_axes=(data_axis,))
    specs = batch_partition_specs(batch, batch_spec, mesh, data_axis)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]

    def per_device(params: nnx.State, rest: nnx.State, shard: PyTree) -> tuple[jax.Array, nnx.State]:
        def loss_of_params(params: nnx.State) -> jax.Array:
            return loss_fn(nnx.merge(graphdef, params, rest), shard)

        return data_parallel_value_and_grad(loss_of_params, data_axis)(params)

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), specs),
        out_specs=(PartitionSpec(), PartitionSpec()),
        check_vma=True,
    )
    return run(params, rest, batch)


@contextlib.contextmanager
def _per_device_random_streams(model: nnx.Module, data_axis: str) -> Iterator[None]:
    """Give each device its own random bits for one step: fold its index into every key.

    The model's ``nnx.Rngs`` are replicated, so without this every device would draw
    the same dropout mask for its shard. The keys are restored afterwards (only the
    streams' counts advance, equally on every device), so the state stays replicated.
    """
    keys = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.RngKey)]
    saved = [key.get_value() for key in keys]
    index = jax.lax.axis_index(data_axis)
    for key, value in zip(keys, saved, strict=True):
        key.set_value(jax.random.fold_in(value, index))
    try:
        yield
    finally:
        for key, value in zip(keys, saved, strict=True):
            key.set_value(value)


def _average_per_device_state(state: nnx.State, data_axis: str) -> nnx.State:
    """Average, over ``data_axis``, any state the step updated from this device's shard alone.

    Parameters and optimizer state come out equal on every device. State a layer
    updates from the batch it sees (BatchNorm's running statistics) differs per device
    and could not leave ``shard_map`` as replicated; the average keeps one model.
    """

    def average(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        axes = varying_axes(x)
        if axes is None or data_axis not in axes:
            return x
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, data_axis)
        owner = ("model", "optimizer")[path[0].key]  # nnx.state((model, optimizer)) keys them 0, 1
        raise ValueError(
            f"{path_str(path[1:], owner)} ({x.dtype}) was updated differently on each device "
            f"and cannot be averaged over {data_axis!r}; compute it from values reduced over "
            f"the axis, or keep it out of the model's state."
        )

    return jax.tree.map_with_path(average, state)


def explicit_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    mesh: Any = None,
    data_axis: str = "data",
    batch_spec: BatchSpec | None = None,
    has_aux: bool = False,
    reduce: Mapping[str, str | None] | None = None,
) -> jax.Array | tuple[jax.Array, dict[str, Any]]:
    """Execute a data-parallel training step with every collective written out.

    The explicit twin of ``substrax.spmd.spmd_train_step``, called the same way inside
    ``nnx.jit``. The body runs under ``jax.shard_map`` with ``check_vma=True``: each
    device sees its shard of the batch and the whole model and optimizer state,
    replicated. The loss is ``pmean``-ed over ``data_axis`` before differentiating, so
    each replicated parameter's gradient arrives as the full-batch gradient, equal on
    every device, and every device applies the same optimizer update.

    Non-parameter state that a layer updates from the shard it sees, such as
    BatchNorm's running statistics, is averaged over ``data_axis`` after the step, so
    every device keeps the same model. Such a layer normalizes with its shard's
    statistics; give ``nnx.BatchNorm`` ``axis_name=data_axis`` to use the global batch's.
    Random streams (``nnx.Rngs``, as ``nnx.Dropout`` uses) get the device's index
    folded into their keys for the step, so each shard draws its own mask.

    Args:
      model: The NNX model to train; its state is replicated over the mesh (a parameter
        sharded over a mesh axis would be gathered whole onto every device: use the
        implicit step for sharded parameters).
      optimizer: The NNX optimizer for ``model``; updated in place.
      loss_fn: ``(model, shard) -> loss`` on one device's shard, or, with ``has_aux``,
        ``(model, shard) -> (loss, metrics)`` with ``metrics`` a flat mapping from name
        to this shard's value.
      batch: The global batch (see ``substrax.spmd.place_batch_on_shards``).
      mesh: The mesh; ``None`` takes the one set by ``jax.set_mesh``.
      data_axis: The mesh axis the batch is split over; the loss is averaged over it.
        Other mesh axes (a ``model`` axis, say) see the same shard on every device.
      batch_spec: How ``shard_map`` splits the batch: one ``PartitionSpec``, or a pytree
        prefix of ``batch`` of ``PartitionSpec`` or ``NamedSharding`` leaves (the prefix
        convention of ``place_batch_on_shards``). Default: every leaf on ``data_axis``.
      has_aux: Whether ``loss_fn`` returns ``(loss, metrics)``.
      reduce: With ``has_aux``, metric name to ``"mean"``, ``"sum"``, ``"max"``,
        ``"min"``, ``"gather"`` (the per-example values of the global batch, in order)
        or ``None`` (the per-device values stacked on a leading device axis). Unlisted
        metrics get ``"mean"``. See ``reduce_metrics_collective``.

    Returns:
      The global batch's loss, replicated; with ``has_aux``, ``(loss, metrics)``.

    Raises:
      ValueError: If there is no mesh or it lacks ``data_axis``, if ``batch_spec`` does
        not fit the batch, if a leaf cannot be split over its axes, if ``loss_fn``'s
        output does not match ``has_aux``, if ``reduce`` is given without ``has_aux``,
        names a metric ``loss_fn`` does not return or an unknown operation; each message
        names the axis, leaf or metric.
    """
    if reduce is not None and not has_aux:
        raise ValueError("reduce= says how to reduce metrics, which loss_fn returns only with has_aux=True.")
    mesh = current_mesh(mesh, required_axes=(data_axis,))
    specs = batch_partition_specs(batch, batch_spec, mesh, data_axis)
    graphdef, state = nnx.split((model, optimizer))
    split_loss = _split_loss(loss_fn, has_aux)

    def per_device(state: nnx.State, shard: PyTree) -> tuple[nnx.State, jax.Array, dict[str, Any]]:
        model, optimizer = nnx.merge(graphdef, state)
        value_and_grad = data_parallel_value_and_grad(split_loss, data_axis, has_aux=True)
        with _per_device_random_streams(model, data_axis):
            (loss, metrics), grads = value_and_grad(model, shard)
        optimizer.update(model, grads)
        metrics = reduce_metrics_collective(metrics, reduce, data_axis)
        return _average_per_device_state(nnx.state((model, optimizer)), data_axis), loss, metrics

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(), specs),
        out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec()),
        check_vma=True,
    )
    new_state, loss, metrics = run(state, batch)
    nnx.update((model, optimizer), new_state)
    return (loss, metrics) if has_aux else loss
