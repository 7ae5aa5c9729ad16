"""The small models and data the tests train (the stacked ones built by ``stack``), the one-device
run they are held to, and the state several files place or only shape, with no side effects
on import.

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

import substrax
import substrax.nn
from substrax.nn import ColumnParallelLinear, RowParallelLinear


def stack(layer: Callable[[nnx.Rngs], nnx.Module], depth: int, rngs: nnx.Rngs) -> nnx.Module:
    """``depth`` layers ``layer(rngs)`` stacked by ``nnx.vmap`` (the layer axis first, named in no
    partitioning): what ``substrax.nn.scan_layers``, ``units=`` and ``stages=`` take."""

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return layer(rngs)

    return make(rngs)


class Dense(nnx.Module):
    """One layer of a scanned stack: ``tanh(Linear(width, width)(x))``."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.linear(x))


class Residual(nnx.Module):
    """One residual MLP layer: [``LayerNorm``], a column-parallel up (``width -> 2 * width``), ``tanh``
    and a row-parallel down projection (on a mesh with ``model``, the hidden features split there);
    the branch times ``gate`` (times ``scale``) where given."""

    def __init__(self, width: int, rngs: nnx.Rngs, *, norm: bool = False) -> None:
        self.norm = nnx.LayerNorm(width, rngs=rngs) if norm else None
        self.up = ColumnParallelLinear(width, 2 * width, rngs=rngs)
        self.down = RowParallelLinear(2 * width, width, rngs=rngs)

    def __call__(
        self, x: jax.Array, gate: jax.Array | None = None, *, scale: float | None = None
    ) -> jax.Array:
        if gate is not None and scale is not None:
            gate = scale * gate
        y = self.down(jnp.tanh(self.up(x if self.norm is None else self.norm(x))))
        return x + (y if gate is None else gate * y)


class Tower(nnx.Module):
    """``Linear(4, width)``, ``depth`` layers ``layer(width, rngs)`` stacked (``stack``) and applied by
    ``substrax.nn.scan_layers``, ``Linear(width, 1)``. With ``gate``: a parameter
    ``linspace(-1, 1, width)`` every layer is given through a sigmoid (its gradient summed over
    the layers), and ``scale`` a static keyword they are given."""

    def __init__(
        self,
        layer: Callable[[int, nnx.Rngs], nnx.Module],
        depth: int,
        width: int,
        *,
        gate: bool = False,
        scale: float | None = None,
        seed: int = 0,
    ) -> None:
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Linear(4, width, rngs=rngs)
        self.gate = nnx.Param(jnp.linspace(-1.0, 1.0, width)) if gate else None
        self.layers = stack(lambda rngs: layer(width, rngs), depth, rngs)
        self.head = nnx.Linear(width, 1, rngs=rngs)
        self.scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:
        args = () if self.gate is None else (jax.nn.sigmoid(self.gate.get_value()),)
        kwargs = {} if self.scale is None else {"scale": self.scale}
        return self.head(substrax.nn.scan_layers(self.layers, self.embed(x), *args, **kwargs))[:, 0]


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


def make_placed(
    model: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    **placement: Any,
) -> tuple[nnx.Module, nnx.Optimizer]:
    """``model()`` and its ``tx`` optimizer made under ``mesh``, then placed by
    ``substrax.shard_state(..., mesh=mesh, **placement)`` where a placement is given."""
    with jax.set_mesh(mesh):
        made = model()
        optimizer = nnx.Optimizer(made, tx, wrt=nnx.Param)
    if placement:
        substrax.shard_state(made, optimizer, mesh=mesh, **placement)
    return made, optimizer


def abstract_mlp(din: int, width: int, dout: int) -> tuple[MLP, nnx.Optimizer]:
    """``MLP(din, width, dout)`` and its ``optax.adam(1e-3)`` optimizer as shapes (``nnx.eval_shape``):
    state without arrays, for a mesh of compile-only devices."""

    def build() -> tuple[MLP, nnx.Optimizer]:
        model = MLP(din, width, dout)
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    return nnx.eval_shape(build)


def abstract_batch(rows: int, din: int, dout: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of a float32 batch of ``rows`` rows: ``x`` of ``din`` features, ``y`` of ``dout``."""
    f32 = jnp.float32
    return {"x": jax.ShapeDtypeStruct((rows, din), f32), "y": jax.ShapeDtypeStruct((rows, dout), f32)}


def mse(model: MLP, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def params_of(model: nnx.Module) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


def sine_batches(steps: int, rows: int, din: int = 4, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``steps`` batches of ``rows`` normal rows ``x`` (``din`` features) and ``y = sin(sum(x))``, one
    generator."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(rows, din)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x.sum(axis=1)).astype(np.float32)})
    return out


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


def one_device_params(
    model: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    batches: list[Any],
    loss_fn: Callable[..., jax.Array] = mse,
) -> dict[str, np.ndarray]:
    """``model()`` trained with ``tx`` on each batch whole on ``jax.devices()[0]`` (``nnx.grad``, no
    mesh): its parameters, the reference a step's are held to."""
    with jax.default_device(jax.devices()[0]):
        trained = model()
        optimizer = nnx.Optimizer(trained, tx, wrt=nnx.Param)
        step = nnx.jit(lambda m, o, b: o.update(m, nnx.grad(loss_fn)(m, b)))
        for b in batches:
            step(trained, optimizer, b)
    return params_of(trained)


@functools.cache
def _one_device_step(loss_fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return step
