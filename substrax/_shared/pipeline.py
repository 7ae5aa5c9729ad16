"""Pipelines, both modes: the loss cut at the staged stack (pipelines guide).

A pipelined step runs ``loss_fn`` in three pieces, cut where ``substrax.nn.scan_layers``
applies the stack placed over the ``stage`` axis (``shard_state(..., stages=...)``):

- the *prologue*, ``(outside, microbatch) -> carry``: ``loss_fn`` up to the stack (the
  embedding), stopped there (``scan_layers`` raises ``_Reached`` with its input);
- the *stage*, ``(stack, carry, streams) -> (carry, streams)``: one stage's consecutive layers,
  ``nnx.scan``, drawing from their random streams (dropout: a key and a count per layer), which
  each stage carries from microbatch to microbatch;
- the *epilogue*, ``(outside, carry, microbatch) -> (loss, aux)``: ``loss_fn`` again, its
  ``scan_layers`` returning the given carry (the head and the loss; the prologue's work
  before it is dead code, removed by XLA).

``outside`` is every parameter not in the stack; a carry is ``(x, arrays)``: the stack's
input and the arrays among ``scan_layers``'s other arguments (a mask), which travel
with it from stage to stage. The modes run the pieces on a schedule
(``substrax._shared.schedule.Schedule``):
``substrax.explicit._pipeline`` under ``shard_map``, ``substrax.spmd._pipeline`` under ``jit``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import get_opaque_trace_state

from substrax._base import declared
from substrax._base.hooks import STAGE_HOOK
from substrax._base.trees import KeyPath, PyTree, node_at, path_str
from substrax._layout import STAGE_AXIS, staged_chunks, staged_stack
from substrax._shared.schedule import check_stage_axis

__all__ = [
    "Staged",
    "advanced",
    "floats_of",
    "pipeline_of",
    "put",
    "take",
    "with_floats",
]


def pipeline_of(options: Any, mesh: Any, model: nnx.Module) -> KeyPath | None:
    """The staged stack's path when ``options`` asks for a pipeline, else None; a mismatch refused.

    Raises:
      ValueError: If ``schedule`` comes with a mesh without a ``stage`` axis or a model
        without a staged stack, or a staged model comes without ``schedule``.
    """
    stack = staged_stack(model)
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    if options.schedule is not None and options.precision is not None:
        raise ValueError(
            f"schedule={options.schedule!r} with precision=: a pipelined step runs in the parameters' own "
            f"dtype for now. Drop precision=, or train without schedule=."
        )
    if options.schedule is None:
        if stack is not None and STAGE_AXIS in names:
            raise ValueError(
                f"{path_str(stack, 'model')} is split over the {STAGE_AXIS!r} axis "
                f"(shard_state(..., stages=)), "
                f"each stage holding its own layers: the step must run it as a pipeline. Build it with "
                f"make_train_step(..., microbatches=k, schedule='gpipe' or '1f1b'), or place the state "
                f"on a mesh without {STAGE_AXIS!r}."
            )
        return None
    check_stage_axis(options.schedule, mesh)
    if stack is None:
        raise ValueError(
            f"schedule={options.schedule!r} pipelines the stack that shard_state split over {STAGE_AXIS!r}, "
            f"and no parameter of the model is placed so. Place the state with shard_state(model, "
            f"optimizer, mesh=mesh, stages=Block) (Block: the stacked layers' type) first."
        )
    chunks, interleaved = staged_chunks(model), options.schedule == "interleaved-1f1b"
    if interleaved and chunks == 1:
        raise ValueError(
            f"schedule='interleaved-1f1b' runs several chunks of {path_str(stack, 'model')} a stage, and "
            f"shard_state placed it with one (virtual_stages=1: that is schedule='1f1b'). Place the state "
            f"with shard_state(..., stages=Block, virtual_stages=2), or use schedule='1f1b'."
        )
    if chunks > 1 and not interleaved:
        raise ValueError(
            f"shard_state placed {path_str(stack, 'model')} with virtual_stages={chunks} chunks a stage, "
            f"which only schedule='interleaved-1f1b' runs; schedule={options.schedule!r} runs one. Build "
            f"the step with schedule='interleaved-1f1b', or place the state without virtual_stages=."
        )
    return stack


def _scan_stack(
    graphdef: Any, params: nnx.State, streams: nnx.State, x: Any, args: Any, kwargs: Any, remat: bool
) -> tuple[Any, nnx.State]:
    """``scan_layers``'s ``nnx.scan`` as ``jax.lax.scan`` over the stack's state (each layer merged
    from its slice), so that it traces at any level of the pipeline's loops and conds: the output,
    and the layers' random streams after their draws."""

    def body(h: Any, layer: tuple[nnx.State, nnx.State]) -> tuple[Any, nnx.State]:
        merged = nnx.merge(graphdef, *layer)
        return merged(h, *args, **kwargs), nnx.state(merged, nnx.RngState)

    if remat:
        body = jax.checkpoint(body)
    with declared.looping(_layers(params)):
        return jax.lax.scan(body, x, (params, streams))


