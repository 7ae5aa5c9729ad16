"""The optimizer update both steps run, on the global arrays, guarded against non-finite steps.

Every optax transformation sees what it sees on one device (see the layouts guide, "The
optimizer update"); a non-finite loss or gradient skips the whole update in the graph
(see the nonfinite guide).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from substrax._base import scopes
from substrax._base.trees import path_str
from substrax._layout import optional_axes, spec_tuple, without_axes

__all__ = ["all_finite", "apply_update", "donated_state", "pin_layout", "state_values", "update_step"]


def pin_layout(model: nnx.Module, optimizer: nnx.Optimizer[Any]) -> None:
    """Constrain every variable with ``out_sharding`` metadata to that sharding, in place.

    Without it XLA picks the output shardings of a jitted step, and a ZeRO-1 model's
    replicated parameters come back split like their optimizer state. With no mesh set
    (an implicit step on one device) a layer's optional axes pin nothing, as the layer is
    whole there; any other spec is refused, naming the variable.
    """
    no_mesh = jax.sharding.get_abstract_mesh().empty
    for (root, *path), variable in nnx.to_flat_state(nnx.state((model, optimizer))):
        spec = spec_tuple(variable)
        if spec is None:
            continue
        if no_mesh:
            if not without_axes(spec, optional_axes(variable)):
                continue
            raise ValueError(
                f"{path_str(path, ('model', 'optimizer')[root])} is placed as PartitionSpec{spec}, but "
                "the step has no mesh: pass mesh= to make_train_step, or call it inside "
                "`with jax.set_mesh(mesh):`."
            )
        variable.set_value(jax.lax.with_sharding_constraint(variable.get_value(), PartitionSpec(*spec)))


def state_values(tree: Any) -> list[Any]:
    """The arrays of ``tree``'s whole state, in ``nnx.state`` order (to restore with ``apply_update``)."""
    return jax.tree.leaves(nnx.state(tree))


