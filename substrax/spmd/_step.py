"""The implicit data-parallel step: differentiate the global loss, let XLA all-reduce."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import jax
from flax import nnx

PyTree = Any
M = TypeVar("M", bound=nnx.Module)


@overload
def spmd_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], jax.Array],
    batch: PyTree,
    *,
    has_aux: Literal[False] = False,
) -> jax.Array: ...


@overload
def spmd_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], tuple[jax.Array, Any]],
    batch: PyTree,
    *,
    has_aux: Literal[True],
) -> tuple[jax.Array, Any]: ...


@overload
def spmd_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    has_aux: bool,
) -> jax.Array | tuple[jax.Array, Any]: ...


def spmd_train_step(
    model: M,
    optimizer: nnx.Optimizer[M],
    loss_fn: Callable[[M, PyTree], Any],
    batch: PyTree,
    *,
    has_aux: bool = False,
) -> jax.Array | tuple[jax.Array, Any]:
    """Execute a data-parallel training step using SPMD.

    Uses ``nnx.value_and_grad`` for automatic differentiation. The XLA compiler handles
    gradient AllReduce automatically when model parameters are sharded across devices
    via ``jax.set_mesh`` or explicit ``NamedSharding``: ``loss_fn`` sees the global
    batch, so its gradient is already the full one and needs no reduction.

    This function should be called inside an ``@nnx.jit`` decorated function with a
    mesh context active.

    Args:
      model: The NNX model to train.
      optimizer: The NNX optimizer wrapping the model.
      loss_fn: Function ``(model, batch) -> loss`` scalar; with ``has_aux``,
        ``(model, batch) -> (loss, aux)``.
      batch: The training batch (should be pre-sharded, see ``place_batch_on_shards``).
      has_aux: Whether ``loss_fn`` also returns auxiliary values (metrics).

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
    out, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch), has_aux=has_aux)(model)
    optimizer.update(model, grads)
    return out
