"""The explicit pipeline: a device's stage of a pipeline schedule inside the step's ``shard_map``.

Each device holds its stage's consecutive layers (the stack split over ``stage``) and the
whole microbatches of its rows. A tick of a ``lax.scan`` runs this stage's slot on the
microbatch the ``Schedule`` names, under ``lax.cond`` (a slot with no microbatch, the
bubble, runs nothing); the carry moves to the next stage by ``ppermute`` (forward) and its
cotangent to the previous one (backward). Stage 0 runs the prologue, the last stage the
epilogue (``substrax._shared.pipeline.Staged``). GPipe is the autodiff of the forward
ticks; 1F1B writes each tick's forward slot and backward slot (``jax.vjp`` of the stage,
recomputed from the stage input it stashed); ZB-H1 splits that backward slot in two, the input's
gradient sent on at once and the weights' run in a later tick from each layer's kept pullback;
interleaved 1F1B is 1F1B over ``v`` chunks a stage, the carry going around the ring of stages
and the chunks moved to their stages first (``substrax.explicit._chunks``). See the pipelines guide.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from substrax._base import declared, scopes
from substrax._base.specs import spec_axes
from substrax._base.trees import KeyPath, PyTree
from substrax._metrics.collectives import to_varying_over, varying_axes
from substrax._shared.loss import loss_and_metrics
from substrax._shared.microbatch import split_microbatches
from substrax._shared.pipeline import Staged, advanced, floats_of, put, take, with_floats
from substrax._shared.pipeline_record import note_pipeline
from substrax._shared.schedule import Schedule
from substrax.explicit._chunks import moved
from substrax.explicit._prologue import Share

__all__ = ["pipelined_value_and_grad"]


_WEIGHT = (
    "ZB-H1's weight slot runs each layer's pullback again for the weights' gradient: XLA keeps a "
    "backward collective there only where a weight's gradient needs it"
)


def _typed_like(tree: PyTree, like: PyTree) -> PyTree:
    """``tree`` cast to vary over every axis ``like``'s leaf at its place varies over."""
    return jax.tree.map(lambda x, t: to_varying_over(x, tuple(varying_axes(t) or ())), tree, like)


def _zeros_like(tree: PyTree, dtype: Any = None) -> PyTree:
    """Zeros of each leaf's shape, dtype (or ``dtype``) and varying axes."""
    return jax.tree.map(
        lambda x: to_varying_over(jnp.zeros(x.shape, dtype or x.dtype), tuple(varying_axes(x) or ())), tree
    )


def _added(tree: PyTree, d: PyTree) -> PyTree:
    """``tree + d``, leaf by leaf, in ``tree``'s dtypes (a gradient accumulated)."""
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), tree, d)


def _from_last(x: Any, last: Any, axis: str) -> Any:
    """The last stage's ``x`` on every stage: a ``psum`` of it and the others' zeros (exact)."""
    wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    total = jax.lax.psum(jnp.where(last, wide, jnp.zeros_like(wide)), axis)
    return total.astype(x.dtype)


def _stage_streams(streams: nnx.State, layers: int, axis: str) -> nnx.State:
    """This stage's ``layers`` layers of each random stream: one placed whole (a key) sliced at the
    stage's first layer, one split over ``axis`` (a count: ``shard_state``'s) as it is."""
    first = jax.lax.axis_index(axis) * layers

    def own(x: Any) -> Any:
        return x if x.shape[0] == layers else jax.lax.dynamic_slice_in_dim(x, first, layers)

    return jax.tree.map(own, streams)


