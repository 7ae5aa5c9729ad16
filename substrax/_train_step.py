"""One entry point for both modes: flip one word, keep the call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
from flax import nnx
from jax.sharding import Mesh

from substrax._tree import PyTree
from substrax.explicit._step import BatchSpec, explicit_train_step
from substrax.spmd._metrics import reduce_metrics
from substrax.spmd._step import spmd_train_step

__all__ = ["MODES", "make_train_step"]

Mode = Literal["implicit", "explicit"]
MODES: tuple[str, ...] = ("implicit", "explicit")


def make_train_step(
    loss_fn: Callable[[Any, PyTree], Any],
    mode: Mode = "implicit",
    *,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    batch_spec: BatchSpec | None = None,
    has_aux: bool = False,
    reduce: Mapping[str, str | None] | None = None,
) -> Callable[[nnx.Module, nnx.Optimizer, PyTree], Any]:
    """Build a jitted data-parallel step ``(model, optimizer, batch) -> loss``, in either mode.

    ``"implicit"`` differentiates the global batch's loss under ``nnx.jit`` and lets XLA
    insert the gradient all-reduce (``substrax.spmd.spmd_train_step``). ``"explicit"``
    runs the step under ``jax.shard_map``, ``pmean``-ing the loss before ``grad`` and
    reducing metrics with collectives (``substrax.explicit.explicit_train_step``).
    Both take the same batch and return the same values to round-off.

    Args:
      loss_fn: ``(model, batch) -> loss``, or ``(loss, metrics)`` with ``has_aux``; a
        mean over the batch's examples. In explicit mode it sees one device's shard.
      mode: ``"implicit"`` or ``"explicit"``.
      mesh: The mesh. ``None`` uses the one set by ``jax.set_mesh`` around the call;
        given, the step sets it itself.
      data_axis: The mesh axis the batch is split over.
      batch_spec: Explicit mode: how ``shard_map`` splits the batch (see
        ``explicit_train_step``). Implicit mode reads the batch's own sharding.
      has_aux: Whether ``loss_fn`` returns ``(loss, metrics)``, ``metrics`` a flat
        mapping from name to value.
      reduce: With ``has_aux``, metric name to ``"mean"``, ``"sum"``, ``"max"``,
        ``"min"``, ``"gather"`` (per-example values of the global batch) or ``None``.
        Unlisted metrics get ``"mean"``. Both modes give the same values, except
        ``None``: implicit keeps the global value, explicit stacks per-device values.

    Returns:
      A function ``(model, optimizer, batch) -> loss`` (or ``(loss, metrics)``),
      jitted with ``nnx.jit``, that updates ``model`` and ``optimizer`` in place.

    Raises:
      ValueError: If ``mode`` is not ``"implicit"`` or ``"explicit"``.
    """
    if mode == "implicit":

        def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
            out = spmd_train_step(model, optimizer, loss_fn, batch, has_aux=has_aux)
            return (out[0], reduce_metrics(out[1], reduce)) if has_aux else out

    elif mode == "explicit":

        def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
            return explicit_train_step(
                model,
                optimizer,
                loss_fn,
                batch,
                mesh=mesh,
                data_axis=data_axis,
                batch_spec=batch_spec,
                has_aux=has_aux,
                reduce=reduce,
            )

    else:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}.")

    jitted = nnx.jit(step)

    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            return jitted(model, optimizer, batch)

    train_step.__doc__ = f"A {mode} data-parallel step of {getattr(loss_fn, '__name__', 'loss_fn')}."
    return train_step
