"""The implicit pipeline: the explicit one's twin under ``jit``, in the global view (pipelines guide).

The stack's parameters ``[L, ...]`` are viewed as ``[S, L / S, ...]``, split over ``stage``
on the first dimension; each tick runs every stage at once (``jax.vmap`` of the stage,
``spmd_axis_name="stage"``) on a carry ``[S, ...]`` split the same way, then shifts the
carry one stage on (``jnp.roll``; its cotangent one stage back), and XLA writes the
permutes. The prologue feeds stage 0's slot, the epilogue reads the last stage's. A stage
slot with no microbatch (the bubble) runs on whatever it holds; its results are selected
away (``_masked``: ``jnp.where``, never a product, so a NaN there changes nothing).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from substrax._base import declared
from substrax._base.trees import KeyPath, PyTree
from substrax._layout import STAGE_AXIS, spec_tuple, without_axes
from substrax._shared.pipeline import Staged, advanced, floats_of, put, take, with_floats
from substrax._shared.pipeline_record import note_pipeline
from substrax._shared.schedule import Schedule

__all__ = ["pipelined_value_and_grad"]


def _where(valid: Any, tree: PyTree) -> PyTree:
    """``tree``'s leaves where ``valid`` (one flag per stage, the leading axis), zeros elsewhere."""

    def pick(x: Any) -> Any:
        flag = jnp.reshape(valid, valid.shape + (1,) * (x.ndim - valid.ndim))
        return jnp.where(flag, x, jnp.zeros_like(x))

    return jax.tree.map(pick, tree)


