"""A small Llama-style decoder, written as a Flax NNX user writes one: RoPE, grouped-query
attention, RMSNorm, SwiGLU, the embedding's table as the head; the blocks stacked with
``nnx.vmap`` and applied with ``nnx.scan``, under ``nnx.remat`` when asked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from models import stack


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding over ``x``'s ``[batch, seq, heads, head_dim]``."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]  # [seq, dim / 2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape)


class Block(nnx.Module):
    """Pre-norm attention (``heads`` query heads sharing ``kv_heads`` key/value heads) and a SwiGLU MLP."""

    def __init__(self, d: int, heads: int, kv_heads: int, hidden: int, rngs: nnx.Rngs) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.attn_norm, self.mlp_norm = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        kv = kv_heads * self.head_dim
        self.q, self.k, self.v = linear(d, d), linear(d, kv), linear(d, kv)
        self.o = linear(d, d)
        self.gate, self.up, self.down = linear(d, hidden), linear(d, hidden), linear(hidden, d)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.q(h).reshape(b, s, self.heads, self.head_dim))
        k = rope(self.k(h).reshape(b, s, self.kv_heads, self.head_dim))
        v = self.v(h).reshape(b, s, self.kv_heads, self.head_dim)
        repeat = self.heads // self.kv_heads
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        x = x + self.o(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
    """``Embed(vocab, d)``, ``depth`` ``Block``s stacked by ``nnx.vmap`` and applied by ``nnx.scan``
    (under ``nnx.remat`` with ``remat``), ``RMSNorm``, the table as the head."""

    def __init__(self, vocab: int = 256, d: int = 64, depth: int = 2, *, heads: int = 4, kv_heads: int = 2,
                 hidden: int = 128, remat: bool = True, seed: int = 0) -> None:  # fmt: skip
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = stack(lambda rngs: Block(d, heads, kv_heads, hidden, rngs), depth, rngs)
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.remat = remat

    def __call__(self, tokens: jax.Array) -> jax.Array:
        def body(x: jax.Array, block: Block) -> tuple[jax.Array, None]:
            return block(x), None

        if self.remat:
            body = nnx.remat(body)
        scan = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        x, _ = scan(self.embed(tokens), self.blocks)
        return self.embed.attend(self.norm(x))


def loss_fn(model: Llama, batch: dict) -> jax.Array:
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def batch(rows: int, seq: int = 16, vocab: int = 256, seed: int = 0) -> dict[str, np.ndarray]:
    """``rows`` windows of ``seq`` random tokens, each followed by its next token."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (rows, seq + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
