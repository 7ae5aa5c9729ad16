"""``scan_layers``: a stack of layers made by ``nnx.vmap``, applied in turn by ``nnx.scan``."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from substrax._base.hooks import STAGE_HOOK, UNIT_HOOK

__all__ = ["STAGE_HOOK", "scan_layers", "scan_plain"]


def scan_layers(stack: nnx.Module, x: jax.Array, *args: Any, remat: bool = False, **kwargs: Any) -> jax.Array:
    """``x`` through each layer of ``stack`` in turn: ``x = layer(x, *args, **kwargs)``.

    ``nnx.scan`` over ``stack``'s leading (layer) axis, each step under ``nnx.remat`` with
    ``remat``. In the explicit step, a stack placed as an FSDP unit with ``prefetch=True``
    runs in the step's own loop instead, gathering layer i+1 while layer i computes (see
    the layouts guide, "Units"). In a pipelined step (``make_train_step(...,
    schedule=...)``), a stack placed over the ``stage`` axis (``shard_state(...,
    stages=...)``) is where the step cuts the loss: each stage runs its own layers (see the
    pipelines guide).

    Args:
      stack: One module whose parameters carry a leading layer axis (``nnx.vmap``).
      x: The carry: each layer's input and output, of one shape and type.
      *args: Passed to every layer, the same each time (a mask, positions).
      remat: Recompute each layer's forward pass in the backward one (in a pipelined step,
        the way to ask: a ``jax.checkpoint`` or ``nnx.remat`` around ``scan_layers`` is refused).
      **kwargs: Passed to every layer.

    Returns:
      The last layer's output.
    """
    stage = vars(stack).get(STAGE_HOOK)  # set by a pipelined step on a staged stack
    if stage is not None:
        return stage.reached(stack, x, args, kwargs, remat)
    run = vars(stack).get(UNIT_HOOK)  # set by the explicit step on an FSDP unit
    if run is not None and run.prefetch:
        return run.scan(stack, x, args, kwargs)
    return scan_plain(stack, x, args, kwargs, remat)


def scan_plain(
    stack: nnx.Module, x: jax.Array, args: tuple[Any, ...], kwargs: dict[str, Any], remat: bool
) -> Any:
    """``nnx.scan`` of ``layer(h, *args, **kwargs)`` over ``stack``'s layers (``nnx.remat`` each with
    ``remat``)."""

    def body(h: jax.Array, layer: nnx.Module) -> tuple[jax.Array, None]:
        return layer(h, *args, **kwargs), None

    if remat:
        body = nnx.remat(body)
    out, _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, stack)
    return out