@dataclasses.dataclass(eq=False)
class _Stages:
    """This device's view of the pipeline: its stage index, the pieces, the permutes.

    ``axis``: the stage axis; ``axes``: the rows' axes and it (what the pieces vary over).
    """

    staged: Staged
    slices: PyTree
    schedule: Schedule
    axis: str
    axes: tuple[str, ...]
    streams: nnx.State  # this stage's layers' random streams, as the step starts

    def __post_init__(self) -> None:
        self.k, self.n, self.v = (
            self.schedule.microbatches,
            self.schedule.stages,
            self.schedule.virtual_stages,
        )
        self.s = jax.lax.axis_index(self.axis)
        self.first, self.last = self.s == 0, self.s == self.n - 1
        self.m = jax.tree.leaves(self.staged.stack)[0].shape[0] // self.v  # layers a chunk

    def starts(self, u: Any) -> Any:
        """Whether chunk ``u`` of this stage is the pipeline's first (it runs the prologue)."""
        return self.first if self.v == 1 else self.first & (u == 0)

    def ends(self, u: Any) -> Any:
        """Whether chunk ``u`` of this stage is the pipeline's last (it runs the loss)."""
        return self.last if self.v == 1 else self.last & (u == self.v - 1)

    def chunk(self, tree: PyTree, u: Any) -> PyTree:
        """Chunk ``u``'s layers of a tree over this stage's layers (the tree itself when ``v`` is 1)."""
        if self.v == 1:
            return tree
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, u * self.m, self.m), tree)

    def with_chunk(self, tree: PyTree, u: Any, part: PyTree) -> PyTree:
        """``tree`` with chunk ``u``'s layers set to ``part``'s."""
        if self.v == 1:
            return part
        return jax.tree.map(lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, u * self.m, 0), tree, part)

    def varying(self, tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: to_varying_over(x, self.axes), tree)

    def valid(self, j: Any) -> Any:
        return (j >= 0) & (j < self.k)

    def microbatch(self, j: Any) -> PyTree:
        return take(self.slices, jnp.clip(j, 0, self.k - 1))

    def prologue(self, outside: nnx.State, j: Any) -> Any:
        return self.varying(self.staged.prologue(outside, self.microbatch(j)))

    def stage(self, stack: nnx.State, carry: Any, streams: nnx.State) -> tuple[Any, nnx.State]:
        out, drawn = self.staged.stage(stack, carry, streams)
        return _typed_like(self.varying(out), carry), _typed_like(drawn, streams)

    def stage_pullbacks(self, stack: nnx.State, carry: Any, streams: nnx.State) -> tuple[Any, nnx.State, Any]:
        out, drawn, pullbacks = self.staged.stage_pullbacks(stack, carry, streams)
        return _typed_like(self.varying(out), carry), _typed_like(drawn, streams), pullbacks

    def epilogue(self, outside: nnx.State, carry: Any, j: Any) -> tuple[Any, Any]:
        loss, aux = self.staged.epilogue(outside, carry, self.microbatch(j))
        return self.varying((loss, aux))

    def send(self, tree: PyTree, step: int) -> PyTree:
        """``tree`` to the next stage (``step=1``) or the previous one (``-1``); zeros arrive at the ends."""
        if self.n == 1 and self.v == 1:
            return _zeros_like(tree)
        if self.v > 1:  # interleaved: around the ring, the last stage's chunk u feeding stage 0's u + 1
            pairs = [(i, (i + step) % self.n) for i in range(self.n)]
        else:
            pairs = [(i, i + step) for i in range(self.n) if 0 <= i + step < self.n]
        with jax.named_scope(scopes.PIPELINE):
            return jax.lax.ppermute(tree, self.axis, pairs)

    def carry_type(self, outside: nnx.State, stack: nnx.State) -> Any:
        """Zeros of the carry's type: the prologue's output, varying over every axis a stage's output does."""
        with declared.silenced():  # a trace for types: the ticks' own traces record the layers' collectives
            carry = self.prologue(outside, 0)
            out, _ = self.stage(self.chunk(stack, 0), carry, self.chunk(self.streams, 0))
        typed = jax.tree.map(lambda c, o: to_varying_over(c, tuple(varying_axes(o) or ())), carry, out)
        zeros = _zeros_like(typed)
        note_pipeline(carry=zeros)  # for the census: the permutes' buffers
        return zeros

    def loss_type(self, outside: nnx.State, carry: Any) -> Any:
        with declared.silenced():
            return _zeros_like(self.epilogue(outside, carry, 0))


def _gpipe(
    p: _Stages, outside: nnx.State, stack: nnx.State, scale: float
) -> tuple[Any, tuple[Any, Any, nnx.State]]:
    """This device's share of the loss, ``(the loss sum, its per-microbatch aux, the streams after)``:
    GPipe's forward ticks."""
    zero_carry = p.carry_type(outside, stack)
    zero_out = p.loss_type(outside, zero_carry)
    ticks = p.schedule.ticks

    def tick(state: Any, t: Any) -> tuple[Any, Any]:
        recv, streams = state
        j = p.schedule.forward(t, p.s)
        carry = jax.lax.cond(
            p.first & p.valid(j), lambda: _typed_like(p.prologue(outside, j), recv), lambda: recv
        )
        out, streams = jax.lax.cond(
            p.valid(j), lambda: p.stage(stack, carry, streams), lambda: (carry, streams)
        )
        done = jax.lax.cond(p.last & p.valid(j), lambda: p.epilogue(outside, out, j), lambda: zero_out)
        return (p.send(out, 1), streams), done

    (_, streams), (losses, aux) = jax.lax.scan(tick, (zero_carry, p.streams), jnp.arange(ticks))
    first = p.n - 1  # the last stage's tick of microbatch 0
    aux = jax.tree.map(lambda a: a[first : first + p.k], aux)
    return jnp.sum(losses) * scale, (jnp.sum(losses), aux, streams)


