"""The data-parallel gradient inside ``jax.shard_map``: average the loss, then differentiate.

Under ``check_vma=True`` a replicated parameter's gradient arrives already ``psum``-ed,
so ``grad(lambda w: pmean(loss(w, shard), axis))`` is the full-batch gradient and
``pmean(grad(loss))`` is axis-size times too large (under ``check_vma=False`` the rule
flips). See the modes guide, "The gradient rule: ``pmean`` before ``grad``".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from substrax._base import scopes
from substrax._base.specs import spec_axes
from substrax._metrics.collectives import require_axis, varying_axes
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

    Call the result inside ``jax.shard_map(..., check_vma=True)`` with the parameters (or
    model) replicated and the batch split: the value is the global loss and each replicated
    parameter's gradient the full-batch one, equal on every device. Do not average it again.

    Args:
      fun: ``(*args) -> loss`` on this device's shard (a scalar), or ``(loss, aux)`` with
        ``has_aux``; NNX modules and plain arrays may both be differentiated.
      axis_name: The mesh axis the batch is split over.
      argnums: Which positional arguments to differentiate.
      has_aux: Whether ``fun`` returns ``(loss, aux)``. ``aux`` is returned per device,
        unreduced; reduce it with the ``reduce_*_collective`` functions.

    Returns:
      A function with ``fun``'s arguments returning ``(loss, grads)``, or
      ``((loss, aux), grads)`` with ``has_aux``; ``loss`` is the global mean.

    Raises:
      ValueError: At trace time: if ``axis_name`` is not bound by an enclosing
        ``shard_map``; ``fun``'s output does not match ``has_aux`` or its loss is not a
        scalar; or the per-device loss is not varying over ``axis_name`` (a ``shard_map``
        with ``check_vma=False``, or a loss that does not depend on the split batch).
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
