import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import substrax
from substrax.mesh import create_device_mesh


class MLP(nnx.Module):
    def __init__(self, din: int = 8, width: int = 128, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(din, width, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))[:, 0]


def loss_fn(model: MLP, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)  # a mean over the rows it sees


rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype(np.float32)
batch = {"x": x, "y": np.sin(x.sum(axis=1))}  # 64 rows, float32 NumPy arrays

mesh = create_device_mesh({"data": jax.device_count()})  # every device on one "data" axis
with jax.set_mesh(mesh):  # the state starts replicated on the mesh
    model = MLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
