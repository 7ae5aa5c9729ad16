"""Bytes per step per mesh axis: FSDP over 8 devices against hybrid sharding over 2 x 4.

The transformer of ``examples/transformer_lm.py`` (d=64, 2 blocks, seq 32, batch 32,
AdamW; every parameter split, ``min_size=1``), its blocks as FSDP units, on 8 emulated
devices: ``layout="fsdp"`` on ``{"data": 8}`` and ``layout="hsdp"`` on ``{"replica": 2,
"data": 4}``, both modes. Each step is compiled (not run) and its census read: the bytes
each device moves per step over each mesh axis (the census rows' device groups), and the
all-reduce across replicas, beside the formula for P bytes of parameters on R replicas
of S devices (each unit gathered twice, its gradient reduce-scattered once):

- FSDP over N = R x S devices: 3 (N - 1) / N x P, every byte over the whole data axis;
- HSDP: 3 (S - 1) / S x P within a replica, and 2 (R - 1) / R x P / S across replicas
  (an all-reduce of each device's 1/S slice, ring-counted as nccl-tests count bus bytes).

The census counts a collective's buffer once per device (an all-gather's result, the
operand of the others), not ring traffic, so its "across" column is P / S, the buffer the
formula's 2 (R - 1) / R multiplies.

    python benchmarks/hsdp.py --json benchmarks/results/hsdp.json
    python benchmarks/hsdp.py --smoke --json out.json   # tests/test_benchmarks.py

A row whose step raised is printed ``n/a`` with its error; the script then exits 1.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

MESHES = {"fsdp": {"data": 8}, "hsdp": {"replica": 2, "data": 4}}


def run(sizes: dict[str, int]) -> list[dict[str, Any]]:
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(8)
    import jax
    import numpy as np
    from flax import nnx

    import substrax
    from substrax.mesh import create_device_mesh
    from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

    lm = M.load_example()
    rows: list[dict[str, Any]] = []
    for layout, shape in MESHES.items():
        mesh = create_device_mesh(shape)
        host = next(lm.batches(lm.stdlib_text(), 32, sizes.get("seq", 32), seed=0))
        batch = place_batch_on_shards(host, create_data_parallel_sharding(mesh))
        for mode in substrax.MODES:
            row: dict[str, Any] = {"layout": layout, "mesh": "x".join(map(str, shape.values())), "mode": mode}
            try:
                with jax.set_mesh(mesh):
                    model, optimizer = lm.make_model(**sizes)
                substrax.shard_state(model, optimizer, mesh=mesh, layout=layout, min_size=1, units=lm.Block)
                params = sum(
                    int(np.prod(v.shape)) * v.dtype.itemsize
                    for v in jax.tree.leaves(nnx.state(model, nnx.Param))
                )
                step = substrax.make_train_step(lm.loss_fn, mode, mesh=mesh)
                report = substrax.census(step.lower(model, optimizer, batch).compile(), mesh=mesh)
                by_axis: dict[str, int] = {}
                for r in report.rows:
                    key = ",".join(r.axes) if r.axes else "?"
                    by_axis[key] = by_axis.get(key, 0) + r.bytes_per_step
                r_, s_ = shape.get("replica", 1), shape["data"]
                n = r_ * s_
                row |= {
                    "param_bytes": params,
                    "bytes_per_step": int(report.bytes_per_step()),
                    "by_axis": by_axis,
                    "formula_within": 3 * (s_ - 1) / s_ * params
                    if layout == "hsdp"
                    else 3 * (n - 1) / n * params,
                    "formula_across": 2 * (r_ - 1) / r_ * params / s_ if layout == "hsdp" else 0.0,
                }
            except Exception as e:  # noqa: BLE001  (reported, not fatal)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "bytes per device per step by mesh axis (census), the example transformer with its blocks as units",
        "layout | mesh | mode | params | total | by axis | formula within / across (bus bytes)",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layout']} | {r['mesh']} | {r['mode']} | n/a: {r['error']}")
            continue
        axes = ", ".join(f"{k}: {v:,}" for k, v in sorted(r["by_axis"].items()))
        lines.append(
            f"{r['layout']} | {r['mesh']} | {r['mode']} | {r['param_bytes']:,} | {r['bytes_per_step']:,} | "
            f"{axes} | "
            f"{r['formula_within']:,.0f} / {r['formula_across']:,.0f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="width 16, 1 block, seq 8 (make test)")
    parser.add_argument(
        "--json", metavar="PATH", help="write the rows as JSON and the table beside it (.txt)"
    )
    args = parser.parse_args()
    sizes = {"d": 16, "blocks": 1, "seq": 8} if args.smoke else {}
    start = time.perf_counter()
    rows = run(sizes)
    meta = M.machine() | {"wall_s": time.perf_counter() - start}
    text = table(rows)
    print(text)
    M.write(args.json, {"meta": meta, "rows": rows}, text + "\n")
    M.exit_on_failures(rows, "hsdp.py")


if __name__ == "__main__":
    main()
