"""Data-parallel training that runs unchanged on one process, on several, or on a cluster.

    python examples/train_multiprocess.py                                  # one process
    python -m substrax.launch -n 2 -d 4 examples/train_multiprocess.py     # 2 x 4 CPU devices
    srun --ntasks 4 python examples/train_multiprocess.py                  # SLURM: 4 processes

The only multi-process lines are ``substrax.launch.initialize()`` at the top and each
process loading its own rows of the global batch (``process_slice``); the mesh spans
every device of every process, and the step is the same one a single process runs.
"""

from __future__ import annotations

import argparse

import substrax.launch

substrax.launch.initialize()  # first thing: before anything touches a JAX backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import substrax  # noqa: E402
from substrax.launch import process_slice  # noqa: E402
from substrax.mesh import create_data_parallel_mesh  # noqa: E402
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, din: int, width: int, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(din, width, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.hidden(x)))


def mse(model: MLP, batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="global batch size, over all processes")
    parser.add_argument("--mode", choices=substrax.MODES, default="implicit")
    args = parser.parse_args()

    mesh = create_data_parallel_mesh()  # every device of every process
    sharding = create_data_parallel_sharding(mesh)
    with jax.set_mesh(mesh):
        model = MLP(8, 64, nnx.Rngs(0))  # same seed everywhere: the same replicated start
        optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    train_step = substrax.make_train_step(mse, args.mode, mesh=mesh)
    if jax.process_index() == 0:
        print(
            f"{jax.process_count()} process(es), {jax.device_count()} {jax.default_backend()} "
            f"devices, global batch {args.batch}, {args.mode} step"
        )

    # A stand-in for a sharded data loader: every process draws the same global batch
    # and keeps its own rows; a real loader would read only those.
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=8).astype(np.float32)
    mine = process_slice(args.batch)
    for step in range(args.steps):
        x = rng.normal(size=(args.batch, 8)).astype(np.float32)
        y = np.sin(x @ w_true).astype(np.float32)
        loss = train_step(model, optimizer, place_batch_on_shards({"x": x[mine], "y": y[mine]}, sharding))
        if jax.process_index() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:>4}  loss {float(loss):.6f}")


if __name__ == "__main__":
    main()