def _backward(
    p: _Stages, outside: nnx.State, stack: nnx.State, zero_out: Any, scale: float,
    c: Any, used: nnx.State, g: list[Any], j: Any, u: Any,
) -> tuple[Any, ...]:  # fmt: skip
    """1F1B's backward slot on microbatch ``j`` through chunk ``u`` (its input ``c``, the streams it
    drew from ``used``, the output's cotangent ``g``): its forward recomputed, with the prologue on
    the first chunk and the loss on the last. ``(d outside, d chunk, d input, loss, aux, streams
    after, ())``."""
    first, last = p.starts(u), p.ends(u)

    def f(outside: nnx.State, stack: nnx.State, floats: list[Any]) -> tuple[Any, Any]:
        c_in = with_floats(c, floats)
        c_in = jax.lax.cond(first, lambda: _typed_like(p.prologue(outside, j), c_in), lambda: c_in)
        out, drawn = p.stage(stack, c_in, used)
        loss, aux = jax.lax.cond(last, lambda: p.epilogue(outside, out, j), lambda: zero_out)
        return (floats_of(out), loss), (aux, drawn)

    (out, loss), vjp, (aux, drawn) = jax.vjp(f, outside, p.chunk(stack, u), floats_of(c), has_aux=True)
    ct = (jax.lax.cond(last, lambda: _zeros_like(out), lambda: g), jnp.full_like(loss, scale))
    d_outside, d_stack, d_c = vjp(ct)
    return d_outside, d_stack, d_c, loss, aux, drawn, ()


def _backward_input(
    p: _Stages, outside: nnx.State, stack: nnx.State, zero_out: Any, scale: float,
    c: Any, used: nnx.State, g: list[Any], j: Any, u: Any,
) -> tuple[Any, ...]:  # fmt: skip
    """ZB-H1's backward slot (``u`` is 0: one chunk a stage): ``_backward``'s without the stack's
    weights' gradient (``()`` in its place; the outside parameters' here), each layer's pullback and
    output cotangent kept last."""

    def pro(outside: nnx.State, floats: list[Any]) -> list[Any]:
        c_in = with_floats(c, floats)
        c_in = jax.lax.cond(p.first, lambda: _typed_like(p.prologue(outside, j), c_in), lambda: c_in)
        return floats_of(c_in)

    c_floats, pro_vjp = jax.vjp(pro, outside, floats_of(c))
    out, drawn, pullbacks = p.stage_pullbacks(stack, with_floats(c, c_floats), used)

    def epi(outside: nnx.State, floats: list[Any]) -> tuple[Any, Any]:
        loss = lambda: p.epilogue(outside, with_floats(out, floats), j)  # noqa: E731
        return jax.lax.cond(p.last, loss, lambda: zero_out)

    loss, epi_vjp, aux = jax.vjp(epi, outside, floats_of(out), has_aux=True)
    d_epi, d_out = epi_vjp(jnp.full_like(loss, scale))
    ct = jax.lax.cond(p.last, lambda: _typed_like(d_out, g), lambda: g)
    d_in, cts = p.staged.input_grads(stack, pullbacks, ct)
    d_pro, d_c = pro_vjp(_typed_like(d_in, floats_of(c)))
    d_outside = jax.tree.map(lambda a, b: a + b, d_pro, d_epi)
    return d_outside, (), d_c, loss, aux, drawn, (pullbacks, cts)


