"""``make demo``: train one small MLP both ways on 8 emulated CPU devices.

Then the same model in every layout and mode. Run with
``python -m substrax.demo [--steps N] [--devices K]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import substrax
from substrax.mesh import DeviceMeshManager, mesh_info, use_cpu_devices
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards


class _MLP(nnx.Module):
    def __init__(self, din: int, width: int, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(din, width, rngs=rngs)
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.hidden(x)))


def _loss_fn(model: _MLP, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    err = model(batch["x"])[:, 0] - batch["y"]
    return jnp.mean(err**2), {"max_abs_err": jnp.max(jnp.abs(err))}


def _fresh(seed: int = 0) -> tuple[_MLP, nnx.Optimizer]:
    model = _MLP(8, 64, nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


def _train_step(mode: str, mesh: Any) -> Any:
    return substrax.make_train_step(_loss_fn, mode, mesh=mesh, has_aux=True, reduce={"max_abs_err": "max"})


class _Demo:
    """The data, the mesh and how a batch is placed."""

    def __init__(self, steps: int, batch: int) -> None:
        rng = np.random.default_rng(0)
        w_true = rng.normal(size=8).astype(np.float32)
        self.steps = steps
        self.x = rng.normal(size=(steps, batch, 8)).astype(np.float32)
        self.y = np.sin(self.x @ w_true).astype(np.float32)
        self.mesh = DeviceMeshManager.create_device_mesh({"data": jax.device_count()})
        self.sharding = create_data_parallel_sharding(self.mesh)

    def batch(self, i: int) -> dict[str, jax.Array]:
        return place_batch_on_shards({"x": self.x[i], "y": self.y[i]}, self.sharding)


def _train_both_ways(demo: _Demo, mode: str) -> tuple[list[float], float, float]:
    """The losses of ``mode``'s plain step, its median step time, and the bound step's."""
    with jax.set_mesh(demo.mesh):
        model, optimizer = _fresh()
    train_step = _train_step(mode, demo.mesh)
    losses, times = [], []
    for i in range(demo.steps):
        batch = demo.batch(i)
        start = time.perf_counter()
        loss, _ = train_step(model, optimizer, batch)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - start)
        losses.append(loss)
    step_ms = 1e3 * float(np.median(times[1:]))  # the first call compiles

    # The fast spelling for a loop: split once, donate the state every step.
    with jax.set_mesh(demo.mesh):
        model, optimizer = _fresh()
    batches = [demo.batch(i) for i in range(demo.steps)]
    times = []
    with train_step.bind(model, optimizer) as fast:
        for i, batch in enumerate(batches):
            start = time.perf_counter()
            loss, _ = fast(batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
            if abs(float(loss) - losses[i]) > 1e-5 * abs(losses[i]):
                raise SystemExit(f"{mode} bound step diverged from the plain step at step {i}")
    return losses, step_ms, 1e3 * float(np.median(times[1:]))


def _print_curves(curves: dict[str, list[float]], steps: int) -> None:
    print(f"\n{'step':>5} {'implicit loss':>14} {'explicit loss':>14} {'|diff|':>9}")
    for i in list(range(0, steps, max(1, steps // 10))) + [steps - 1]:
        a, b = curves["implicit"][i], curves["explicit"][i]
        print(f"{i:>5} {a:>14.6f} {b:>14.6f} {abs(a - b):>9.2e}")
    print(f"final loss: implicit {curves['implicit'][-1]:.6f}, explicit {curves['explicit'][-1]:.6f}")


def _layout_row(demo: _Demo, layout: str, mode: str, steps: int) -> tuple[list[float], Any]:
    """Train ``steps`` steps in ``layout`` and ``mode``, print its row; its losses and census."""
    model, optimizer = _fresh()
    if layout != "replicated":
        substrax.shard_state(model, optimizer, mesh=demo.mesh, params=layout == "fsdp", min_size=256)
    state_bytes = substrax.layout_of(model, optimizer, mesh=demo.mesh).bytes_per_device
    train_step = _train_step(mode, demo.mesh)
    found = train_step.census(model, optimizer, demo.batch(0))
    with train_step.bind(model, optimizer) as fast:
        losses = [float(fast(demo.batch(i))[0]) for i in range(steps)]
    r = found.report
    print(
        f"  {layout:<10} {mode:<9} {state_bytes:>14,}  {'matches' if found.matches else 'DIFFERS':<9} "
        f"{r.bytes_per_step('all-reduce'):>10,} {r.bytes_per_step('all-gather'):>10,} "
        f"{r.bytes_per_step('reduce-scatter'):>14,}  {losses[-1]:.6f}"
    )
    return losses, found


def _every_layout(demo: _Demo) -> None:
    """The same model in every layout and mode: what each device holds, what each step
    communicates, and the losses."""
    steps = min(demo.steps, 20)
    print(f"\nlayouts ({jax.device_count()} devices), {steps} steps each:")
    print(
        f"  {'layout':<10} {'mode':<9} {'state B/device':>14}  {'census':<9} {'all-reduce':>10} "
        f"{'all-gather':>10} {'reduce-scatter':>14}  final loss"
    )
    layout_losses: dict[tuple[str, str], list[float]] = {}
    fsdp_census = None
    for layout in substrax.LAYOUTS:
        for mode in substrax.MODES:
            layout_losses[layout, mode], found = _layout_row(demo, layout, mode, steps)
            if (layout, mode) == ("fsdp", "explicit"):
                fsdp_census = found
    base = np.asarray(layout_losses["replicated", "implicit"])
    worst = max(float(np.max(np.abs(np.asarray(v) - base) / np.abs(base))) for v in layout_losses.values())
    print(
        f"every layout and mode agrees with replicated implicit: largest relative loss difference {worst:.1e}"
    )
    print(f"\nthe census of the explicit FSDP step:\n{fsdp_census}")
    if worst > 1e-4:
        raise SystemExit("layouts disagree")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args(argv)
    use_cpu_devices(args.devices)

    from substrax.explicit import compare_gradients

    demo = _Demo(args.steps, args.batch)
    print(f"mesh: {mesh_info(demo.mesh)['shape']} on {jax.device_count()} {jax.default_backend()} devices")
    curves: dict[str, list[float]] = {}
    step_ms: dict[str, float] = {}
    bound_ms: dict[str, float] = {}
    for mode in substrax.MODES:
        curves[mode], step_ms[mode], bound_ms[mode] = _train_both_ways(demo, mode)
    _print_curves(curves, args.steps)

    report = compare_gradients(
        _MLP(8, 64, nnx.Rngs(1)), lambda m, b: _loss_fn(m, b)[0], {"x": demo.x[0], "y": demo.y[0]}, demo.mesh
    )
    print(f"\n{report}")
    print("\nmedian step time on emulated CPU devices (not a GPU; see README, Benchmarks):")
    for name in step_ms:
        print(
            f"  {name:<9} train_step(model, optimizer, batch) {step_ms[name]:6.2f} ms   "
            f"train_step.bind(model, optimizer)(batch) {bound_ms[name]:6.2f} ms"
        )
    if not report.ok:
        raise SystemExit("gradient check failed")
    _every_layout(demo)


if __name__ == "__main__":
    main()
