"""Step time of each training-step spelling against a hand-written bound.

For a sweep of MLP widths (small, where per-call dispatch dominates, up to large, where
the math does) and for 1 and 8 emulated CPU devices, times every spelling of one
data-parallel Adam step on the same batch:

- ``implicit``:  ``spmd_train_step`` inside ``nnx.jit`` (as the reference writes it)
- ``explicit``:  ``explicit_train_step`` inside ``nnx.jit``
- ``make_train_step:implicit`` / ``make_train_step:explicit``: the mode-choice entry point
- ``bound_step:implicit`` / ``bound_step:explicit``: ``make_train_step(...).bind(model, optimizer)``
- ``bound_step_undonated:...``: the same with ``bind(..., donate=False)``
- ``bound``: the same computation written by hand as a pure function of the split
  state in ``jax.jit`` with donated buffers.

Spellings run interleaved (A B C ... A B C ...) after warm-up, each run a block of
steps; the median over runs and the spread (25th-75th percentile) are reported, each as
a ratio to ``bound``, with compile time (first call). Each device count runs in its own
process, since jax fixes the device count at start.

    python benchmarks/train_step.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from typing import Any

SPELLINGS = (
    "bound",
    "implicit",
    "explicit",
    "make_train_step:implicit",
    "make_train_step:explicit",
    "bound_step:implicit",
    "bound_step:explicit",
    "bound_step_undonated:implicit",
    "bound_step_undonated:explicit",
)


def run_worker(devices: int, widths: list[int], rounds: int, block_s: float, batch_rows: int) -> list[dict[str, Any]]:
    import jax

    from substrax.mesh import use_cpu_devices

    use_cpu_devices(devices)  # affects the CPU backend only; on a GPU run pass --devices 1

    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import substrax
    from substrax.explicit import explicit_train_step
    from substrax.mesh import create_device_mesh
    from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards, spmd_train_step

    class MLP(nnx.Module):
        def __init__(self, width: int, rngs: nnx.Rngs) -> None:
            self.inp = nnx.Linear(64, width, rngs=rngs)
            self.mid = nnx.Linear(width, width, rngs=rngs)
            self.out = nnx.Linear(width, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(jax.nn.relu(self.mid(jax.nn.relu(self.inp(x)))))

    def loss_fn(model: MLP, batch: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    mesh = create_device_mesh({"data": devices})
    rng = np.random.default_rng(0)
    host = {
        "x": rng.normal(size=(batch_rows, 64)).astype(np.float32),
        "y": rng.normal(size=(batch_rows, 1)).astype(np.float32),
    }
    batch = place_batch_on_shards(host, create_data_parallel_sharding(mesh))
    rows: list[dict[str, Any]] = []

    for width in widths:

        def fresh(width: int = width) -> tuple[MLP, nnx.Optimizer]:
            with jax.set_mesh(mesh):
                model = MLP(width, nnx.Rngs(0))
                return model, nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)

        calls = {}
        for name in SPELLINGS:
            model, optimizer = fresh()
            if name == "bound":
                # By hand: split once, and step a flat list of arrays (an nnx.State argument
                # would cost a Python pytree flatten per call), donated.
                graphdef, state = nnx.split((model, optimizer))
                treedef = jax.tree.structure(state)

                def pure(arrays: list, batch: dict, graphdef: Any = graphdef, treedef: Any = treedef) -> tuple:
                    model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
                    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
                    optimizer.update(model, grads)
                    return jax.tree.leaves(nnx.state((model, optimizer))), loss

                jitted = jax.jit(pure, donate_argnums=0)
                box = [jax.tree.leaves(state)]

                def call(jitted: Any = jitted, box: list = box) -> jax.Array:
                    box[0], loss = jitted(box[0], batch)
                    return loss

            elif name in ("implicit", "explicit"):
                inner = spmd_train_step if name == "implicit" else explicit_train_step
                jitted = nnx.jit(functools.partial(lambda m, o, b, inner: inner(m, o, loss_fn, b), inner=inner))
                call = functools.partial(jitted, model, optimizer, batch)

            else:
                kind, mode = name.split(":")
                step = substrax.make_train_step(loss_fn, mode)  # the caller sets the mesh
                if kind.startswith("bound_step"):
                    fast = step.bind(model, optimizer, donate=kind == "bound_step")
                    call = functools.partial(fast, batch)
                else:
                    call = functools.partial(step, model, optimizer, batch)
            calls[name] = call

        with jax.set_mesh(mesh):
            compile_s = {}
            for name, call in calls.items():
                start = time.perf_counter()
                jax.block_until_ready(call())
                compile_s[name] = time.perf_counter() - start
                start = time.perf_counter()
                for _ in range(3):
                    jax.block_until_ready(call())
                warm_step = (time.perf_counter() - start) / 3
            block = max(1, min(50, int(block_s / warm_step)))  # each timed run ~block_s long
            samples: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(rounds):
                for name, call in calls.items():  # interleaved: every spelling once per round
                    start = time.perf_counter()
                    for _ in range(block):
                        out = call()
                    jax.block_until_ready(out)
                    samples[name].append((time.perf_counter() - start) / block)

        bound = float(np.median(samples["bound"]))
        for name in calls:
            times = np.asarray(samples[name]) * 1e6
            rows.append(
                {
                    "model": f"mlp-w{width}",
                    "width": width,
                    "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(fresh()[0], nnx.Param)))),
                    "devices": devices,
                    "mode": name,
                    "median_step_us": float(np.median(times)),
                    "p25_step_us": float(np.percentile(times, 25)),
                    "p75_step_us": float(np.percentile(times, 75)),
                    "ratio_to_bound": float(np.median(times)) / (bound * 1e6),
                    "compile_s": compile_s[name],
                    "backend": jax.default_backend(),
                    "rounds": rounds,
                    "block": block,
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<10} {'dev':>3} {'spelling':<30} {'median us':>10} {'p25-p75 us':>16} {'x bound':>8} {'compile s':>9}")
    for r in rows:
        spread = f"{r['p25_step_us']:.0f}-{r['p75_step_us']:.0f}"
        print(
            f"{r['model']:<10} {r['devices']:>3} {r['mode']:<30} {r['median_step_us']:>10.0f} "
            f"{spread:>16} {r['ratio_to_bound']:>8.2f} {r['compile_s']:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two widths, fewer rounds: under 2 minutes")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--devices", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--widths", type=int, nargs="*")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    widths = args.widths or ([32, 512] if args.quick else [32, 256, 1024, 2048])
    rounds = args.rounds or (15 if args.quick else 30)

    if args.worker:
        rows = run_worker(args.worker, widths, rounds, block_s=0.01 if args.quick else 0.03, batch_rows=args.batch)
        print(json.dumps(rows))
        return

    rows = []
    for devices in args.devices:
        cmd = [sys.executable, __file__, "--worker", str(devices), "--rounds", str(rounds), "--batch", str(args.batch)]
        cmd += ["--widths", *map(str, widths)] + (["--quick"] if args.quick else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"worker for {devices} device(s) failed:\n{out.stderr}")
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")


if __name__ == "__main__":
    main()