def _start(
    p: _Stages, outside: nnx.State, stack: nnx.State, zero_carry: Any, zero_out: Any, held: Any, dtype: Any
) -> tuple[Any, ...]:
    """The ticks' state before the first: nothing received, ``v x stash`` empty slots of chunk inputs
    and streams, zero gradients (in ``dtype``), losses and metrics, the held pullbacks' zeros."""
    slots = p.schedule.stash * p.v
    stash = jax.tree.map(lambda z: jnp.zeros((slots, *z.shape), z.dtype), zero_carry)
    own = p.chunk(p.streams, 0)
    stash = (p.varying(stash), jax.tree.map(lambda x: jnp.broadcast_to(x, (slots, *x.shape)), own))
    auxes = jax.tree.map(lambda z: jnp.zeros((p.k, *z.shape), z.dtype), zero_out[1])
    grads = (_zeros_like(outside, dtype), _zeros_like(stack, dtype))
    return (zero_carry, p.streams), floats_of(zero_carry), stash, grads, zero_out[0], p.varying(auxes), held


def _one_f_one_b(
    p: _Stages, outside: nnx.State, stack: nnx.State, scale: float, dtype: Any
) -> tuple[Any, Any, Any, Any, nnx.State]:
    """1F1B's or ZB-H1's ticks: ``(loss sum, aux, outside grads, stack grads, streams)``, this
    device's unreduced share, and its layers' random streams after their draws."""
    zero_carry = p.carry_type(outside, stack)
    zero_out = p.loss_type(outside, zero_carry)
    depth, held = p.schedule.stash, p.schedule.deferred
    zip_ = held > 0  # ZB-H1: the weights' gradient in a slot of its own
    slot = functools.partial(_backward_input if zip_ else _backward, p, outside, stack, zero_out, scale)
    with declared.silenced():  # a trace for the types of what the backward slot returns
        zero_back = _zeros_like(slot(zero_carry, p.chunk(p.streams, 0), floats_of(zero_carry), 0, 0))
    held_ = jax.tree.map(lambda z: jnp.zeros((held, *z.shape), z.dtype), zero_back[-1])
    held_ = _typed_like(held_, jax.tree.map(lambda z: z[None], zero_back[-1]))

    def tick(state: Any, t: Any, forward: bool, backward: bool, weight: bool) -> tuple[Any, None]:
        (recv, streams), recv_g, stash, (g_out, g_stack), losses, auxes, held_ = state
        if forward:  # its forward slot: microbatch jf from the previous stage (stage 0: the prologue)
            jf, uf = p.schedule.forward(t, p.s), p.schedule.forward_chunk(t, p.s)
            carry = jax.lax.cond(
                p.starts(uf) & p.valid(jf), lambda: _typed_like(p.prologue(outside, jf), recv), lambda: recv
            )
            # the chunk's input and the streams it draws from (the last chunk draws in its backward slot)
            own = p.chunk(streams, uf)
            stash = jax.lax.cond(
                p.valid(jf), lambda: put(stash, uf * depth + jf % depth, (carry, own)), lambda: stash
            )
            out, own = jax.lax.cond(
                p.valid(jf) & ~p.ends(uf),
                lambda: p.stage(p.chunk(stack, uf), carry, own),
                lambda: (carry, own),
            )
            streams, recv = p.with_chunk(streams, uf, own), p.send(out, 1)
        if backward:  # its backward slot: microbatch jb's cotangent from the next stage (the last: the loss)
            jb, ub = p.schedule.backward(t, p.s), p.schedule.backward_chunk(t, p.s)
            d_out, d_stack, d_c, loss, aux, drawn, kept = jax.lax.cond(
                p.valid(jb),
                lambda: slot(*take(stash, ub * depth + jb % depth), recv_g, jb, ub),
                lambda: zero_back,
            )
            if zip_:  # ZB-H1: the input's gradient sent on, the weights' held back
                held_ = jax.lax.cond(p.valid(jb), lambda: put(held_, jb % held, kept), lambda: held_)
            else:
                g_stack = p.with_chunk(g_stack, ub, _added(p.chunk(g_stack, ub), d_stack))
            last = p.ends(ub) & p.valid(jb)
            streams = p.with_chunk(streams, ub, advanced(p.chunk(streams, ub), drawn, last))
            g_out = _added(g_out, d_out)
            auxes = jax.lax.cond(last, lambda: put(auxes, jb, aux), lambda: auxes)
            losses, recv_g = losses + loss, p.send(d_c, -1)
        if weight:  # ZB-H1's weight slot: microbatch jw's, from its layers' pullbacks
            jw = p.schedule.weight(t, p.s)
            # the pullbacks run again: their collectives the weights' gradient needs stay, those of the
            # input's gradient alone XLA drops (which: the layer's; a norm's weights need its input's)
            with declared.optional(_WEIGHT):
                d_stack = jax.lax.cond(
                    p.valid(jw),
                    lambda: _typed_like(p.staged.weight_grads(stack, *take(held_, jw % held)), stack),
                    lambda: _zeros_like(stack),
                )
            g_stack = _added(g_stack, d_stack)
        return ((recv, streams), recv_g, stash, (g_out, g_stack), losses, auxes, held_), None

    state = _start(p, outside, stack, zero_carry, zero_out, held_, dtype)
    for start, stop, forward, backward, weight in p.schedule.phases:
        body = functools.partial(tick, forward=forward, backward=backward, weight=weight)
        with declared.looping(stop - start):  # a loop of one tick: XLA runs its body once, outside loops
            state, _ = jax.lax.scan(body, state, jnp.arange(start, stop))
    (_, streams), _, _, (g_out, g_stack), losses, auxes, _ = state
    return losses, auxes, g_out, g_stack, streams


