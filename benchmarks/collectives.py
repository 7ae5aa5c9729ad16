"""Time of each collective by message size on 8 emulated CPU devices.

psum, all_gather, psum_scatter, ppermute (a ring shift) and all_to_all, each under
``jax.shard_map`` over a one-axis mesh, for per-device buffers from 1 KiB to 64 MiB of
float32. ``size`` is each device's result buffer (all_gather's input is size/8, and
psum_scatter's output is size/8 of its size-byte input). Reported as nccl-tests do:
``algbw = size / time`` and ``busbw = algbw * factor`` with the factor of a ring
algorithm (psum 2(n-1)/n; all_gather, psum_scatter and all_to_all (n-1)/n; ppermute 1),
the bandwidth each link would need. Ops run interleaved per size after warm-up; each
sample is a block of calls. Writes the rows as JSON, the printed table beside it (.txt)
and a PNG plot: a full run to ``results/collectives.*`` (the committed results), a quick
one to ``results/collectives_quick.*``, so a quick run never replaces the full results.

    python benchmarks/collectives.py            # results/collectives.{json,txt,png}
    python benchmarks/collectives.py --quick    # results/collectives_quick.{json,txt,png}
    python benchmarks/collectives.py --smoke --json out.json   # tests/test_benchmarks.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OPS = ("psum", "all_gather", "psum_scatter", "ppermute", "all_to_all")


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 sizes, fewer rounds: under 2 minutes")
    parser.add_argument(
        "--smoke", action="store_true", help="one size (1 KiB), one round: that every op runs (make test)"
    )
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write the rows as JSON there, and the table (.txt) beside it; default "
        "results/collectives.json, with --quick results/collectives_quick.json",
    )
    parser.add_argument("--png", metavar="PATH", help="the plot; default the JSON path with .png")
    return parser.parse_args()


def _bodies(n: int) -> dict[str, Any]:
    """Each op's body under ``shard_map`` over the axis ``x`` of ``n`` devices."""
    import jax

    ring = [(i, (i + 1) % n) for i in range(n)]
    return {
        "psum": lambda b: jax.lax.psum(b, "x"),
        "all_gather": lambda b: jax.lax.all_gather(b, "x", tiled=True),
        "psum_scatter": lambda b: jax.lax.psum_scatter(b, "x", tiled=True),
        "ppermute": lambda b: jax.lax.ppermute(b, "x", ring),
        "all_to_all": lambda b: jax.lax.all_to_all(b, "x", 0, 0, tiled=True),
    }


def _samples(mesh: Any, size: int, rounds: int, smoke: bool) -> dict[str, list[float]]:
    """Every op at one per-device buffer size: seconds per call, one sample per round."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    n = mesh.size
    bodies = _bodies(n)
    spec = PartitionSpec("x")
    elems = size // 4
    inputs = {}
    fns = {}
    for op in OPS:
        local = elems // n if op == "all_gather" else elems
        x = jax.device_put(np.ones((n * local,), np.float32), NamedSharding(mesh, spec))
        inputs[op] = x
        fns[op] = jax.jit(jax.shard_map(bodies[op], mesh=mesh, in_specs=spec, out_specs=spec))
    for op in OPS:  # compile and warm up
        for _ in range(2):
            jax.block_until_ready(fns[op](inputs[op]))
    start = time.perf_counter()
    jax.block_until_ready(fns["psum"](inputs["psum"]))
    block = 1 if smoke else max(1, min(100, int(0.02 / max(time.perf_counter() - start, 1e-6))))
    samples: dict[str, list[float]] = {op: [] for op in OPS}
    for _ in range(rounds):
        for op in OPS:
            start = time.perf_counter()
            for _ in range(block):
                out = fns[op](inputs[op])
            jax.block_until_ready(out)
            samples[op].append((time.perf_counter() - start) / block)
    return samples


def _rows(samples: dict[str, list[float]], size: int, n: int) -> list[dict[str, Any]]:
    """One row per op: the median time, its spread, and nccl-tests' bandwidths."""
    import jax
    import numpy as np

    busbw_factor = {"psum": 2 * (n - 1) / n, "ppermute": 1.0}
    rows = []
    for op in OPS:
        t = float(np.median(samples[op]))
        algbw = size / t
        rows.append(
            {
                "op": op,
                "size_bytes": size,
                "devices": n,
                "median_us": t * 1e6,
                "p25_us": float(np.percentile(samples[op], 25)) * 1e6,
                "p75_us": float(np.percentile(samples[op], 75)) * 1e6,
                "algbw_GBps": algbw / 1e9,
                "busbw_GBps": algbw * busbw_factor.get(op, (n - 1) / n) / 1e9,
                "backend": jax.default_backend(),
            }
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'op':<13} {'size':>9} {'median us':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in rows:
        size = r["size_bytes"]
        label = f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 1024} KiB"
        timing = f"{r['median_us']:>11.1f} {r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}"
        lines.append(f"{r['op']:<13} {label:>9} {timing}")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], n: int, png_path: Path) -> bool:
    """Time and bus bandwidth by size, one line per op; False where matplotlib is missing."""
    try:  # the figure needs the dev extra's matplotlib; the floor environment has none
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    for op in OPS:
        mine = [r for r in rows if r["op"] == op]
        xs = [r["size_bytes"] for r in mine]
        ax_t.loglog(xs, [r["median_us"] for r in mine], marker="o", label=op)
        ax_bw.semilogx(xs, [r["busbw_GBps"] for r in mine], marker="o", label=op)
    ax_t.set(
        xlabel="per-device buffer (bytes)",
        ylabel="time (us)",
        title=f"{n} emulated {rows[0]['backend']} devices",
    )
    ax_bw.set(
        xlabel="per-device buffer (bytes)",
        ylabel="bus bandwidth (GB/s)",
        title="busbw (nccl-tests definition)",
    )
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    return True


def main() -> None:
    args = _args()
    default = HERE / "results" / ("collectives_quick.json" if args.quick else "collectives.json")
    json_path = Path(args.json) if args.json else default
    png_path = Path(args.png) if args.png else json_path.with_suffix(".png")

    from substrax.mesh import create_device_mesh, use_cpu_devices

    use_cpu_devices(args.devices)
    n = args.devices
    mesh = create_device_mesh({"x": n})
    powers = range(10, 11) if args.smoke else range(10, 27, 4) if args.quick else range(10, 27, 2)
    sizes = [2**k for k in powers]  # 1 KiB .. 64 MiB
    rounds = 1 if args.smoke else 5 if args.quick else 15
    rows: list[dict[str, Any]] = []
    for size in sizes:
        rows += _rows(_samples(mesh, size, rounds, args.smoke), size, n)

    text = _table(rows)
    print(text)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(rows, indent=1))
    json_path.with_suffix(".txt").write_text(text + "\n")
    if not _plot(rows, n, png_path):
        print(
            f"wrote {json_path} and {json_path.with_suffix('.txt')} (no figure: matplotlib is not installed)"
        )
        return
    print(f"wrote {json_path}, {json_path.with_suffix('.txt')} and {png_path}")


if __name__ == "__main__":
    main()
