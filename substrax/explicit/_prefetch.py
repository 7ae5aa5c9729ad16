"""A stacked FSDP unit with ``prefetch``: the explicit step's own loop over its layers.

Forward, layer i runs on weights gathered in the previous iteration while layer i+1's are
gathered; backward, in reverse, layer i's gradient is taken (its forward recomputed from
its saved input, as under ``nnx.remat``) and reduce-scattered while layer i-1's weights
are gathered. The first layer of each pass is gathered before its loop, the last one run
after it, so each layer is gathered once per pass. See the layouts guide, "Units".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from substrax._base import declared
from substrax._base.trees import merged, picked
from substrax._metrics.collectives import zeros_of_type

__all__ = ["prefetched_layers"]

# (one layer's shards, anchor) -> whole: gathered once the anchor exists, so that XLA neither
# hoists it out of an enclosing loop (microbatches) nor runs it before the pass reaches it
Gather = Callable[[list[jax.Array], Any], list[jax.Array]]
Scatter = Callable[[list[jax.Array]], list[jax.Array]]  # one layer's whole gradients -> shards
Apply = Callable[[list[Any], list[Any], jax.Array, list[Any]], jax.Array]  # (wholes, others, x, arrays) -> y


def _take(xs: list[jax.Array], i: Any) -> list[jax.Array]:
    """Layer ``i`` (an int or a traced index) of each stacked array."""
    return [jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False) for x in xs]


def _stacked(first: list[Any], rest: list[Any] | None) -> list[Any]:
    """Layer 0's values before layers 1 ... L-1's (stacked by the loop)."""
    if rest is None:
        return [f[None] for f in first]
    return [jnp.concatenate([f[None], r]) for f, r in zip(first, rest, strict=True)]


def _loop(body: Callable[[Any, Any], tuple[Any, Any]], init: Any, indices: range) -> tuple[Any, Any]:
    """``jax.lax.scan(body, init, indices)`` (in reverse for a falling range); one index runs
    without a loop, as XLA would compile it (the census counts loops)."""
    if len(indices) == 1:
        carry, ys = body(init, indices[0])
        return carry, jax.tree.map(lambda y: y[None], ys)
    reverse = indices.step < 0
    ordered = jnp.arange(min(indices), max(indices) + 1)
    return jax.lax.scan(body, init, ordered, reverse=reverse)


def prefetched_layers(
    apply: Apply, gather: Gather, scatter: Scatter, shards: list[jax.Array], others: list[jax.Array],
    x: jax.Array, arrays: list[Any], layers: int,
) -> jax.Array:  # fmt: skip
    """``x`` through ``layers`` layers: ``x = apply(whole_i, others_i, x, arrays)`` for each i.

    ``shards`` and ``others`` are stacked on axis 0 (one slice per layer): the split
    parameters, gathered by ``gather``, and the rest. Gradients flow to ``shards``
    (through ``scatter``), the perturbed ``others``, ``x`` and the perturbed ``arrays``.
    """
    stack = _Prefetched(apply, gather, scatter, layers - 1)
    run = jax.custom_vjp(stack.primal)
    run.defvjp(stack.fwd, stack.bwd, symbolic_zeros=True)
    return run(shards, others, x, arrays)


class _Prefetched:
    """``prefetched_layers``'s passes: the forward loop, and the custom VJP's rules around it."""

    def __init__(self, apply: Apply, gather: Gather, scatter: Scatter, last: int) -> None:
        self.apply, self.gather, self.scatter, self.last = apply, gather, scatter, last
        self.layout: dict[str, Any] = {}  # a trace's static facts: what is perturbed, the output's type

    def forward_loop(
        self, shards: list[Any], others: list[Any], x: Any, arrays: list[Any]
    ) -> tuple[Any, Any]:
        """``(y, the stacked input of each layer)``."""
        apply, gather, last = self.apply, self.gather, self.last
        w = gather(_take(shards, 0), x)
        inputs = None
        if last:

            def body(carry: Any, i: Any) -> tuple[Any, Any]:
                h, w = carry
                ahead = gather(_take(shards, i + 1), h)  # layer i+1's, while layer i runs
                return (apply(w, _take(others, i), h, arrays), ahead), h

            (x, w), inputs = _loop(body, (x, w), range(last))
        y = apply(w, _take(others, last), x, arrays)
        return y, x[None] if inputs is None else jnp.concatenate([inputs, x[None]])

    def primal(self, shards: list[Any], others: list[Any], x: Any, arrays: list[Any]) -> Any:
        with declared.silenced():  # traced beside ``fwd``, which records the layers' collectives
            return self.forward_loop(shards, others, x, arrays)[0]

    def fwd(self, shards: list[Any], others: list[Any], x: Any, arrays: list[Any]) -> tuple[Any, Any]:
        layout = self.layout
        layout["others"] = [p.perturbed for p in others]
        layout["arrays"] = [p.perturbed for p in arrays]
        shards, others, arrays = ([p.value for p in ps] for ps in (shards, others, arrays))
        y, inputs = self.forward_loop(shards, others, x.value, arrays)
        layout["out"] = jax.typeof(y)
        return y, (shards, others, arrays, inputs)

    def layer_grads(self, res: Any, w: list[Any], i: Any, g: Any) -> tuple[Any, Any, Any, Any]:
        """Layer ``i``'s ``(shards' gradient, others', its input's, the arrays')``, its forward recomputed."""
        _, others, arrays, inputs = res
        keep_o, keep_a = self.layout["others"], self.layout["arrays"]
        o_i = _take(others, i)

        def f(w: list[Any], o: list[Any], h: Any, a: list[Any]) -> Any:
            return self.apply(w, merged(o_i, keep_o, o), h, merged(arrays, keep_a, a))

        with declared.silenced():  # the census expects a recomputed forward's collectives as optional
            _, vjp = jax.vjp(f, w, picked(o_i, keep_o), _take([inputs], i)[0], picked(arrays, keep_a))
        d_w, d_o, d_h, d_a = vjp(g)
        return self.scatter(d_w), d_o, d_h, d_a

    def bwd(self, res: Any, ct: Any) -> tuple[Any, Any, Any, Any]:
        shards, _, arrays, _ = res
        gather, last = self.gather, self.last
        keep_o, keep_a = self.layout["others"], self.layout["arrays"]
        g = zeros_of_type(self.layout["out"]) if isinstance(ct, SymbolicZero) else ct
        w = gather(_take(shards, last), g)
        d_a = [zeros_of_type(jax.typeof(a)) for a in picked(arrays, keep_a)]
        rest = None
        if last:

            def body(carry: Any, i: Any) -> tuple[Any, Any]:
                g, w, d_a = carry
                behind = gather(_take(shards, i - 1), g)  # layer i-1's, while layer i's gradient runs
                d_s, d_o, d_h, d_ai = self.layer_grads(res, w, i, g)
                return (d_h, behind, [a + b for a, b in zip(d_a, d_ai, strict=True)]), (d_s, d_o)

            (g, w, d_a), rest = _loop(body, (g, w, d_a), range(last, 0, -1))
        d_s, d_o, d_h, d_ai = self.layer_grads(res, w, 0, g)
        d_a = [a + b for a, b in zip(d_a, d_ai, strict=True)]
        d_shards = _stacked(d_s, None if rest is None else rest[0])
        d_others = _stacked(d_o, None if rest is None else rest[1])
        return (
            [d.astype(s.dtype) for d, s in zip(d_shards, shards, strict=True)],
            merged([None] * len(keep_o), keep_o, d_others),
            d_h,
            merged([None] * len(keep_a), keep_a, d_a),
        )