def all_finite(tree: Any, *, by_max: bool = False) -> jax.Array:
    """Whether every floating element of ``tree`` is finite, as a 0-d bool.

    ``by_max``: read each leaf off its largest magnitude (XLA's ``max`` propagates NaN), the
    leaves of one shape and dtype in one variadic reduction: a few kernels for the whole tree
    where ``all(isfinite(x))`` is three a leaf on the CPU (see the nonfinite guide). A split
    leaf's maximum would all-reduce its bytes where its flag takes one.
    """
    leaves = [
        x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not leaves:
        return jnp.array(True)
    if not by_max:
        return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()
    groups: dict[tuple[Any, ...], list[jax.Array]] = {}
    for x in leaves:
        magnitude = jnp.abs(x)  # real for a complex leaf
        groups.setdefault((magnitude.shape, magnitude.dtype), []).append(magnitude)
    peaks = []
    for (shape, dtype), group in groups.items():
        peaks += jax.lax.reduce(
            tuple(group),
            tuple(jnp.zeros((), dtype) for _ in group),
            lambda a, b: tuple(jnp.maximum(x, y) for x, y in zip(a, b, strict=True)),
            tuple(range(len(shape))),
        )
    return jnp.stack([jnp.isfinite(peak) for peak in peaks]).all()


def _is_split(tree: Any) -> bool:
    """Whether any variable of ``tree`` is placed split over a mesh axis (``out_sharding``)."""
    return any(any(a is not None for a in spec_tuple(v) or ()) for _, v in nnx.to_flat_state(nnx.state(tree)))


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
    if before is None:
        with jax.named_scope(scopes.UPDATE):
            optimizer.update(model, grads)
        pin_layout(model, optimizer)
        return None
    with jax.named_scope(scopes.FINITE):
        # replicated state: each gradient read off its largest magnitude; split: by its elements
        finite = jnp.isfinite(loss).all() & all_finite(grads, by_max=not _is_split((model, optimizer)))
    done: set[int] = set()  # the arrays already chosen
    if _DONATED.get():
        _update_in_place(model, optimizer, grads, finite)
        done = {id(x) for x in jax.tree.leaves((nnx.state(model, optimizer.wrt), nnx.state(optimizer)))}
    else:
        with jax.named_scope(scopes.UPDATE):
            optimizer.update(model, grads)
    with jax.named_scope(scopes.FINITE):  # each new array, or the old one where the step is not finite
        after = nnx.state((model, optimizer))
        leaves, treedef = jax.tree.flatten(after)
        if len(leaves) != len(before):  # an update that grows state (none in optax) is not guarded
            raise ValueError(
                f"The optimizer update changed the number of state arrays ({len(before)} -> "
                f"{len(leaves)}); pass skip_nonfinite=False to train without the non-finite guard."
            )
        kept = [
            new if id(new) in done or _is_key(new) else jnp.where(finite, new, old)
            for new, old in zip(leaves, before, strict=True)
        ]
        nnx.update((model, optimizer), jax.tree.unflatten(treedef, kept))
    pin_layout(model, optimizer)
    return finite


_DONATED: contextvars.ContextVar[bool] = contextvars.ContextVar("substrax_donated_state", default=False)


@contextlib.contextmanager
def donated_state(donated: bool) -> Iterator[None]:
    """Trace ``apply_update`` for a step whose state arrays are donated (updated in place)."""
    token = _DONATED.set(donated)
    try:
        yield
    finally:
        _DONATED.reset(token)


def _update_in_place(
    model: nnx.Module, optimizer: nnx.Optimizer[Any], grads: nnx.State, finite: jax.Array
) -> None:
    """``optimizer.update(model, grads)`` where ``finite``, else nothing: the guarded update of a
    donated step.

    One update call whose new state is chosen against the old makes XLA copy the donated
    state (the new parameters are computed from the old state, read after its buffer took
    the new one). Here the parameters are updated first, then, past an optimization
    barrier, the state from its old values again: the same values, no copy. What the
    second call reads of the gradient alone (a global norm) is computed once; the model's
    other state is restored between the calls, so an ``nnx.Optimizer`` subclass that also
    updates it does so once.
    """
    m_old, m_tree = jax.tree.flatten(nnx.state(model))
    p_old, p_tree = jax.tree.flatten(nnx.state(model, optimizer.wrt))
    s_old, s_tree = jax.tree.flatten(nnx.state(optimizer))
    with jax.named_scope(scopes.UPDATE):
        optimizer.update(model, grads)  # the new parameters (its state is computed again below)
    with jax.named_scope(scopes.FINITE):
        updated = jax.tree.leaves(nnx.state(model, optimizer.wrt))
        p_new = [jnp.where(finite, new, old) for new, old in zip(updated, p_old, strict=True)]
    p_new, s_old = jax.lax.optimization_barrier((p_new, s_old))
    nnx.update(model, jax.tree.unflatten(m_tree, m_old))  # as before the first call, all of it
    nnx.update(optimizer, jax.tree.unflatten(s_tree, s_old))
    with jax.named_scope(scopes.UPDATE):
        optimizer.update(model, grads)  # the new state (its parameters dropped; what reads only grads, once)
    with jax.named_scope(scopes.FINITE):
        s_new = [
            new if _is_key(new) else jnp.where(finite, new, old)
            for new, old in zip(jax.tree.leaves(nnx.state(optimizer)), s_old, strict=True)
        ]
    nnx.update(optimizer, jax.tree.unflatten(s_tree, s_new))
    nnx.update(model, jax.tree.unflatten(p_tree, p_new))


def update_step(
    value_and_grad: Callable[..., tuple[Any, ...]],
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    loss_fn: Callable[..., Any],
    batch: Any,
    options: Any,
) -> tuple[Any, ...]:
    """A step of a mode whose gradient half is ``value_and_grad``, then the update.

    ``value_and_grad(model, optimizer, loss_fn, batch, options)`` returns ``(loss, aux,
    grads, *more)``; ``apply_update`` follows, which skips a non-finite step when
    ``options.skip_nonfinite`` (the state read before the gradient half runs).

    Returns:
      ``(out, applied, *more)``: the loss, or ``(loss, aux)`` with ``options.has_aux``; and
      ``apply_update``'s flag.
    """
    before = state_values((model, optimizer)) if options.skip_nonfinite else None
    loss, aux, grads, *more = value_and_grad(model, optimizer, loss_fn, batch, options)
    applied = apply_update(model, optimizer, grads, loss, before)
    return ((loss, aux) if options.has_aux else loss), applied, *more
