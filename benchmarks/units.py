"""Step time of explicit FSDP with units against jit FSDP, unrolled and scanned; compile time.

The char-level transformer of ``examples/transformer_lm.py`` (4 heads, seq 32, batch 32,
AdamW) at widths 64 and 256 and depths 2 and 8, its blocks unrolled (a Python loop over
an ``nnx.List``) or scanned (one stacked ``Block`` made by ``nnx.vmap``, applied by
``nnx.scan``), on 8 emulated CPU devices, every parameter split (``min_size=1``). For
each configuration three spellings of one FSDP step, each ``make_train_step(...).bind``
(donated), timed interleaved in one run (A B C ... A B C ...):

- ``jit``: implicit mode, ``layout="fsdp"``: XLA inserts and places the collectives;
- ``explicit``: explicit mode, ``layout="fsdp"``: every parameter gathered before the
  forward pass, every gradient reduce-scattered after the backward;
- ``explicit+units``: explicit mode, each block a unit (``units=Block``; scanned: the
  stacked block, gathered one layer at a time inside the loop);
- ``explicit+prefetch`` (scanned only): the stacked block a unit with ``prefetch=True``,
  run by ``substrax.nn.scan_layers``: layer i+1 gathered while layer i computes.

Each row: the median step time and its ratio to ``jit`` of the same configuration, the
first call's time (compile), the compiled program's peak memory per device (argument +
temp + output - alias) and the collectives' bytes per device per step (the census).

    python benchmarks/units.py --json benchmarks/results/units.json
    python benchmarks/units.py --quick                 # width 64, depth 2
    python benchmarks/units.py --smoke --json out.json  # tests/test_benchmarks.py

A row whose step raised is printed ``n/a`` with its error; the script then exits 1.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

SPELLINGS = ("jit", "explicit", "explicit+units", "explicit+prefetch")


def run(
    configs: list[tuple[int, int, bool]], seq: int, rounds: int, block_s: float, devices: int
) -> list[dict[str, Any]]:
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(devices)
    import jax

    import substrax
    from substrax.mesh import create_device_mesh
    from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

    lm = M.load_example()
    mesh = create_device_mesh({"data": devices})
    host = next(lm.batches(lm.stdlib_text(), 32, seq, seed=0))
    batch = place_batch_on_shards(host, create_data_parallel_sharding(mesh))
    rows: list[dict[str, Any]] = []
    for width, depth, scan in configs:
        calls, made = {}, {}
        for spelling in SPELLINGS:
            if spelling == "explicit+prefetch" and not scan:
                continue  # prefetch runs a stack (substrax.nn.scan_layers)
            row: dict[str, Any] = {"width": width, "depth": depth, "scan": scan, "spelling": spelling}
            try:
                with jax.set_mesh(mesh):
                    model, optimizer = lm.make_model(d=width, blocks=depth, seq=seq, scan=scan)
                units = lm.Block if spelling.startswith("explicit+") else None
                prefetch = spelling == "explicit+prefetch"
                substrax.shard_state(
                    model, optimizer, mesh=mesh, layout="fsdp", min_size=1, units=units, prefetch=prefetch
                )
                mode = "implicit" if spelling == "jit" else "explicit"
                step = substrax.make_train_step(lm.loss_fn, mode, mesh=mesh)
                compiled = step.lower(model, optimizer, batch, donate=False).compile()  # as measured (docs)
                row |= M.memory(compiled)
                row |= M.collectives(substrax.census(compiled, mesh=mesh))
                fast = step.bind(model, optimizer)
                start = time.perf_counter()
                jax.block_until_ready(fast(batch))
                row["compile_s"] = time.perf_counter() - start
                calls[spelling] = lambda fast=fast: fast(batch)
            except Exception as e:  # noqa: BLE001  (reported, not fatal)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            made[spelling] = row
            rows.append(row)
        if "jit" in calls:
            samples, block = M.interleaved(calls, rounds, block_s, "jit")
            base = M.summary_us(samples["jit"])["median_us"]
            for spelling, seconds in samples.items():
                made[spelling] |= M.summary_us(seconds) | {"block": block}
                made[spelling]["x_jit"] = made[spelling]["median_us"] / base
    return rows


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"FSDP step of the example transformer, {meta['devices']} devices, seq {meta['seq']}, batch 32, "
        f"{meta['rounds']} rounds interleaved; x jit: median step time over jit FSDP's",
        "width | depth | blocks | spelling | median | x jit | compile s | peak/device | comm B/step",
    ]
    for r in rows:
        blocks = "scanned" if r["scan"] else "unrolled"
        if "error" in r:
            lines.append(f"{r['width']} | {r['depth']} | {blocks} | {r['spelling']} | n/a: {r['error']}")
            continue
        lines.append(
            f"{r['width']} | {r['depth']} | {blocks} | {r['spelling']} | "
            f"{r.get('median_us', 0) / 1e3:.2f} ms | "
            f"{r.get('x_jit', float('nan')):.2f} | {r['compile_s']:.1f} | {M.fmt_bytes(r['peak_bytes'])} | "
            f"{r['comm_bytes']:,}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="width 64, depth 2, unrolled and scanned")
    parser.add_argument(
        "--smoke", action="store_true", help="width 16, depth 1, seq 8, scanned, one round (make test)"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write the rows as JSON and the table beside it (.txt)"
    )
    parser.add_argument("--widths", type=int, nargs="*")
    parser.add_argument("--depths", type=int, nargs="*")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    widths = args.widths or ([16] if args.smoke else [64] if args.quick else [64, 256])
    depths = args.depths or ([1] if args.smoke else [2] if args.quick else [2, 8])
    rounds = args.rounds or (1 if args.smoke else 10 if args.quick else 15)
    seq = 8 if args.smoke else 32
    # the smoke: the scanned stack alone, where every spelling runs (unrolled units: tests/test_units.py)
    scans = (True,) if args.smoke else (False, True)
    configs = [(w, d, scan) for w in widths for d in depths for scan in scans]
    start = time.perf_counter()
    rows = run(configs, seq, rounds, 0.0 if args.smoke else 0.2, args.devices)
    meta = M.machine() | {
        "wall_s": time.perf_counter() - start,
        "devices": args.devices,
        "seq": seq,
        "rounds": rounds,
    }
    text = table(rows, meta)
    print(text)
    M.write(args.json, {"meta": meta, "rows": rows}, text + "\n")
    M.exit_on_failures(rows, "units.py")


if __name__ == "__main__":
    main()
