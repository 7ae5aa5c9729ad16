"""``ParallelSelfAttention``: multi-head self-attention with its heads split over the model axis."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from substrax.mesh import current_mesh_with
from substrax.nn._declare import copy_to_model_axis
from substrax.nn._linear import (
    BIAS_INIT,
    KERNEL_INIT,
    ColumnParallelLinear,
    Initializer,
    RowParallelLinear,
    gather_sequence,
    split_over,
)

__all__ = ["ParallelSelfAttention"]


def _check_heads(num_heads: int, size: int, axis: str) -> None:
    if num_heads % size:
        raise ValueError(
            f"ParallelSelfAttention: num_heads={num_heads} cannot be split over axis {axis!r} of "
            f"size {size}; the axis size must divide the number of heads."
        )


class ParallelSelfAttention(nnx.Module):
    """Softmax self-attention, Megatron-style: each device of ``model_axis`` runs its own heads.

    ``query``, ``key``, ``value`` are ``ColumnParallelLinear``s (whole heads per device, no
    communication), ``out`` a ``RowParallelLinear`` (the one forward ``psum``). Anywhere else
    it is plain attention, ``softmax(q k^T / sqrt(head_dim)) v`` per head, then ``out``.

    Args:
      num_heads: The number of heads; ``model_axis``'s size must divide it.
      in_features: The input's last dimension.
      qkv_features: The queries', keys' and values' features, all heads together;
        default ``in_features``. ``num_heads`` must divide it.
      out_features: The output's last dimension; default ``in_features``.
      causal: Whether position ``i`` attends only to positions ``<= i``.
      use_bias: For the four projections, as ``nnx.Linear``'s.
      dtype: For the four projections, as ``nnx.Linear``'s.
      param_dtype: For the four projections, as ``nnx.Linear``'s.
      precision: For the four projections, as ``nnx.Linear``'s.
      kernel_init: For the four projections, as ``nnx.Linear``'s.
      bias_init: For the four projections, as ``nnx.Linear``'s.
      model_axis: The mesh axis the heads are split over.
      sequence_parallel: Inside ``shard_map``, the input arrives split over ``model_axis``
        on the sequence (second-to-last dimension), gathered once for the three
        projections, and the output leaves split so (``out`` reduce-scatters).
      rngs: The projections' parameters come from ``rngs.params()``: query, key,
        value, out, each its kernel then its bias.

    Raises:
      ValueError: If ``num_heads`` does not divide ``qkv_features``, or a mesh with
        ``model_axis`` is set and its size does not divide ``num_heads``.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        *,
        qkv_features: int | None = None,
        out_features: int | None = None,
        causal: bool = False,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = KERNEL_INIT,
        bias_init: Initializer = BIAS_INIT,
        model_axis: str = "model",
        sequence_parallel: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        qkv_features = in_features if qkv_features is None else qkv_features
        out_features = in_features if out_features is None else out_features
        if qkv_features % num_heads:
            raise ValueError(
                f"ParallelSelfAttention: qkv_features={qkv_features} is not a multiple of "
                f"num_heads={num_heads}."
            )
        mesh = current_mesh_with(model_axis)
        if mesh is not None:
            _check_heads(num_heads, mesh.shape[model_axis], model_axis)
        common: dict[str, Any] = {
            "use_bias": use_bias,
            "dtype": dtype,
            "param_dtype": param_dtype,
            "precision": precision,
            "kernel_init": kernel_init,
            "bias_init": bias_init,
            "model_axis": model_axis,
            "rngs": rngs,
        }
        self.query = ColumnParallelLinear(in_features, qkv_features, **common)
        self.key = ColumnParallelLinear(in_features, qkv_features, **common)
        self.value = ColumnParallelLinear(in_features, qkv_features, **common)
        self.out = RowParallelLinear(
            qkv_features, out_features, sequence_parallel=sequence_parallel, **common
        )
        self.num_heads = num_heads
        self.head_dim = qkv_features // num_heads
        self.causal = causal
        self.model_axis = model_axis
        self.sequence_parallel = sequence_parallel

    def _local_heads(self) -> int | None:
        """How many heads this device runs; ``None`` (all of them) unless inside ``shard_map`` over the
        axis."""
        axis = self.model_axis
        whole = self.num_heads * self.head_dim
        if not split_over(self.query.kernel[...], axis, 1, whole, "ParallelSelfAttention"):
            return None
        size = jax.lax.axis_size(axis)
        _check_heads(self.num_heads, size, axis)
        return self.num_heads // size

    def __call__(self, x: jax.Array) -> jax.Array:
        """Attend over ``x``'s second-to-last dimension: ``(..., seq, in)`` to ``(..., seq, out)``.

        Raises:
          ValueError: Inside ``shard_map``, if ``model_axis``'s size does not divide
            ``num_heads``.
        """
        heads = self._local_heads()
        if heads is None:
            heads = self.num_heads
        elif self.sequence_parallel:  # the whole sequence, gathered once for the three projections
            x = gather_sequence(self, x, self.model_axis, x.ndim - 2)
        else:  # one cast for the three projections: one psum of x's gradient, not three
            x = copy_to_model_axis(self, x, self.model_axis)

        def split_heads(y: jax.Array) -> jax.Array:
            return y.reshape(*y.shape[:-1], heads, self.head_dim)

        q = split_heads(self.query(x)) / math.sqrt(self.head_dim)
        k, v = split_heads(self.key(x)), split_heads(self.value(x))
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k)
        if self.causal:
            seq = x.shape[-2]
            mask = jnp.tril(jnp.ones((seq, seq), bool))
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        mixed = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return self.out(mixed.reshape(*mixed.shape[:-2], heads * self.head_dim))
