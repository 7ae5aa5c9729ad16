"""The pod guide's TinyLlama-shaped decoder planned for TPU v5e pods, and each planned row's census.

The model is ``tests/llama.py``'s ``Llama(32000, 2048, 22, heads=32, kv_heads=4, hidden=5632)``
(1.03B parameters, abstract: ``nnx.eval_shape``; its 22 blocks stacked by ``nnx.vmap`` and applied
by ``nnx.scan`` under ``nnx.remat``), AdamW, bfloat16 compute (``MixedPrecision``), one sequence of
2,048 tokens a chip. Compiled, not run, from a CPU for compile-only TPU devices
(``substrax.mesh.topology_mesh``, libtpu):

- ``units``: v5e 16x16, ``{"data": 256}``, FSDP with each ``Block`` a unit (the guide's table's
  fourth row);
- ``hsdp``: two v5e 16x16 slices, ``{"replica": 2, "data": 256}`` (``slices=2``: ``replica`` across
  them), HSDP with and without units.

Each part plans its rows (one compile each: ``substrax.plan``), prints the table, then builds each
row's step (``row.make_train_step``) and runs ``check_communication`` on it, which reuses the plan's
program: whether it matches, its collectives inside the scan and their trip counts,
its bytes per step against the row's ``total_bytes``, and the comparison in full.

    JAX_PLATFORMS=cpu python benchmarks/tinyllama_plan.py --json benchmarks/results/tinyllama_plan.json
    python benchmarks/tinyllama_plan.py --parts units --json out.json   # one part
    python benchmarks/tinyllama_plan.py --smoke --json out.json   # tests/test_benchmarks.py

``--quick`` and ``--smoke`` plan a small Llama of the same kind on 8 emulated CPU devices
(``{"data": 8}``, ``{"replica": 2, "data": 4}``; no libtpu): the rule's estimate, the CPU's census.
A part that raised is printed ``n/a`` with its error; the script then exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# (vocab, d, depth, heads, kv_heads, hidden, seq)
SIZES = {
    "tinyllama": (32000, 2048, 22, 32, 4, 5632, 2048),
    "quick": (512, 64, 4, 4, 2, 176, 64),
    "smoke": (128, 32, 2, 4, 2, 64, 16),
}
# part: (topology, mesh shape, slices, layouts, units)
PARTS = {
    "units": ("v5e:16x16", {"data": 256}, 1, ["fsdp"], "block"),
    "hsdp": ("v5e:16x16", {"replica": 2, "data": 256}, 2, ["hsdp"], "both"),
}
CPU_MESHES = {"units": {"data": 8}, "hsdp": {"replica": 2, "data": 4}}


def _mesh(part: str, emulated: bool) -> Any:
    """The part's mesh: compile-only TPU devices, or (``emulated``) 8 CPU devices."""
    from substrax.mesh import create_device_mesh, topology_mesh

    topology, shape, slices, *_ = PARTS[part]
    if emulated:
        return create_device_mesh(CPU_MESHES[part])
    return topology_mesh(topology, shape, slices=slices)


def _build(size: str, rows: int) -> tuple[Any, Any, dict[str, Any]]:
    """The abstract model and optimizer (``nnx.eval_shape``), and a batch of ``rows`` sequences."""
    import jax
    import jax.numpy as jnp
    import llama
    import optax
    from flax import nnx

    vocab, d, depth, heads, kv, hidden, seq = SIZES[size]

    def build() -> tuple[Any, Any]:
        model = llama.Llama(vocab, d, depth, heads=heads, kv_heads=kv, hidden=hidden)
        return model, nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for k in ("tokens", "targets")}
    return model, optimizer, batch


def _plan_row(row: Any, part: str, plan_s: float) -> dict[str, Any]:
    """A planned row's fields for the JSON."""
    ms = lambda s: None if s is None else s * 1e3  # noqa: E731
    return {
        "part": part,
        "mesh": row.mesh,
        "layout": row.layout,
        "units": row.units,
        "compiler": row.compiler,
        "fits": row.fits,
        "peak_bytes": row.peak_bytes,
        "state_bytes": row.state_bytes,
        "total_bytes": row.total_bytes,
        "step_ms": ms(row.step_seconds),
        "mfu": row.mfu,
        "exposed_ms": ms(row.exposed_seconds),
        "refused": row.refused,
        "plan_s": plan_s,
    }


def _census_fields(found: Any, row: Any) -> dict[str, Any]:
    """What the census of a row's step says: matches, loops, bytes against the row's."""
    report = found.report
    looped = report.in_loop()
    by_kind = {k: t.bytes_per_step for k, t in report.totals().items()}
    expected: dict[str, list[int]] = {}  # kind: [required, optional]
    for item in found.expected.items:
        expected.setdefault(item.kind, [0, 0])[int(bool(item.optional))] += item.bytes
    return {
        "census_matches": bool(found.matches),
        "census_collectives": report.count(),
        "census_in_loop": len(looped),
        "census_trip_counts": sorted({str(r.trip_counts) for r in looped}),
        "census_in_loop_kinds": sorted({r.kind for r in looped}),
        "census_bytes_per_step": int(report.bytes_per_step()),
        "census_bytes_by_kind": by_kind,
        "expected_bytes_by_kind": expected,
        "row_total_bytes": row.total_bytes,
        "bytes_equal": int(report.bytes_per_step()) == row.total_bytes,
        "differences": list(found.differences),
    }