def pipelined_value_and_grad(
    model: nnx.Module,
    split_loss: Callable[..., tuple[Any, Any]],
    shard: PyTree,
    share: Share,
    *,
    schedule: str,
    stage_axis: str,
    stack_path: KeyPath,
    virtual_stages: int = 1,
) -> tuple[jax.Array, Any, nnx.State]:
    """``local_value_and_grad``'s contract for a pipelined step: the global loss, the metrics
    stacked over microbatches, and this device's share of the gradient, unreduced over
    ``share.rows`` (the parameters outside the stack already summed over ``stage_axis``).

    ``model``'s parameters hold their whole values over ``share.rows`` (varying there unless
    ``share.one_device``); the stack's are this stage's layers (``virtual_stages`` chunks of them,
    moved to the stages that run them for an interleaved schedule and their gradients back).
    """
    microbatches = share.microbatches
    rows = () if share.one_device else spec_axes(share.rows)
    axes = (*rows, stage_axis)
    v = virtual_stages
    schedule_ = Schedule(schedule, jax.lax.axis_size(stage_axis), microbatches, v)
    note_pipeline(schedule_, mode="explicit")
    devices = math.prod(jax.lax.axis_size(a) for a in rows)
    slices = split_microbatches(shard, share.specs, share.rows, microbatches)
    staged = Staged(model, stack_path, lambda m, b: loss_and_metrics(split_loss(m, b), True))  # a scalar loss
    streams = _stage_streams(staged.streams, jax.tree.leaves(staged.stack)[0].shape[0], stage_axis)
    p = _Stages(staged, slices, schedule_, stage_axis, axes, streams)
    outside, stack = p.varying(staged.outside), p.varying(staged.stack)
    if v > 1:  # interleaved: each chunk to the stage that runs it (shard_state keeps them consecutive)
        stack, p.streams = moved(stack, stage_axis, v), moved(streams, stage_axis, v)
    scale = 1.0 / (microbatches * devices)
    if schedule == "gpipe":
        (_, (total, aux, streams)), (g_out, g_stack) = jax.value_and_grad(
            lambda o, s: _gpipe(p, o, s, scale), argnums=(0, 1), has_aux=True
        )(outside, stack)
    else:
        total, aux, g_out, g_stack, streams = _one_f_one_b(p, outside, stack, scale, share.accumulate_dtype)
    if v > 1:  # the chunks' gradients and draws home
        g_stack, streams = (
            moved(g_stack, stage_axis, v, back=True),
            moved(streams, stage_axis, v, back=True),
        )
    staged.keep_draws(model, streams)  # this stage's layers' counts (split over stage_axis, as placed)
    note_pipeline(aux=aux)
    with jax.named_scope(scopes.PIPELINE):  # the outside parameters' gradient, from the first and last stages
        g_out = jax.lax.psum(g_out, stage_axis)
    with jax.named_scope(scopes.LOSS):
        loss = jax.lax.psum(total * scale, axes)
    with jax.named_scope(scopes.METRICS):  # every stage's copy of the last stage's metrics
        aux = jax.tree.map(lambda a: _from_last(a, p.last, stage_axis), aux)
    grads = [(tuple(path), v) for path, v in nnx.to_flat_state(g_out)]
    grads += [((*staged.path, *path), v) for path, v in nnx.to_flat_state(g_stack)]
    order = {tuple(path): i for i, (path, _) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param)))}
    return loss, aux, nnx.from_flat_state(sorted(grads, key=lambda pv: order[pv[0]]))
