"""``make demo``: train one small MLP both ways on 8 emulated CPU devices.

Then the same model in every layout and mode. Run with
``python -m substrax.demo [--steps N] [--devices K]``.
"""

from __future__ import annotations

import argparse
import time

import jax

from substrax.mesh import use_cpu_devices


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args(argv)
    use_cpu_devices(args.devices)

    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import substrax
    from substrax.explicit import compare_gradients
    from substrax.mesh import DeviceMeshManager, mesh_info
    from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

    class MLP(nnx.Module):
        def __init__(self, din: int, width: int, rngs: nnx.Rngs) -> None:
            self.hidden = nnx.Linear(din, width, rngs=rngs)
            self.out = nnx.Linear(width, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(jax.nn.gelu(self.hidden(x)))

    def loss_fn(model: MLP, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        err = model(batch["x"])[:, 0] - batch["y"]
        return jnp.mean(err**2), {"max_abs_err": jnp.max(jnp.abs(err))}

    rng = np.random.default_rng(0)
    w_true = rng.normal(size=8).astype(np.float32)
    x = rng.normal(size=(args.steps, args.batch, 8)).astype(np.float32)
    y = np.sin(x @ w_true).astype(np.float32)

    mesh = DeviceMeshManager.create_device_mesh({"data": jax.device_count()})
    sharding = create_data_parallel_sharding(mesh)
    print(f"mesh: {mesh_info(mesh)['shape']} on {jax.device_count()} {jax.default_backend()} devices")

    curves: dict[str, list[float]] = {}
    step_ms: dict[str, float] = {}
    bound_ms: dict[str, float] = {}
    for mode in substrax.MODES:
        with jax.set_mesh(mesh):
            model = MLP(8, 64, nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
        train_step = substrax.make_train_step(
            loss_fn, mode, mesh=mesh, has_aux=True, reduce={"max_abs_err": "max"}
        )
        losses, times = [], []
        for i in range(args.steps):
            batch = place_batch_on_shards({"x": x[i], "y": y[i]}, sharding)
            start = time.perf_counter()
            loss, metrics = train_step(model, optimizer, batch)
            loss = float(loss)  # waits for the step
            times.append(time.perf_counter() - start)
            losses.append(loss)
        curves[mode] = losses
        step_ms[mode] = 1e3 * float(np.median(times[1:]))  # the first call compiles

        # The fast spelling for a loop: split once, donate the state every step.
        with jax.set_mesh(mesh):
            model = MLP(8, 64, nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
        batches = [place_batch_on_shards({"x": x[i], "y": y[i]}, sharding) for i in range(args.steps)]
        times = []
        with train_step.bind(model, optimizer) as fast:
            for i, batch in enumerate(batches):
                start = time.perf_counter()
                loss, _ = fast(batch)
                jax.block_until_ready(loss)
                times.append(time.perf_counter() - start)
                if abs(float(loss) - curves[mode][i]) > 1e-5 * abs(curves[mode][i]):
                    raise SystemExit(f"{mode} bound step diverged from the plain step at step {i}")
        bound_ms[mode] = 1e3 * float(np.median(times[1:]))

    print(f"\n{'step':>5} {'implicit loss':>14} {'explicit loss':>14} {'|diff|':>9}")
    for i in list(range(0, args.steps, max(1, args.steps // 10))) + [args.steps - 1]:
        a, b = curves["implicit"][i], curves["explicit"][i]
        print(f"{i:>5} {a:>14.6f} {b:>14.6f} {abs(a - b):>9.2e}")
    print(f"final loss: implicit {curves['implicit'][-1]:.6f}, explicit {curves['explicit'][-1]:.6f}")

    model = MLP(8, 64, nnx.Rngs(1))
    report = compare_gradients(model, lambda m, b: loss_fn(m, b)[0], {"x": x[0], "y": y[0]}, mesh)
    print(f"\n{report}")
    print("\nmedian step time on emulated CPU devices (not a GPU; see README, Benchmarks):")
    for name in step_ms:
        print(
            f"  {name:<9} train_step(model, optimizer, batch) {step_ms[name]:6.2f} ms   "
            f"train_step.bind(model, optimizer)(batch) {bound_ms[name]:6.2f} ms"
        )
    if not report.ok:
        raise SystemExit("gradient check failed")

    # The same model in every layout and mode: what each device holds, what each step
    # communicates, and the losses.
    print(f"\nlayouts ({jax.device_count()} devices), {min(args.steps, 20)} steps each:")
    print(
        f"  {'layout':<10} {'mode':<9} {'state B/device':>14}  {'census':<9} {'all-reduce':>10} {'all-gather':>10} {'reduce-scatter':>14}  final loss"
    )
    layout_losses: dict[tuple[str, str], list[float]] = {}
    fsdp_census = None
    for layout in substrax.LAYOUTS:
        for mode in substrax.MODES:
            model = MLP(8, 64, nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
            if layout != "replicated":
                substrax.shard_state(model, optimizer, mesh=mesh, params=layout == "fsdp", min_size=256)
            state_bytes = substrax.layout_of(model, optimizer, mesh=mesh).bytes_per_device
            train_step = substrax.make_train_step(
                loss_fn, mode, mesh=mesh, has_aux=True, reduce={"max_abs_err": "max"}
            )
            found = train_step.census(
                model, optimizer, place_batch_on_shards({"x": x[0], "y": y[0]}, sharding)
            )
            if (layout, mode) == ("fsdp", "explicit"):
                fsdp_census = found
            with train_step.bind(model, optimizer) as fast:
                losses = [
                    float(fast(place_batch_on_shards({"x": x[i], "y": y[i]}, sharding))[0])
                    for i in range(min(args.steps, 20))
                ]
            layout_losses[layout, mode] = losses
            r = found.report
            print(
                f"  {layout:<10} {mode:<9} {state_bytes:>14,}  {'matches' if found.matches else 'DIFFERS':<9} "
                f"{r.bytes_per_step('all-reduce'):>10,} {r.bytes_per_step('all-gather'):>10,} "
                f"{r.bytes_per_step('reduce-scatter'):>14,}  {losses[-1]:.6f}"
            )
    base = np.asarray(layout_losses["replicated", "implicit"])
    worst = max(float(np.max(np.abs(np.asarray(v) - base) / np.abs(base))) for v in layout_losses.values())
    print(
        f"every layout and mode agrees with replicated implicit: largest relative loss difference {worst:.1e}"
    )
    print(f"\nthe census of the explicit FSDP step:\n{fsdp_census}")
    if worst > 1e-4:
        raise SystemExit("layouts disagree")


if __name__ == "__main__":
    main()
