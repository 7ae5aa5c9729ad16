"""How close ``substrax.plan``'s peak memory comes to the compiled step's, on models the tests do not hold.

``tests/test_plan.py`` holds the estimate within 10% of ``memory_analysis()`` for the MLPs,
the tensor-parallel block, stacks of ``Linear``, the scanned stack and the example
transformer at two sizes. This script measures the rest of the planning guide's table: the
example transformer of ``examples/transformer_lm.py`` across layouts, units, a scanned
stack, microbatches, bfloat16 and a ``(data, model)`` mesh; a small CNN (two ``Conv``, each
with ``LayerNorm``, gelu then silu, a head; AdamW) and a small vision transformer (a patch
``Conv``, two pre-norm blocks of attention and an MLP; AdamW), which no test holds. For
each configuration, on 8 emulated devices, explicit mode: the plan's ``peak_bytes`` and the
donated step's compiled peak (argument + output + temp - alias), and their ratio. Compiled,
not run.

    python benchmarks/plan.py --json benchmarks/results/plan.json
    python benchmarks/plan.py --smoke --json out.json   # tests/test_benchmarks.py

A row whose plan or step raised is printed ``n/a`` with its error; the script then exits 1.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

DATA8 = {"data": 8}
TWO_D = {"data": 4, "model": 2}
LAYOUTS = (("replicated", False), ("zero1", False), ("fsdp", False), ("fsdp", True))  # (layout, units)


def _tf(
    sizes: dict[str, Any], rows: int, mesh: dict[str, int], layout: str, units: bool = False, **options: Any
) -> dict[str, Any]:
    """A row of the example transformer: its sizes, the global batch's rows, the mesh, the layout."""
    return {"model": "transformer", "sizes": sizes, "rows": rows, "mesh": mesh, "layout": layout,
            "units": units, "options": options}  # fmt: skip


def _image_row(model: str, image: int, rows: int, layout: str, units: bool = False) -> dict[str, Any]:
    """A row of the CNN or the vision transformer ("cnn", "vit"): image side, global batch, layout."""
    return {"model": model, "image": image, "rows": rows, "mesh": DATA8, "layout": layout, "units": units}


def configurations(smoke: bool) -> list[dict[str, Any]]:
    """One dict per row: the model ("transformer" or "cnn"), its sizes, mesh, layout, step options."""
    if smoke:
        return [
            _tf({"d": 16, "blocks": 1, "seq": 8}, 16, DATA8, "fsdp", True),
            _image_row("cnn", 4, 16, "replicated"),
        ]
    rows = [
        _tf({"d": 64, "blocks": 4, "seq": 32, "scan": scan}, 64, DATA8, layout, units)
        for scan in (False, True)
        for layout, units in LAYOUTS
    ]
    for d, blocks, seq in ((32, 2, 32), (64, 2, 32), (64, 4, 32), (64, 2, 64)):
        rows.append(_tf({"d": d, "blocks": blocks, "seq": seq}, 256, DATA8, "replicated"))
    small = {"d": 64, "blocks": 2, "seq": 32}
    rows += [
        _tf(small, 256, DATA8, "replicated", microbatches=2),
        _tf(small, 256, DATA8, "replicated", microbatches=4),
        _tf(small, 256, DATA8, "replicated", precision="bf16"),
        _tf(small, 256, DATA8, "fsdp", True, precision="bf16"),
        _tf(small, 128, TWO_D, "replicated"),
        _tf(small, 128, TWO_D, "fsdp", True),
        _tf({"d": 128, "blocks": 2, "seq": 64}, 128, DATA8, "replicated"),
        _tf({"d": 128, "blocks": 4, "seq": 32}, 64, DATA8, "fsdp"),
    ]
    cnn = [_image_row("cnn", side, n, layout, u) for side, n in ((16, 128), (8, 64)) for layout, u in LAYOUTS]
    return rows + cnn + [_image_row("vit", 32, 128, layout, u) for layout, u in LAYOUTS]


