"""Peak memory per device against depth: replicated, ZeRO-1, FSDP, FSDP with units, both modes.

A stack of L ``nnx.Linear(W, W)`` layers (tanh) and a ``Linear(W, 1)`` head, Adam, batch
64, on 8 emulated CPU devices. For each depth, layout and mode the step that runs (its
state donated) is compiled (not run) and ``compiled.memory_analysis()`` of one device's
program is read: the state the step takes (arguments), its temporaries, and the peak,
argument + temp + output - alias; beside it ``substrax.plan``'s estimate of that peak
(explicit mode's, for both modes) and their ratio.
The layouts: ``replicated``, ``zero1``, ``fsdp``, ``fsdp+units`` (each layer a unit,
gathered again for its backward pass) and ``fsdp+units/keep`` (``reshard_after_forward
=False``). Beside them, the bytes one layer's parameters hold; ``temp/layer`` is the slope
of the temporaries from the smallest to the largest depth, in layers.

    python benchmarks/memory.py --json benchmarks/results/memory.json
    python benchmarks/memory.py --quick       # depths 2 and 8
    python benchmarks/memory.py --smoke --json out.json   # tests/test_benchmarks.py

A row whose step raised is printed ``n/a`` with its error; the script then exits 1.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

LAYOUTS = ("replicated", "zero1", "fsdp", "fsdp+units", "fsdp+units/keep")
MODES = ("implicit", "explicit")
BATCH = 64


def run(depths: list[int], width: int, devices: int) -> list[dict[str, Any]]:
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import substrax
    from substrax.mesh import create_device_mesh

    mesh = create_device_mesh({"data": devices})

    class Stack(nnx.Module):
        def __init__(self, depth: int) -> None:
            rngs = nnx.Rngs(0)
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
            self.head = nnx.Linear(width, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return self.head(x)[:, 0]

    def loss_fn(model: Stack, batch: dict) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    batch = {"x": np.zeros((BATCH, width), np.float32), "y": np.zeros(BATCH, np.float32)}
    rows = []
    for depth in depths:
        for layout in LAYOUTS:
            for mode in MODES:
                row: dict[str, Any] = {"depth": depth, "width": width, "layout": layout, "mode": mode}
                row["layer_bytes"] = (width * width + width) * 4
                try:
                    with jax.set_mesh(mesh):
                        model = Stack(depth)
                        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
                    units = (
                        (lambda path, _: len(path) == 2 and path[0] == "layers")
                        if "units" in layout
                        else None
                    )
                    if layout != "replicated":
                        substrax.shard_state(
                            model, optimizer, mesh=mesh, layout=layout.split("+")[0], units=units,
                            reshard_after_forward=not layout.endswith("/keep"),
                        )  # fmt: skip
                    step = substrax.make_train_step(loss_fn, mode, mesh=mesh)
                    compiled = step.lower(model, optimizer, batch, donate=True).compile()
                    row |= M.memory(compiled)
                    planned = substrax.plan(  # explicit mode's estimate, for both modes
                        loss_fn, model, optimizer, batch, mesh=mesh, layouts=(layout.split("+")[0],),
                        units=(units,), placement={"reshard_after_forward": not layout.endswith("/keep")},
                    ).rows[0]  # fmt: skip
                    row["planned_peak_bytes"] = planned.peak_bytes
                except Exception as e:  # noqa: BLE001  (reported, not fatal)
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    depths = sorted({r["depth"] for r in rows})
    layer = rows[0]["layer_bytes"]
    head = ["layout", "mode"] + [f"L={d} state/temp/peak" for d in depths] + ["temp/layer", "planned/peak"]
    lines = [
        f"peak memory per device (compiled.memory_analysis()), width {rows[0]['width']}, one layer's "
        f"parameters {M.fmt_bytes(layer)}, {meta['devices']} devices, the state donated; planned/peak: "
        "substrax.plan's estimate (explicit mode's) over the compiled peak, least-most over the depths",
        " | ".join(head),
    ]
    for layout in LAYOUTS:
        for mode in MODES:
            mine = {r["depth"]: r for r in rows if r["layout"] == layout and r["mode"] == mode}
            cells = []
            for d in depths:
                r = mine[d]
                cells.append(
                    "n/a" if "error" in r else
                    f"{M.fmt_bytes(r['argument_bytes'])} / {M.fmt_bytes(r['temp_bytes'])} / "
                    f"{M.fmt_bytes(r['peak_bytes'])}"
                )  # fmt: skip
            lo, hi = mine[depths[0]], mine[depths[-1]]
            slope = (
                "n/a" if "error" in lo or "error" in hi or len(depths) < 2
                else f"{(hi['temp_bytes'] - lo['temp_bytes']) / (depths[-1] - depths[0]) / layer:.2f}"
            )  # fmt: skip
            ratios = [r["planned_peak_bytes"] / r["peak_bytes"] for r in mine.values() if "error" not in r]
            planned = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "n/a"
            lines.append(" | ".join([layout, mode, *cells, slope, planned]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="depths 2 and 8")
    parser.add_argument("--smoke", action="store_true", help="depths 1 and 2, width 64 (make test)")
    parser.add_argument(
        "--json", metavar="PATH", help="write the rows as JSON and the table beside it (.txt)"
    )
    parser.add_argument("--depths", type=int, nargs="*")
    parser.add_argument("--width", type=int)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    depths = args.depths or ([1, 2] if args.smoke else [2, 8] if args.quick else [2, 4, 8, 16, 32])
    width = args.width or (64 if args.smoke else 512)
    start = time.perf_counter()
    rows = run(depths, width, args.devices)
    meta = M.machine() | {"wall_s": time.perf_counter() - start, "devices": args.devices}
    text = table(rows, meta)
    print(text)
    M.write(args.json, {"meta": meta, "rows": rows}, text + "\n")
    M.exit_on_failures(rows, "memory.py")


if __name__ == "__main__":
    main()