class _Global:
    """The pipeline's pieces over every stage at once, with their placements."""

    def __init__(
        self, staged: Staged, slices: PyTree, schedule: Schedule, mesh: Any, rows: tuple[str, ...]
    ) -> None:
        self.staged, self.slices, self.schedule, self.mesh, self.rows = staged, slices, schedule, mesh, rows
        self.k, self.n = schedule.microbatches, schedule.stages
        self.ids = jnp.arange(self.n)

    def valid(self, j: Any) -> Any:
        return (j >= 0) & (j < self.k)

    def microbatch(self, j: Any) -> PyTree:
        return take(self.slices, jnp.clip(j, 0, self.k - 1))

    def split_stack(self, stack: nnx.State) -> nnx.State:
        """Each ``[L, ...]`` parameter as ``[S, L / S, ...]``, stage ``s``'s layers at ``s``."""

        def view(variable: nnx.Variable[Any]) -> nnx.Variable[Any]:
            value = variable.get_value()
            spec = without_axes(spec_tuple(variable) or (), (*self.rows, STAGE_AXIS))
            spec = (STAGE_AXIS, None, *spec[1:])
            stacked = value.reshape(self.n, value.shape[0] // self.n, *value.shape[1:])
            return variable.replace(
                jax.lax.with_sharding_constraint(stacked, NamedSharding(self.mesh, PartitionSpec(*spec)))
            )

        return jax.tree.map(view, stack, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def split_streams(self, streams: nnx.State) -> nnx.State:
        """The stack's random streams ``[L]`` as ``[S, L / S]``, as ``split_stack`` views its parameters."""
        return jax.tree.map(lambda x: x.reshape(self.n, x.shape[0] // self.n, *x.shape[1:]), streams)

    def over_stages(self, tree: PyTree) -> PyTree:
        """``tree`` (a leading stage axis) constrained split over ``stage`` there."""

        def place(x: Any) -> Any:
            spec = PartitionSpec(STAGE_AXIS, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(place, tree)

    def stages(self, f: Callable[..., Any], *args: Any) -> Any:
        """``f`` on every stage's slice of ``args``, at once."""
        return jax.vmap(f, spmd_axis_name=STAGE_AXIS)(*args)

    def feed(self, carry: PyTree, x0: PyTree) -> PyTree:
        """``carry`` with stage 0's slot holding ``x0``."""
        return jax.tree.map(lambda c, x: jnp.where(_first(self.ids, c), x[None], c), carry, x0)

    def shift(self, tree: PyTree, step: int) -> PyTree:
        """Stage ``s``'s slot to ``s + step``: the permute between neighbours (the ends' slots unread)."""
        return self.over_stages(jax.tree.map(lambda x: jnp.roll(x, step, axis=0), tree))


def _first(ids: Any, like: Any) -> Any:
    return jnp.reshape(ids == 0, ids.shape + (1,) * (like.ndim - 1))


def _masked(stage: Callable[..., Any]) -> Callable[..., Any]:
    """``stage(valid, params, carry, streams)``: the stage; its cotangents where ``valid``, else zeros."""

    @jax.custom_vjp
    def run(valid: Any, params: Any, carry: Any, streams: Any) -> Any:
        return stage(params, carry, streams)

    def fwd(valid: Any, params: Any, carry: Any, streams: Any) -> tuple[Any, Any]:
        out, vjp, drawn = jax.vjp(lambda p, c: stage(p, c, streams), params, carry, has_aux=True)
        return (out, drawn), (valid, vjp)

    def bwd(res: Any, ct: Any) -> tuple[None, Any, Any, None]:
        valid, vjp = res
        d_params, d_carry = vjp(ct[0])
        pick = lambda x: jnp.where(valid, x, jnp.zeros_like(x))  # noqa: E731
        return None, jax.tree.map(pick, d_params), jax.tree.map(pick, d_carry), None

    run.defvjp(fwd, bwd)
    return run


def _zeros(tree: PyTree, lead: tuple[int, ...] = ()) -> PyTree:
    return jax.tree.map(lambda x: jnp.zeros((*lead, *jnp.shape(x)), x.dtype), tree)


def _types(g: _Global, outside: nnx.State) -> tuple[Any, Any]:
    """The carry's and the epilogue's output's shapes and dtypes (traced for them alone)."""
    with declared.silenced():
        carry = jax.eval_shape(lambda: g.staged.prologue(outside, g.microbatch(0)))
        return carry, jax.eval_shape(lambda: g.staged.epilogue(outside, _zeros(carry), g.microbatch(0)))


def _gpipe(g: _Global, outside: nnx.State, stack: nnx.State, streams: nnx.State) -> tuple[Any, Any]:
    """The mean loss over microbatches, and ``(the aux stacked, the streams after)``: GPipe's forward
    ticks (autodiff: the rest)."""
    staged, k = g.staged, g.k
    carry0, out0 = _types(g, outside)
    note_pipeline(carry=carry0)  # for the census: one stage's carry, global
    masked = _masked(staged.stage)

    def tick(state: Any, t: Any) -> tuple[Any, Any]:
        carry, streams = state
        x0 = jax.lax.cond(t < k, lambda: staged.prologue(outside, g.microbatch(t)), lambda: _zeros(carry0))
        carry = g.over_stages(g.feed(carry, x0))
        valid = g.valid(g.schedule.forward(t, g.ids))
        out, drawn = g.stages(masked, valid, stack, carry, streams)
        j = t - (g.n - 1)
        last = jax.tree.map(lambda y: y[g.n - 1], out)
        done = jax.lax.cond(
            j >= 0, lambda: staged.epilogue(outside, last, g.microbatch(j)), lambda: _zeros(out0)
        )
        return (g.shift(out, 1), advanced(streams, drawn, valid)), done

    start = (g.over_stages(_zeros(carry0, (g.n,))), streams)
    (_, streams), (losses, aux) = jax.lax.scan(tick, start, jnp.arange(g.schedule.ticks))
    aux = jax.tree.map(lambda a: a[g.n - 1 : g.n - 1 + k], aux)
    return jnp.sum(losses) / k, (aux, streams)


def _first_state(g: _Global, types: tuple[Any, Any], params: Any, streams: nnx.State, dtype: Any) -> Any:
    """1F1B's loop state before its first tick: ``((carry, streams), cotangents, stash, grads, loss sum,
    aux)``; ``types``: the carry's and the epilogue's zeros, ``params``: ``(outside, stack)``."""
    (carry0, out0), n, depth = types, g.n, g.schedule.stash
    stashed = jax.tree.map(lambda x: jnp.broadcast_to(x[:, None], (n, depth, *x.shape[1:])), streams)
    return (
        (g.over_stages(_zeros(carry0, (n,))), streams),
        g.over_stages(_zeros(floats_of(carry0), (n,))),
        (g.over_stages(_zeros(carry0, (n, depth))), stashed),
        jax.tree.map(lambda x: jnp.zeros(x.shape, dtype or x.dtype), params),
        jnp.zeros(out0[0].shape, out0[0].dtype),
        _zeros(out0[1], (g.k,)),
    )


def _one_f_one_b(
    g: _Global, outside: nnx.State, stack: nnx.State, streams: nnx.State, dtype: Any
) -> tuple[Any, Any, Any, Any, Any]:
    """1F1B's ticks, every stage at once: ``(mean loss, aux, outside grads, stack grads, streams after)``."""
    staged, k, n, depth = g.staged, g.k, g.n, g.schedule.stash
    carry0, out0 = _types(g, outside)
    note_pipeline(carry=carry0)  # for the census: one stage's carry, global
    floats0 = floats_of(carry0)

    def stage_vjp(params: Any, carry: Any, streams: Any) -> tuple[Any, Any]:
        def f(p: nnx.State, fl: list[Any]) -> list[Any]:
            return floats_of(staged.stage(p, with_floats(carry, fl), streams)[0])

        out, vjp = jax.vjp(f, params, floats_of(carry))
        return with_floats(carry, out), vjp

    def epilogue_vjp(carry: Any, j: Any) -> tuple[Any, Any, Any, Any]:
        def f(o: nnx.State, fl: Any) -> tuple[Any, Any]:
            return staged.epilogue(o, with_floats(carry, fl), g.microbatch(j))

        loss, vjp, aux = jax.vjp(f, outside, floats_of(carry), has_aux=True)
        d_out, d_fl = vjp(jnp.full_like(loss, 1.0 / k))
        return loss, aux, d_out, d_fl

    def prologue_vjp(j: Any, ct: Any) -> Any:
        _, vjp = jax.vjp(lambda o: floats_of(staged.prologue(o, g.microbatch(j))), outside)
        return vjp(ct)[0]

    def tick(state: Any, t: Any, forward: bool, backward: bool) -> tuple[Any, None]:
        (carry, streams), cts, stash, (g_out, g_stack), total, auxes = state
        if forward:  # every stage's forward slot: microbatch t - s (stage 0's from the prologue)
            x0 = jax.lax.cond(
                t < k, lambda: staged.prologue(outside, g.microbatch(t)), lambda: _zeros(carry0)
            )
            carry = g.over_stages(g.feed(carry, x0))
            jf = g.schedule.forward(t, g.ids)
            stash = g.stages(  # the stage's input and the streams it draws from: its backward reruns it
                lambda st, j, c: jax.lax.cond(g.valid(j), lambda: put(st, j % depth, c), lambda: st),
                stash,
                jf,
                (carry, streams),
            )
            out, drawn = g.stages(staged.stage, stack, carry, streams)
            carry, streams = g.shift(out, 1), advanced(streams, drawn, g.valid(jf))
        if backward:  # every stage's backward slot: microbatch t - (2S - 2 - s), recomputed from the stash
            jb = g.schedule.backward(t, g.ids)
            held, used = g.stages(lambda st, j: take(st, j % depth), stash, jb)
            last, vjps = g.stages(stage_vjp, stack, held, used)
            j = t - (n - 1)  # the last stage's: its loss and the loss's cotangent
            loss, aux, d_epi, ct_last = jax.lax.cond(
                g.valid(j),
                lambda: epilogue_vjp(jax.tree.map(lambda y: y[n - 1], last), j),
                lambda: (_zeros(out0[0]), _zeros(out0[1]), _zeros(outside), _zeros(floats0)),
            )
            cts = jax.tree.map(lambda c, x: c.at[n - 1].set(x), cts, ct_last)
            d_stack, d_c = g.stages(lambda f, c: f(c), vjps, cts)
            d_stack, d_c = _where(g.valid(jb), d_stack), _where(g.valid(jb), d_c)
            j0 = t - (2 * n - 2)  # stage 0's: the prologue's gradient
            d_pro = jax.lax.cond(
                g.valid(j0),
                lambda: prologue_vjp(j0, jax.tree.map(lambda c: c[0], d_c)),
                lambda: _zeros(outside),
            )
            g_out = jax.tree.map(lambda a, b, c: a + (b + c).astype(a.dtype), g_out, d_epi, d_pro)
            g_stack = jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_stack, d_stack)
            auxes = jax.lax.cond(g.valid(j), lambda: put(auxes, j, aux), lambda: auxes)
            total, cts = total + loss, g.shift(d_c, -1)
        return ((carry, streams), cts, stash, (g_out, g_stack), total, auxes), None

    state = _first_state(g, (carry0, out0), (outside, stack), streams, dtype)
    for start, stop, forward, backward, _ in g.schedule.phases:
        body = functools.partial(tick, forward=forward, backward=backward)
        state, _ = jax.lax.scan(body, state, jnp.arange(start, stop))
    (_, streams), _, _, (g_out, g_stack), total, auxes = state
    return total / k, auxes, g_out, g_stack, streams


def pipelined_value_and_grad(
    split_loss: Callable[..., tuple[Any, Any]],
    model: nnx.Module,
    slices: PyTree,
    *,
    mesh: Any,
    rows: tuple[str, ...],
    schedule: str,
    microbatches: int,
    stack_path: KeyPath,
    accumulate_dtype: Any = None,
) -> tuple[tuple[jax.Array, Any], nnx.State]:
    """``((mean loss, aux stacked over microbatches), grads)`` of a pipelined step, in the global view.

    ``slices``: the global batch cut into ``microbatches`` (``split_global_microbatches``);
    ``rows``: the mesh axes the rows are split over (the parameters are used whole over them).
    """
    staged = Staged(model, stack_path, split_loss)
    g = _Global(staged, slices, Schedule(schedule, mesh.shape[STAGE_AXIS], microbatches), mesh, rows)
    note_pipeline(g.schedule, mode="implicit")
    layers = jax.tree.leaves(staged.stack)[0].shape[0]
    stack, streams = g.split_stack(staged.stack), g.split_streams(staged.streams)
    if schedule == "gpipe":
        (loss, (aux, streams)), (g_out, g_stack) = jax.value_and_grad(
            lambda o, s: _gpipe(g, o, s, streams), argnums=(0, 1), has_aux=True
        )(staged.outside, stack)
    else:
        loss, aux, g_out, g_stack, streams = _one_f_one_b(g, staged.outside, stack, streams, accumulate_dtype)
    g_stack, streams = jax.tree.map(lambda x: x.reshape(layers, *x.shape[2:]), (g_stack, streams))
    staged.keep_draws(model, streams)  # each layer's count as far as the step's draws took it
    grads = [(tuple(p), v) for p, v in nnx.to_flat_state(g_out)]
    grads += [((*staged.path, *p), v) for p, v in nnx.to_flat_state(g_stack)]
    order = {tuple(p): i for i, (p, _) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param)))}
    return (loss, aux), nnx.from_flat_state(sorted(grads, key=lambda pv: order[pv[0]]))