def _images() -> dict[str, tuple[Any, Any, Any, Any]]:
    """Per image model ("cnn", "vit"): its builder (model and optimizer), its loss, its batch
    maker and its unit (imports jax: call after ``use_cpu_devices``)."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.conv1, self.norm1 = nnx.Conv(3, 16, (3, 3), rngs=rngs), nnx.LayerNorm(16, rngs=rngs)
            self.conv2, self.norm2 = nnx.Conv(16, 32, (3, 3), rngs=rngs), nnx.LayerNorm(32, rngs=rngs)
            self.head = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = jax.nn.gelu(self.norm1(self.conv1(x)))
            x = jax.nn.silu(self.norm2(self.conv2(x)))
            return self.head(x.mean((1, 2)))

    def loss_fn(model: CNN, batch: dict) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    def batch(image: int, n: int) -> dict:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(n, image, image, 3)).astype(np.float32)
        return {"x": x, "y": rng.integers(0, 10, n).astype(np.int32)}

    class Block(nnx.Module):
        def __init__(self, d: int, rngs: nnx.Rngs) -> None:
            self.norm1 = nnx.LayerNorm(d, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(num_heads=4, in_features=d, decode=False, rngs=rngs)
            self.norm2, self.up, self.down = (
                nnx.LayerNorm(d, rngs=rngs),
                nnx.Linear(d, 4 * d, rngs=rngs),
                nnx.Linear(4 * d, d, rngs=rngs),
            )

        def __call__(self, x: jax.Array) -> jax.Array:
            x = x + self.attention(self.norm1(x))
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    class ViT(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, d: int = 64) -> None:
            self.patch = nnx.Conv(3, d, (4, 4), strides=(4, 4), rngs=rngs)
            self.blocks = nnx.List([Block(d, rngs) for _ in range(2)])
            self.norm, self.head = nnx.LayerNorm(d, rngs=rngs), nnx.Linear(d, 10, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            h = self.patch(x)
            h = h.reshape(h.shape[0], -1, h.shape[-1])
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h).mean(1))

    def builder(kind: type) -> Any:
        def build() -> tuple[nnx.Module, nnx.Optimizer]:
            model = kind(nnx.Rngs(0))
            return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

        return build

    return {"cnn": (builder(CNN), loss_fn, batch, nnx.Conv), "vit": (builder(ViT), loss_fn, batch, Block)}


def run(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(8)
    import jax
    import numpy as np

    import substrax
    from substrax.mesh import create_device_mesh

    lm = M.load_example()
    images = _images()
    out: list[dict[str, Any]] = []
    for c in configs:
        options = dict(c.get("options") or {})
        if options.get("precision") == "bf16":
            options["precision"] = substrax.MixedPrecision(keep_batch=("tokens", "targets"))
        mesh = create_device_mesh(c["mesh"])
        image = c["model"] in images
        row: dict[str, Any] = {
            "model": f"{c['model']} {c.get('image')}x{c.get('image')}" if image
            else "transformer " + ",".join(f"{k}={v}" for k, v in c["sizes"].items()),
            "mesh": ",".join(f"{a}={n}" for a, n in c["mesh"].items()),
            "layout": c["layout"] + ("+units" if c["units"] else ""),
            "rows": c["rows"],
            "options": ",".join(f"{k}={v}" for k, v in (c.get("options") or {}).items()) or "-",
        }  # fmt: skip
        if image:
            build, loss_fn, make_batch, units = images[c["model"]]
            batch = make_batch(c["image"], c["rows"])
        else:
            shape = (c["rows"], c["sizes"]["seq"] + 1)
            tokens = np.random.default_rng(0).integers(0, 64, shape).astype(np.int32)
            loss_fn, batch, units = lm.loss_fn, {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}, lm.Block

            def build(sizes=c["sizes"]):
                with jax.set_mesh(mesh):
                    return lm.make_model(**sizes)

        units = units if c["units"] else None
        try:
            model, optimizer = build()
            (planned,) = substrax.plan(
                loss_fn, model, optimizer, batch, mesh=mesh, layouts=(c["layout"],), units=(units,), **options
            ).rows
            model, optimizer = build()
            substrax.shard_state(model, optimizer, mesh=mesh, layout=c["layout"], units=units)
            step = substrax.make_train_step(loss_fn, "explicit", mesh=mesh, **options)
            peak = M.memory(step.lower(model, optimizer, batch, donate=True).compile())["peak_bytes"]
            ratio = planned.peak_bytes / peak
            row |= {"planned_peak_bytes": planned.peak_bytes, "peak_bytes": peak, "ratio": ratio}
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out.append(row)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["model | mesh | layout | rows | options | planned | compiled peak | planned / compiled"]
    for r in rows:
        head = f"{r['model']} | {r['mesh']} | {r['layout']} | {r['rows']} | {r['options']}"
        if "error" in r:
            lines.append(f"{head} | n/a: {r['error']}")
        else:
            planned, peak = M.fmt_bytes(r["planned_peak_bytes"]), M.fmt_bytes(r["peak_bytes"])
            lines.append(f"{head} | {planned} | {peak} | {r['ratio']:.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny transformer and a tiny CNN (make test)")
    parser.add_argument("--json", metavar="PATH", help="write the rows and the table beside them (.txt)")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = run(configurations(args.smoke))
    meta = M.machine() | {"wall_s": time.perf_counter() - start}
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    text = table(rows) + (f"\nplanned / compiled: {min(ratios):.3f}-{max(ratios):.3f}" if ratios else "")
    print(text)
    M.write(args.json, {"meta": meta, "rows": rows}, text + "\n")
    M.exit_on_failures(rows, "plan.py")


if __name__ == "__main__":
    main()
