"""Interleaved stages' chunks moved between stages: to where they run, and home (pipelines guide).

``shard_state`` keeps the stack in the model's order (stage ``d`` holds chunks ``d v ...
d v + v - 1``); an interleaved step runs chunk ``c`` on stage ``c % S``. ``moved`` takes each
leaf's stage slice there (and back) in ``chunk_rounds``' rounds, one ``ppermute`` each.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from substrax._base import scopes
from substrax._base.trees import PyTree
from substrax._metrics.collectives import to_varying_over, varying_axes
from substrax._shared.pipeline_record import note_pipeline
from substrax._shared.schedule import chunk_rounds

__all__ = ["moved"]


def moved(tree: PyTree, axis: str, virtual: int, back: bool = False) -> PyTree:
    """Each leaf's stage slice (``virtual`` chunks of consecutive layers, as placed) with its chunks
    moved to the stages that run them (``chunk_rounds``: one ``ppermute`` a round); ``back``: home."""
    n = jax.lax.axis_size(axis)
    rounds, s = chunk_rounds(n, virtual), jax.lax.axis_index(axis)

    def leaf(x: Any) -> Any:
        m, key = x.shape[0] // virtual, jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        impl = jax.random.key_impl(x) if key else None
        data = jax.random.key_data(x) if key else x
        out = to_varying_over(jnp.zeros_like(data), tuple(varying_axes(data) or ()))
        for moves in rounds:
            pairs = [(e, d) if back else (d, e) for d, _, e, _ in moves]
            src, dst = [0] * n, [0] * n
            for d, a, e, b in moves:
                src[e if back else d], dst[d if back else e] = (b, a) if back else (a, b)
            piece = jax.lax.dynamic_slice_in_dim(data, jnp.asarray(src)[s] * m, m)
            if any(i != j for i, j in pairs):
                note_pipeline(moved=piece, back=back)
                with jax.named_scope(scopes.PIPELINE):
                    piece = jax.lax.ppermute(piece, axis, pairs)
            out = jax.lax.dynamic_update_slice_in_dim(out, piece, jnp.asarray(dst)[s] * m, 0)
        return jax.random.wrap_key_data(out, impl=impl) if key else out

    return jax.tree.map(leaf, tree)
