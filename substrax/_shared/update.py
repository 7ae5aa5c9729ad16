"""The optimizer update both steps run, on the global arrays, guarded against non-finite steps.

Every optax transformation sees what it sees on one device (see the layouts guide, "The
optimizer update"); a non-finite loss or gradient skips the whole update in the graph
(see the nonfinite guide).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from substrax._layout import spec_tuple
from substrax._shared import scopes

__all__ = ["all_finite", "apply_update", "pin_layout", "state_values"]


def pin_layout(tree: Any) -> None:
    """Constrain every variable with ``out_sharding`` metadata to that sharding, in place.

    Without it XLA picks the output shardings of a jitted step, and a ZeRO-1 model's
    replicated parameters come back split like their optimizer state.
    """
    for _, variable in nnx.to_flat_state(nnx.state(tree)):
        spec = spec_tuple(variable)
        if spec is not None:
            variable.set_value(jax.lax.with_sharding_constraint(variable.get_value(), PartitionSpec(*spec)))


def state_values(tree: Any) -> list[Any]:
    """The arrays of ``tree``'s whole state, in ``nnx.state`` order (to restore with ``apply_update``)."""
    return jax.tree.leaves(nnx.state(tree))


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating element of ``tree`` is finite, as a 0-d bool."""
    flags = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.stack(flags).all() if flags else jnp.array(True)


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def apply_update(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    grads: nnx.State,
    loss: jax.Array,
    before: list[Any] | None,
) -> jax.Array | None:
    """``optimizer.update(model, grads)`` on global arrays, skipped when the step is not finite.

    Every variable placed by ``shard_state`` is then pinned to its placement.

    Args:
      model: The model, with its global parameters and the step's other state.
      optimizer: Its optimizer.
      grads: The whole step's gradient, global arrays (split or replicated).
      loss: The step's global loss.
      before: ``state_values((model, optimizer))`` from before the step, kept when the step
        is not finite; ``None`` applies the update whatever it holds.

    Returns:
      Whether the update was applied (a 0-d bool), or ``None`` without the guard.
    """
    finite = None
    with jax.named_scope(scopes.UPDATE):
        optimizer.update(model, grads)
    if before is not None:
        with jax.named_scope(scopes.FINITE):
            finite = jnp.isfinite(loss).all() & all_finite(grads)
            after = nnx.state((model, optimizer))
            leaves, treedef = jax.tree.flatten(after)
            if len(leaves) != len(before):  # an update that grows state (none in optax) is not guarded
                raise ValueError(
                    f"The optimizer update changed the number of state arrays ({len(before)} -> "
                    f"{len(leaves)}); pass skip_nonfinite=False to train without the non-finite guard."
                )
            kept = [
                new if _is_key(new) else jnp.where(finite, new, old)
                for new, old in zip(leaves, before, strict=True)
            ]
            nnx.update((model, optimizer), jax.tree.unflatten(treedef, kept))
    pin_layout((model, optimizer))
    return finite
