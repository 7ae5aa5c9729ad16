"""8 emulated CPU devices for the whole suite, and the small models the tests train."""

from __future__ import annotations

import jax

from substrax.mesh import use_cpu_devices

use_cpu_devices(8)  # before anything touches a backend

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from substrax.mesh import create_device_mesh  # noqa: E402


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


def params_of(model: nnx.Module) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


def reference_training(batches: list[dict], *, lr: float = 1e-2, seed: int = 0) -> tuple[list[float], dict]:
    """Train on one device, no mesh, no sharding: the reference both paths must match."""
    device = jax.devices()[0]
    with jax.default_device(device):
        model = MLP(seed=seed)
        optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

        @nnx.jit
        def step(model: MLP, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
            loss, grads = nnx.value_and_grad(mse)(model, batch)
            optimizer.update(model, grads)
            return loss

        losses = [float(step(model, optimizer, jax.device_put(b, device))) for b in batches]
    return losses, params_of(model)


def assert_params_close(got: dict, want: dict, *, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.fixture(scope="session")
def mesh8() -> jax.sharding.Mesh:
    return create_device_mesh({"data": 8})