def _census(row: Any, size: str, rows: int, loss_fn: Any) -> tuple[dict[str, Any], str]:
    """Build the row's step on fresh abstract state and check its communication (timed)."""
    model, optimizer, batch = _build(size, rows)
    row.shard_state(model, optimizer)
    step = row.make_train_step(loss_fn)
    start = time.perf_counter()
    found = step.check_communication(model, optimizer, batch)
    fields = _census_fields(found, row) | {"census_s": time.perf_counter() - start}
    return fields, str(found)


def _census_summary(label: str, c: dict[str, Any]) -> list[str]:
    """The census's fields in a few lines."""
    kinds, trips = ", ".join(c["census_in_loop_kinds"]) or "-", ", ".join(c["census_trip_counts"]) or "-"
    rule = ", ".join(
        f"{k} {r:,}" + (f" (+ {o:,} optional)" if o else "")
        for k, (r, o) in c["expected_bytes_by_kind"].items()
    )
    lines = [
        f"census of {label}: {'matches' if c['census_matches'] else 'does NOT match'} "
        f"({c['census_s']:.1f} s)",
        f"  {c['census_collectives']} collectives, {c['census_in_loop']} inside loops ({kinds}; "
        f"trip counts {trips})",
        f"  census bytes per device per step {c['census_bytes_per_step']:,}; the row's total_bytes "
        f"{c['row_total_bytes']:,} ({'equal' if c['bytes_equal'] else 'NOT equal'})",
        "  by kind (census): " + ", ".join(f"{k} {v:,}" for k, v in c["census_bytes_by_kind"].items()),
        f"  by kind (the rule): {rule}",
    ]
    return lines + [f"  difference: {d}" for d in c["differences"]]


def run_part(part: str, size: str, emulated: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Plan the part's rows, then census each: the JSON rows and the text."""
    import jax.numpy as jnp
    import llama

    import substrax

    _, _, _, layouts, which = PARTS[part]
    mesh = _mesh(part, emulated)
    rows = mesh.size  # one sequence a chip
    model, optimizer, batch = _build(size, rows)
    units = {"block": (llama.Block,), "both": (None, llama.Block)}[which]
    policy = substrax.MixedPrecision(jnp.bfloat16)
    start = time.perf_counter()
    planned = substrax.plan(
        llama.loss_fn, model, optimizer, batch, mesh=mesh, layouts=layouts, units=units, precision=policy
    )
    plan_s = time.perf_counter() - start
    shape = ",".join(f"{a}={n}" for a, n in mesh.shape.items())
    text = [f"== {part}: {size} on {shape}, {rows} sequences a step; plan {plan_s:.0f} s", str(planned)]
    text += [f"  {row}" for row in planned.rows]
    out = [_plan_row(r, part, plan_s) for r in planned.rows]
    for i, row in enumerate(planned.rows):
        fields, full = _census(row, size, rows, llama.loss_fn)
        out[i] |= fields
        label = f"{row.layout} units={row.units} on {row.mesh}"
        text += ["", *_census_summary(label, fields), "", f"check_communication of {label}, in full:", full]
    return out, text


def header(argv: list[str]) -> list[str]:
    """The command, the date, the versions and the machine's load."""
    import importlib.metadata as metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    info = M.machine()
    return [
        f"command: JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')} python {' '.join(argv)}",
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; jax {info['jax']}, jaxlib {version('jaxlib')}, "
        f"libtpu {version('libtpu')}, flax {info['flax']}, optax {info['optax']}",
        f"machine: {info['cpus']} CPUs, load average {os.getloadavg()[0]:.1f} at start",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--quick", action="store_true", help="a small Llama on 8 emulated CPU devices")
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on 8 emulated CPU devices")
    parser.add_argument("--json")
    args = parser.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "tinyllama"
    emulated = size != "tinyllama"
    if emulated:
        from substrax.mesh import use_cpu_devices

        use_cpu_devices(8)
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the pod guide: libtpu compiles, starts no backend
    text = header(sys.argv)
    print("\n".join(text), flush=True)
    rows: list[dict[str, Any]] = []
    for part in args.parts:
        try:
            got, lines = run_part(part, size, emulated)
        except M.REPORTED as e:
            got, lines = [{"part": part, "error": M.error_text(e)}], [f"== {part}: n/a: {M.error_text(e)}"]
        rows += got
        text += lines
        print("\n".join(lines), flush=True)
    M.write(args.json, {"machine": M.machine(), "size": size, "rows": rows}, "\n".join(text) + "\n")
    M.exit_on_failures(rows, "tinyllama_plan.py")


if __name__ == "__main__":
    main()