def _layers(stack: nnx.State) -> int:
    """The layers of a stack's slice (its leaves' leading axis)."""
    return int(jax.tree.leaves(stack)[0].shape[0])


def take(tree: PyTree, i: Any) -> PyTree:
    """Entry ``i`` (an int or a traced index) of each leaf's leading axis."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)


def put(tree: PyTree, i: Any, value: PyTree) -> PyTree:
    """``tree`` with entry ``i`` of each leaf's leading axis set to ``value``'s leaf."""
    return jax.tree.map(lambda x, v: jax.lax.dynamic_update_index_in_dim(x, v, i, 0), tree, value)


def advanced(streams: nnx.State, drawn: nnx.State, valid: Any) -> nnx.State:
    """``streams`` with each count taken from ``drawn`` (the same streams after a stage's draws) where
    ``valid``: one flag, or one per stage (the leading axis); a bubble's slot draws nothing."""

    def pick(old: nnx.Variable[Any], new: nnx.Variable[Any]) -> nnx.Variable[Any]:
        if not isinstance(old, nnx.RngCount):
            return old
        x, flag = new.get_value(), jnp.asarray(valid)
        flag = jnp.reshape(flag, flag.shape + (1,) * (x.ndim - flag.ndim))
        return old.replace(jnp.where(flag, x, old.get_value()))

    return jax.tree.map(pick, streams, drawn, is_leaf=lambda x: isinstance(x, nnx.Variable))


def floats_of(carry: PyTree) -> list[Any]:
    """The floating leaves of a carry: what a stage differentiates (a mask or positions are not)."""
    return [x for x in jax.tree.leaves(carry) if jnp.issubdtype(x.dtype, jnp.inexact)]


def with_floats(carry: PyTree, floats: list[Any]) -> PyTree:
    """``carry`` with its floating leaves replaced by ``floats`` (``floats_of``'s inverse)."""
    leaves, treedef = jax.tree.flatten(carry)
    it = iter(floats)
    return jax.tree.unflatten(
        treedef, [next(it) if jnp.issubdtype(x.dtype, jnp.inexact) else x for x in leaves]
    )


class _Reached(Exception):
    """Raised by ``scan_layers`` in a prologue: the stack's input was reached."""

    def __init__(self, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any], remat: bool) -> None:
        super().__init__("the staged stack was reached")
        self.x, self.args, self.kwargs, self.remat = x, args, kwargs, remat


def _trace() -> Any:
    """The trace jax is building now (a transform inside ``loss_fn`` builds another)."""
    return get_opaque_trace_state(convention="nnx")


class _Capture:
    def __init__(self, where: str) -> None:
        self.where, self.trace = where, _trace()

    def reached(
        self, stack: nnx.Module, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any], remat: bool
    ) -> Any:
        if _trace() != self.trace:  # its input would leak out of the transform's trace
            raise ValueError(
                f"loss_fn ran the staged stack {self.where} through scan_layers inside a transform of its "
                f"own (jax.checkpoint, nnx.remat, a vmap or a loop around it): a pipeline cuts the loss "
                f"at scan_layers and runs each stage's layers in its own loop, which no transform in "
                f"loss_fn can span. Call scan_layers at the top level of the forward pass; to recompute "
                f"the layers in the backward pass, ask scan_layers: substrax.nn.scan_layers(stack, x, "
                f"remat=True) (each layer rematerialized within its stage)."
            )
        raise _Reached(x, args, kwargs, remat)


class _Replace:
    def __init__(self, y: Any, where: str, resume: Callable[[], Any]) -> None:
        self.y, self.where, self.used, self.resume = y, where, 0, resume

    def reached(
        self, stack: nnx.Module, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any], remat: bool
    ) -> Any:
        self.resume()  # the layers after the stack run: record what they declare again
        self.used += 1
        if self.used > 1:
            raise ValueError(
                f"loss_fn ran the staged stack {self.where} through scan_layers twice; a pipeline runs "
                f"its layers once per microbatch. Place a stack applied once with stages=, or pipeline "
                f"without reusing it."
            )
        return self.y


