"""The small models and data the tests train, and the one-device run they are held to, with no
side effects on import.

``conftest.py`` sets up 8 emulated devices and re-exports these; worker scripts started
by ``python -m substrax.launch`` import this module directly, since importing
``conftest`` would override the launcher's per-process device count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, din: int = 4, width: int = 16, dout: int = 1, *, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(din, width, rngs=rngs)
        self.out = nnx.Linear(width, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


class Normed(nnx.Module):
    """``Linear(4, width)``, a ``BatchNorm`` in training mode (``axis_name`` as given), [``tanh``],
    ``Linear(width, 1)``: batch statistics that change in every step."""

    def __init__(
        self, axis_name: str | None = None, *, width: int = 8, momentum: float = 0.5, tanh: bool = False
    ) -> None:
        rngs = nnx.Rngs(0)
        self.hidden = nnx.Linear(4, width, rngs=rngs)
        self.norm = nnx.BatchNorm(width, momentum=momentum, axis_name=axis_name, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)
        self.tanh = tanh

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.norm(self.hidden(x))
        return self.out(jnp.tanh(x) if self.tanh else x)


class Dropped(nnx.Module):
    """The test MLP (4 -> 16 -> 1) with dropout after its ``tanh``: random streams (a key and a
    count) in the model's state."""

    def __init__(self, rate: float = 0.5, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(jnp.tanh(self.hidden(x))))


class Partitioned(nnx.Module):
    """A ``Linear(4, 8)`` whose kernel declares its partitioning ``(None, "model")``, a
    ``Linear(8, 2)`` head, and a batch statistic: state placed by its annotations."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.wide = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)
        self.count = nnx.BatchStat(jnp.zeros(()))


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


def one_device_training(
    batches: list[Any],
    tx: optax.GradientTransformation,
    *,
    model: Callable[[], nnx.Module] = MLP,
    loss_fn: Callable[..., jax.Array] = mse,
    device: Any = None,
) -> tuple[list[float], nnx.Module]:
    """Plain nnx on one device (``jax.devices()[0]`` unless given), no mesh, no sharding: the
    model ``model()`` trained with ``tx`` on each batch whole, its losses. The reference the
    steps are held to."""
    device = jax.devices()[0] if device is None else device
    with jax.default_device(device):
        trained = model()
        optimizer = nnx.Optimizer(trained, tx, wrt=nnx.Param)
        step = _one_device_step(loss_fn)
        losses = [float(step(trained, optimizer, jax.device_put(b, device))) for b in batches]
    return losses, trained


@functools.cache
def _one_device_step(loss_fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return step
