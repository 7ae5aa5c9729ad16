"""The data-parallel gradient inside ``jax.shard_map``: average the loss, then differentiate.

Inside ``shard_map(..., check_vma=True)`` a parameter given ``in_specs=P()`` is
replicated (invariant over the axis), and the batch shard is varying. Reading a
replicated value in varying code inserts an implicit ``pvary``, whose transpose is a
``psum``: the gradient of a replicated parameter arrives already summed over the axis.
So the loss must be averaged *before* ``grad``:

    grad(lambda w: pmean(loss(w, shard), axis))    # the full-batch gradient
    pmean(grad(loss)(w, shard), axis)               # wrong: axis-size times too large

Under ``check_vma=False`` there is no ``pvary`` and no automatic ``psum``, and the rule
flips: each device's ``grad`` of the averaged loss is only the gradient of its own shard
(the devices disagree), and ``pmean(grad(loss))`` is the right spelling. substrax pins
``check_vma=True`` and the first spelling; ``data_parallel_value_and_grad`` refuses to
run where it can see the batch is not marked as varying over the axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from substrax._batch.axes import spec_axes
from substrax._metrics.collectives import require_axis, varying_axes
from substrax._shared import scopes
from substrax._shared.loss import loss_and_metrics

__all__ = ["data_parallel_value_and_grad", "varying_axes"]


def data_parallel_value_and_grad(
    fun: Callable[..., Any],
    axis_name: str = "data",
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """``nnx.value_and_grad`` of ``fun``'s loss averaged over ``axis_name``.

    Call the result inside ``jax.shard_map(..., check_vma=True)`` with the parameters
    (or NNX model) replicated and the batch split over ``axis_name``. The loss each
    device computes on its shard is ``pmean``-ed over the axis before differentiating,
    so the value is the global loss and the gradient of every replicated parameter is
    the full-batch gradient, equal on every device. Do not average the gradient again:
    it would be wrong by the axis size (see the module docstring for why, and for the
    ``check_vma=False`` trap).

    Args:
      fun: ``(*args) -> loss`` on this device's shard, or ``(loss, aux)`` with
        ``has_aux``; ``loss`` is a scalar. NNX modules and plain arrays are both fine
        as differentiated arguments.
      axis_name: The mesh axis the batch is split over.
      argnums: Which positional arguments to differentiate.
      has_aux: Whether ``fun`` returns ``(loss, aux)``. ``aux`` is returned per device,
        unreduced; reduce it with the ``reduce_*_collective`` functions.

    Returns:
      A function with ``fun``'s arguments returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux``; ``loss`` is the global mean.

    Raises:
      ValueError: At trace time: if ``axis_name`` is not bound by an enclosing
        ``shard_map``; if ``fun``'s output does not match ``has_aux`` or its loss is not
        a scalar; or if the per-device loss is not marked as varying over
        ``axis_name``: the enclosing ``shard_map`` runs with ``check_vma=False`` (where
        this rule gives each device its own shard's gradient) or the loss does not depend on a
        shard split over that axis.
    """

    def averaged(*args: Any, **kwargs: Any) -> Any:
        require_axis(axis_name, "data_parallel_value_and_grad")
        loss, aux = loss_and_metrics(fun(*args, **kwargs), has_aux)
        axes = varying_axes(loss)
        if axes is not None and not set(spec_axes(axis_name)) <= axes:
            raise ValueError(
                f"The per-device loss does not vary over axis {axis_name!r} (it varies over "
                f"{sorted(axes) or 'no axis'}). Either the enclosing jax.shard_map runs with "
                f"check_vma=False, where grad of the pmean-ed loss gives each device only "
                f"its own shard's gradient (pass check_vma=True), or the loss does not read "
                f"a batch split over {axis_name!r} (check in_specs)."
            )
        with jax.named_scope(scopes.LOSS):
            loss = jax.lax.pmean(loss, axis_name)
        return (loss, aux) if has_aux else loss

    return nnx.value_and_grad(averaged, argnums=argnums, has_aux=has_aux)