@dataclasses.dataclass(frozen=True)
class _Static:
    """What a stage needs besides arrays: the non-array arguments of ``scan_layers``, ``remat``."""

    treedef: Any
    leaves: tuple[Any, ...]  # None where an array goes
    remat: bool

    def rebuild(self, arrays: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        it = iter(arrays)
        return jax.tree.unflatten(self.treedef, [next(it) if x is None else x for x in self.leaves])


class Staged:
    """A model cut at its staged stack: the prologue, the stage and the epilogue as functions.

    Built from a model (inside the step's trace: a merged copy whose parameters are the
    values to differentiate) and ``split_loss``, ``(model, batch) -> (loss, aux)``.
    ``outside`` and ``stack`` are ``nnx.State``s of its parameters; the functions merge
    them again (the stack's with paths relative to it).

    ``streams``: the stack's random streams (``nnx.RngState``, a key and a count per layer:
    ``nnx.split_rngs``), which a stage hands its layers and takes back advanced.

    Raises:
      ValueError: If the stack holds state other than ``nnx.Param`` and random streams (its
        layers must be functions of their parameters and draws), naming it.
    """

    def __init__(
        self, model: nnx.Module, stack_path: KeyPath, split_loss: Callable[..., tuple[Any, Any]]
    ) -> None:
        self.path, self.split_loss = tuple(stack_path), split_loss
        self.where = path_str(self.path, "model")
        n = len(self.path)
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        flat = [(tuple(p), v) for p, v in nnx.to_flat_state(params)]
        self.outside = nnx.from_flat_state([(p, v) for p, v in flat if p[:n] != self.path])
        self.stack_whole = nnx.from_flat_state([(p, v) for p, v in flat if p[:n] == self.path])
        self.stack_graphdef, self.stack, self.streams, other = nnx.split(
            node_at(model, self.path), nnx.Param, nnx.RngState, ...
        )
        for p, v in nnx.to_flat_state(other):
            raise ValueError(
                f"The staged stack {self.where} holds {path_str(tuple(p), 'stack')} ({type(v).__name__}): "
                f"a pipeline runs each stage's layers as functions of their parameters and random streams "
                f"only (no batch statistics or other state in the stack). Remove it from the layers "
                f"(LayerNorm rather than BatchNorm), or place the model without stages=."
            )
        self.static: _Static | None = None

    def _model(self, outside: nnx.State, stack_whole: nnx.State | None = None) -> nnx.Module:
        whole = jax.tree.map(jax.lax.stop_gradient, self.stack_whole) if stack_whole is None else stack_whole
        return nnx.merge(self.graphdef, outside, whole, self.rest, copy=True)

    def _unchanged(self, model: nnx.Module, what: str) -> None:
        """Refuse ``loss_fn`` changing the model's state other than parameters (a pipeline drops it)."""
        before = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(self.rest)}
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param))):
            if v.get_value() is not before.get(tuple(p)):
                raise ValueError(
                    f"loss_fn changed {path_str(tuple(p), 'model')} ({type(v).__name__}) {what}: a pipelined "
                    f"step runs the loss in pieces, once per microbatch and stage, and keeps no state but "
                    f"the parameters. Keep that state fixed in the loss (dropout off, BatchNorm in eval "
                    f"mode, no random draws), or train without schedule=."
                )

    def prologue(self, outside: nnx.State, batch: PyTree) -> tuple[Any, list[Any]]:
        """``loss_fn`` up to the stack: the carry ``(x, arrays)`` entering its first layer."""
        model = self._model(outside)
        object.__setattr__(node_at(model, self.path), STAGE_HOOK, _Capture(self.where))
        try:
            self.split_loss(model, batch)
        except _Reached as r:
            reached = r
        else:
            raise ValueError(
                f"loss_fn never ran the staged stack {self.where} through substrax.nn.scan_layers: a "
                f"pipeline cuts the loss there. Apply the stack with scan_layers(stack, x, ...), at the top "
                f"level of the forward pass (not inside another transform)."
            )
        self._unchanged(model, "before the staged stack")
        leaves, treedef = jax.tree.flatten((reached.args, reached.kwargs))
        arrays = [x for x in leaves if isinstance(x, jax.Array)]
        static = _Static(
            treedef, tuple(None if isinstance(x, jax.Array) else x for x in leaves), reached.remat
        )
        if self.static is None:
            self.static = static
        return reached.x, arrays

    def stage(
        self, stack: nnx.State, carry: tuple[Any, list[Any]], streams: nnx.State
    ) -> tuple[tuple[Any, list[Any]], nnx.State]:
        """One stage: ``carry``'s ``x`` through the layers of ``stack`` (this stage's slice of it),
        drawing from ``streams`` (the same slice of the stack's random streams); those after."""
        assert self.static is not None, "the prologue is traced first"
        x, arrays = carry
        args, kwargs = self.static.rebuild(arrays)
        y, streams = _scan_stack(self.stack_graphdef, stack, streams, x, args, kwargs, self.static.remat)
        if jnp.shape(y) != jnp.shape(x) or jnp.result_type(y) != jnp.result_type(x):
            raise ValueError(
                f"The staged stack {self.where} maps its input {jax.typeof(x).str_short()} to "
                f"{jax.typeof(y).str_short()}; its layers must keep the carry's shape and dtype."
            )
        return (y, arrays), streams

    def stage_pullbacks(
        self, stack: nnx.State, carry: tuple[Any, list[Any]], streams: nnx.State
    ) -> tuple[tuple[Any, list[Any]], nnx.State, list[Any]]:
        """``stage`` keeping each layer's pullback (``jax.vjp`` of the layer in its parameters and
        the carry's floating leaves): the carry after, the streams after, and the pullbacks' leaves
        but the parameters (``stack`` holds those), stacked over layers (ZB-H1: ``input_grads``
        and ``weight_grads`` run them)."""
        assert self.static is not None, "the prologue is traced first"
        static = self.static

        def layer(params: nnx.State, floats: list[Any], layer_streams: nnx.State) -> tuple[list[Any], Any]:
            h, arrays = with_floats(carry, floats)
            args, kwargs = static.rebuild(arrays)
            merged = nnx.merge(self.stack_graphdef, params, layer_streams, copy=True)  # this trace's
            return floats_of((merged(h, *args, **kwargs), arrays)), nnx.state(merged, nnx.RngState)

        if static.remat:
            layer = jax.checkpoint(layer)

        def body(floats: list[Any], xs: tuple[nnx.State, nnx.State]) -> tuple[list[Any], Any]:
            params, layer_streams = xs
            run = functools.partial(layer, layer_streams=layer_streams)
            out, pullback, drawn = jax.vjp(run, params, floats, has_aux=True)
            leaves, treedef = jax.tree.flatten(pullback)
            where = {id(x): i for i, x in enumerate(jax.tree.leaves(params))}
            self.pullback_def = (treedef, tuple(where.get(id(x), -1) for x in leaves))
            return out, ([x for x in leaves if id(x) not in where], drawn)

        with declared.looping(_layers(stack)):
            floats, (pullbacks, drawn) = jax.lax.scan(body, floats_of(carry), (stack, streams))
        return with_floats(carry, floats), drawn, pullbacks

    def _pullback(self, kept: list[Any], params: nnx.State) -> Any:
        """A layer's pullback from its kept leaves and its parameters."""
        treedef, which = self.pullback_def
        it, own = iter(kept), jax.tree.leaves(params)
        return jax.tree.unflatten(treedef, [next(it) if i < 0 else own[i] for i in which])

    def input_grads(
        self, stack: nnx.State, pullbacks: list[Any], ct: list[Any]
    ) -> tuple[list[Any], list[Any]]:
        """The stage's input cotangent from its output's ``ct``, the layers run backward through their
        pullbacks (the weights' half left to XLA to drop); and each layer's output cotangent."""

        def body(ct: list[Any], xs: tuple[list[Any], nnx.State]) -> tuple[list[Any], list[Any]]:
            _, d_in = self._pullback(*xs)(ct)
            return [d.astype(c.dtype) for d, c in zip(d_in, ct, strict=True)], ct

        with declared.looping(_layers(stack)):
            return jax.lax.scan(body, ct, (pullbacks, stack), reverse=True)

    def weight_grads(self, stack: nnx.State, pullbacks: list[Any], cts: list[Any]) -> nnx.State:
        """The stack's gradient from each layer's pullback and output cotangent (``input_grads``'s)."""

        def body(_: None, xs: tuple[list[Any], nnx.State, list[Any]]) -> tuple[None, nnx.State]:
            d_params, _ = self._pullback(xs[0], xs[1])(xs[2])
            return None, d_params

        with declared.looping(_layers(stack)):
            return jax.lax.scan(body, None, (pullbacks, stack, cts))[1]

    def keep_draws(self, model: nnx.Module, streams: nnx.State) -> None:
        """Set the counts of ``model``'s stack to those of ``streams`` (the whole stack's, after the
        step's draws: each layer's count advanced as the same step without stages advances it)."""
        counts = [(p, v) for p, v in nnx.to_flat_state(streams) if isinstance(v, nnx.RngCount)]
        nnx.update(node_at(model, self.path), nnx.from_flat_state(counts))

    def epilogue(self, outside: nnx.State, carry: tuple[Any, list[Any]], batch: PyTree) -> tuple[Any, Any]:
        """``loss_fn`` from the stack's output ``carry`` on: ``(loss, aux)``."""
        model = self._model(outside)
        with declared.silenced_until() as resume:  # the prologue rerun before the cut is dead code
            replace = _Replace(carry[0], self.where, resume)
            object.__setattr__(node_at(model, self.path), STAGE_HOOK, replace)
            out = self.split_loss(model, batch)
        if not replace.used:
            raise ValueError(f"loss_fn ran the staged stack {self.where} once, then not again.")
        self._unchanged(model, "in the loss")
        return out
