"""The small model and data the tests train, with no side effects on import.

``conftest.py`` sets up 8 emulated devices and re-exports these; worker scripts started
by ``python -m substrax.launch`` import this module directly, since importing
``conftest`` would override the launcher's per-process device count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, din: int = 4, width: int = 16, dout: int = 1, *, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(din, width, rngs=rngs)
        self.out = nnx.Linear(width, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


def mse(model: MLP, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def regression_batches(steps: int, rows: int, din: int = 4, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(din, 1))
    out = []
    for _ in range(steps):
        x = rng.normal(size=(rows, din)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x @ w).astype(np.float32)})
    return out
