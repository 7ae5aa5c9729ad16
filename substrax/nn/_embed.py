"""``ParallelEmbedding``: ``nnx.Embed`` with its table split over the model axis (``substrax.nn``)."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from substrax._base import scopes
from substrax._metrics.collectives import gather_invariant
from substrax.nn._declare import copy_to_model_axis, declare_forward
from substrax.nn._linear import Initializer, sharded_param, split_over

__all__ = ["ParallelEmbedding"]

Split = Literal["vocab", "features"]
SPLITS: tuple[Split, ...] = ("vocab", "features")
EMBED_INIT: Initializer = nnx.initializers.variance_scaling(
    1.0, "fan_in", "normal", out_axis=0
)  # nnx.Embed's


class ParallelEmbedding(nnx.Module):
    """``nnx.Embed`` whose table ``(num_embeddings, features)`` is split over ``model_axis``.

    Inside ``jax.shard_map(check_vma=True)``: ``split="vocab"`` (rows) ``psum``s the devices'
    lookups, ``split="features"`` (columns) all-gathers their features; the output is whole
    on every device. Anywhere else it is ``nnx.Embed``. Besides its own arguments (below) it
    takes ``nnx.Embed``'s, meaning what they mean there: the same ``rngs`` give the same table.

    Args:
      split: ``"vocab"`` or ``"features"``: the table's dimension split over ``model_axis``.
      model_axis: The mesh axis the table is split over.

    Raises:
      ValueError: If ``split`` is neither.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        split: Split = "vocab",
        model_axis: str = "model",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Initializer = EMBED_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"ParallelEmbedding: split must be one of {SPLITS}; got {split!r}.")
        spec = (model_axis, None) if split == "vocab" else (None, model_axis)
        table = embedding_init(rngs.params(), (num_embeddings, features), param_dtype)
        self.embedding = sharded_param(table, spec, model_axis)
        self.num_embeddings = num_embeddings
        self.features = features
        self.split = split
        self.model_axis = model_axis
        self.dtype = dtype or self.embedding.dtype
        self.param_dtype = param_dtype

    def _split_dim(self) -> int:
        return 0 if self.split == "vocab" else 1

    def _table(self, *arrays: jax.Array, inexact: bool = True) -> tuple[tuple[jax.Array, ...], bool]:
        """The promoted ``(*arrays, table)``, and whether the table is this device's shard."""
        promoted = dtypes.promote_dtype((*arrays, self.embedding[...]), dtype=self.dtype, inexact=inexact)
        whole = (self.num_embeddings, self.features)[self._split_dim()]
        split = split_over(promoted[-1], self.model_axis, self._split_dim(), whole, "ParallelEmbedding")
        return promoted, split

    def __call__(self, ids: jax.Array) -> jax.Array:
        """The embeddings of ``ids``: shape ``ids.shape + (features,)``, whole on every device.

        Raises:
          ValueError: If ``ids`` are not integers.
        """
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"ParallelEmbedding takes integer ids; got {ids.dtype}.")
        (table,), split = self._table(inexact=False)
        if not split:
            if self.num_embeddings == 1:
                return jnp.broadcast_to(table, ids.shape + (self.features,))
            return jnp.take(table, ids, axis=0)
        axis = self.model_axis
        if self.split == "features":
            with jax.named_scope(scopes.TENSOR_PARALLEL):
                found = gather_invariant(jnp.take(table, ids, axis=0), axis, axis=ids.ndim, tiled=True)
            declare_forward(self, "all-gather", axis, found, "the embeddings' features, gathered")
            return found
        rows = table.shape[0]
        local = ids - jax.lax.axis_index(axis) * rows
        mine = (local >= 0) & (local < rows)
        found = jnp.take(table, jnp.where(mine, local, 0), axis=0)
        found = jnp.where(mine[..., None], found, 0)
        declare_forward(self, "all-reduce", axis, found, "each device's rows of the lookups, summed")
        with jax.named_scope(scopes.TENSOR_PARALLEL):
            return jax.lax.psum(found, axis)

    def attend(self, query: jax.Array) -> jax.Array:
        """``query @ table.T``: logits over the vocabulary (tied output embedding).

        Inside ``shard_map``, ``split="vocab"`` gives each device its block of the vocabulary's
        logits (varying, as a ``ColumnParallelLinear``'s output); ``split="features"`` ``psum``s
        partial logits, so every device has all of them.
        """
        (query, table), split = self._table(query)
        if not split:
            return jnp.dot(query, table.T)
        query = copy_to_model_axis(self, query, self.model_axis)  # its gradient is psum-ed
        if self.split == "vocab":
            return jnp.dot(query, table.T)
        cols = table.shape[1]
        start = jax.lax.axis_index(self.model_axis) * cols
        query = jax.lax.dynamic_slice_in_dim(query, start, cols, axis=query.ndim - 1)
        logits = jnp.dot(query, table.T)
        declare_forward(self, "all-reduce", self.model_axis, logits, "the partial logits, summed")
        with jax.named_scope(scopes.TENSOR_PARALLEL):
            return jax.lax.psum(logits, self.model_axis)
