"""Replicated vs ZeRO-1 vs FSDP state, both modes, against a hand-written FSDP bound.

One Adam step of a 3-layer MLP (input ``w``, hidden ``w``, ``w``, output 1; ReLU; mean
squared error; batch 256) on 8 emulated CPU devices, for widths ``w`` = 256 ... 2048.
Each width times:

- ``LAYOUT:MODE``: ``substrax.shard_state`` (skipped for ``replicated``; ``zero1`` is
  ``params=False``, ``fsdp`` ``params=True``), then
  ``make_train_step(loss_fn, MODE).bind(model, optimizer)`` (donated), called on the batch.
- ``bound``: FSDP by hand, the step the library's explicit FSDP step should compile to.
  A pure function of a flat list of arrays under ``jax.shard_map(check_vma=True)``:
  every parameter of at least 1024 elements (the library's ``min_size``) and its two Adam
  moments split on dim 0 over ``data`` (the dim ``shard_state`` picks for these shapes),
  ``jax.lax.all_gather(w, "data", axis=0, tiled=True)`` right before use, the loss
  ``pmean``-ed before ``grad`` (so the gradient of a split parameter comes back
  reduce-scattered and that of a replicated one all-reduced), ``optax.adam`` updating
  the local shards; ``jax.jit`` with the state donated.
- ``bound_replicated``: the same by hand with the whole state on every device (no
  gather; every gradient all-reduced), for reference.

Every ratio is to ``bound``, measured in the same run. Spellings run interleaved, one
block of steps each per round, after warm-up (compile, 3 steps); the median over rounds
and the 25th-75th percentiles are reported. Per spelling also: the state's bytes per
device (summed from the arrays' addressable shards after the timed steps, so it shows
the layout the step kept), ``compiled.memory_analysis()`` (argument, output, temporary
bytes of one device's program), the census (collective bytes per device per step, and
the collectives executed), and the loss after warm-up (every spelling starts from the
same parameters, so the losses agree to round-off).

    python benchmarks/layouts.py --quick
    python benchmarks/layouts.py --json benchmarks/results/layouts.json
    python benchmarks/layouts.py --smoke --json out.json   # tests/test_benchmarks.py

A row whose spelling raised is printed ``n/a`` with its error and written so; the
script then exits with status 1, naming every such row.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

LAYOUTS = ("replicated", "zero1", "fsdp")
MODES = ("implicit", "explicit")
BOUNDS = ("bound", "bound_replicated")
BATCH = 256
MIN_SIZE = 1024  # substrax.shard_state's default


SMOKE_SPELLINGS = (*BOUNDS, "replicated:explicit", "zero1:implicit", "fsdp:explicit")  # each layout once


LEARNING_RATE = 1e-3


@functools.cache  # one MLP class for every spelling, as one model type
def _mlp() -> tuple[Any, Callable[..., Any], Callable[..., Any]]:
    """``(MLP, loss_fn, forward)``: the 3-layer model, its mean squared error, and the same
    forward pass written over a dict of arrays (the bound's)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, width: int, rngs: nnx.Rngs) -> None:
            self.inp = nnx.Linear(width, width, rngs=rngs)
            self.mid = nnx.Linear(width, width, rngs=rngs)
            self.out = nnx.Linear(width, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(jax.nn.relu(self.mid(jax.nn.relu(self.inp(x)))))

    def loss_fn(model: MLP, batch: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    def forward(params: dict[str, dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        h = jax.nn.relu(x @ params["inp"]["kernel"] + params["inp"]["bias"])
        h = jax.nn.relu(h @ params["mid"]["kernel"] + params["mid"]["bias"])
        return h @ params["out"]["kernel"] + params["out"]["bias"]

    return MLP, loss_fn, forward


def _hand_state(mesh: Any, width: int, split: bool) -> tuple[Any, Any, Any, Any]:
    """The bound's state: ``(state, param_specs, opt_specs, tx)``, the parameters and Adam's
    moments of at least ``MIN_SIZE`` elements split over ``data`` (``split``), else replicated."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    model = _mlp()[0](width, nnx.Rngs(0))
    params = {
        name: {"kernel": layer.kernel[...], "bias": layer.bias[...]}
        for name, layer in (("inp", model.inp), ("mid", model.mid), ("out", model.out))
    }

    def spec(a: Any) -> P:
        n = mesh.size
        return P("data") if split and a.size >= MIN_SIZE and a.shape[0] % n == 0 else P()

    param_specs = jax.tree.map(spec, params)
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, param_specs)
    tx = optax.adam(LEARNING_RATE)
    opt_state = tx.init(params)
    opt_specs = optax.tree_map_params(
        tx, lambda _, s: s, opt_state, param_specs, transform_non_params=lambda _: P()
    )
    opt_state = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), opt_state, opt_specs)
    return (params, opt_state), param_specs, opt_specs, tx


def _hand_step(
    mesh: Any, width: int, split: bool, batch: dict[str, Any]
) -> tuple[Callable, Callable, Callable]:
    """The bound: (step call, lowering, current arrays)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    forward = _mlp()[2]
    state, param_specs, opt_specs, tx = _hand_state(mesh, width, split)
    treedef = jax.tree.structure(state)
    specs = jax.tree.leaves((param_specs, opt_specs), is_leaf=lambda s: isinstance(s, P))

    def gather(a: jax.Array, s: P) -> jax.Array:
        return jax.lax.all_gather(a, "data", axis=0, tiled=True) if s == P("data") else a

    def per_device(arrays: list[jax.Array], shard: dict[str, jax.Array]) -> tuple[list[jax.Array], Any]:
        params, opt_state = jax.tree.unflatten(treedef, arrays)

        def global_loss(params: Any) -> jax.Array:
            whole = jax.tree.map(gather, params, param_specs)
            return jax.lax.pmean(jnp.mean((forward(whole, shard["x"]) - shard["y"]) ** 2), "data")

        loss, grads = jax.value_and_grad(global_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return jax.tree.leaves((params, opt_state)), loss

    mapped = jax.shard_map(
        per_device, mesh=mesh, in_specs=(specs, P("data")), out_specs=(specs, P()), check_vma=True
    )
    jitted = jax.jit(mapped, donate_argnums=0)
    box = [jax.tree.leaves(state)]

    def call() -> Any:
        box[0], loss = jitted(box[0], batch)
        return loss

    return call, lambda: jitted.lower(box[0], batch), lambda: box[0]


def _library_step(
    mesh: Any, width: int, layout: str, mode: str, batch: dict[str, Any]
) -> tuple[Callable, Callable, Callable, Callable, Any]:
    """``.bind``: (step call, lowering, current arrays, census, the Layout shard_state returned)."""
    import jax
    import optax
    from flax import nnx

    import substrax

    MLP, loss_fn, _ = _mlp()
    model = MLP(width, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    placed = None
    if layout != "replicated":
        placed = substrax.shard_state(model, optimizer, mesh=mesh, params=layout == "fsdp")
    fast = substrax.make_train_step(loss_fn, mode, mesh=mesh).bind(model, optimizer)

    def arrays() -> list[jax.Array]:
        fast.sync()
        return jax.tree.leaves(nnx.state((model, optimizer)))

    return fast, lambda: fast.lower(batch), arrays, lambda: fast.census(batch), placed


def _spelling(
    name: str, mesh: Any, width: int, batch: dict[str, Any]
) -> tuple[dict[str, Any], Callable[[], Any] | None, Callable[[], list] | None]:
    """One spelling built, compiled, warmed up and its census taken: ``(row, call, arrays)``;
    a spelling that raised has its row's ``error`` and no call."""
    import jax

    import substrax

    def census_of(lower: Callable[[], Any]) -> Any:
        return substrax.census(lower().compile(), mesh=mesh)

    row: dict[str, Any] = {"spelling": name}
    try:
        if name in BOUNDS:
            call, lower, arrays = _hand_step(mesh, width, name == "bound", batch)
            take_census: Callable[[], Any] = functools.partial(census_of, lower)
            row["layout_bytes"] = None
        else:
            layout, mode = name.split(":")
            fast, lower, arrays, census, placed = _library_step(mesh, width, layout, mode, batch)
            call = functools.partial(fast, batch)
            take_census = census
            row["layout_bytes"] = None if placed is None else placed.bytes_per_device
        start = time.perf_counter()
        jax.block_until_ready(call())
        row["compile_s"] = time.perf_counter() - start
        for _ in range(3):
            loss = call()
        row["loss_after_4_steps"] = float(loss)
        row |= M.memory(lower().compile())
        result = take_census()
        report = getattr(result, "report", result)
        row |= M.collectives(report)
        row["census_matches"] = getattr(result, "matches", None)
    except M.REPORTED as e:  # reported, not fatal
        row["error"] = M.error_text(e)
        return row, None, None
    return row, call, arrays


def _width_rows(
    mesh: Any, width: int, rounds: int, block_s: float, spellings: tuple[str, ...] | None, rng: Any
) -> list[dict[str, Any]]:
    """Every spelling at one width, timed interleaved: one row each."""
    import jax
    import numpy as np
    from flax import nnx

    from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

    host = {
        "x": rng.normal(size=(BATCH, width)).astype(np.float32),
        "y": rng.normal(size=(BATCH, 1)).astype(np.float32),
    }
    batch = place_batch_on_shards(host, create_data_parallel_sharding(mesh))
    names = list(spellings or (*BOUNDS, *(f"{layout}:{mode}" for layout in LAYOUTS for mode in MODES)))
    calls: dict[str, Callable[[], Any]] = {}
    info: dict[str, dict[str, Any]] = {}
    arrays_of: dict[str, Callable[[], list]] = {}
    for name in names:
        info[name], call, arrays = _spelling(name, mesh, width, batch)
        if call is not None and arrays is not None:
            calls[name], arrays_of[name] = call, arrays

    params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(_mlp()[0](width, nnx.Rngs(0)))))
    samples, block = M.interleaved(calls, rounds, block_s, reference="bound")
    bound_us = float(np.median(samples["bound"])) * 1e6
    rows = []
    devices = mesh.size
    for name in names:
        row = {"model": f"mlp-w{width}", "width": width, "params": params, "batch": BATCH}
        row |= {"devices": devices, "rounds": rounds, "block": block, "bound_us": bound_us} | info[name]
        if name in calls:
            row |= M.summary_us(samples[name])
            row["ratio_to_bound"] = row["median_us"] / bound_us
            row["state_bytes"] = M.state_bytes(arrays_of[name]())
        rows.append(row)
    return rows


def run(
    widths: list[int], rounds: int, block_s: float, devices: int, spellings: tuple[str, ...] | None = None
) -> list[dict[str, Any]]:
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(devices)

    import numpy as np

    from substrax.mesh import create_device_mesh

    mesh = create_device_mesh({"data": devices})
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for width in widths:
        rows += _width_rows(mesh, width, rounds, block_s, spellings, rng)
        print(f"  width {width}: done", file=sys.stderr)
    return rows


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 10's two goals, width by width."""
    by = {(r["width"], r["spelling"]): r for r in rows}
    lines = []
    for width in sorted({r["width"] for r in rows}):
        fsdp = by.get((width, "fsdp:explicit"), {})
        rep = by.get((width, "replicated:explicit"), {})
        if "ratio_to_bound" not in fsdp:
            lines.append(f"w{width}: fsdp:explicit did not run")
            continue
        within = fsdp["ratio_to_bound"] <= 1.10
        line = (
            f"w{width}: fsdp:explicit {fsdp['ratio_to_bound']:.2f}x bound ({'met' if within else 'MISSED'})"
        )
        if "median_us" in rep:
            speedup = rep["median_us"] / fsdp["median_us"]
            need = width >= 1024
            verdict = ("met" if speedup > 1 else "MISSED") if need else "not required below 1024"
            line += f"; {speedup:.2f}x as fast as replicated:explicit ({verdict})"
        lines.append(line)
    return lines


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = [
        (
            f"layouts: 3-layer MLP, batch {BATCH}, Adam, {meta['devices']} emulated {meta['backend']} "
            f"devices; {meta['cpus']} CPUs; jax {meta['jax']}, flax {meta['flax']}, optax {meta['optax']}; "
            f"{meta['date']}"
        ),
        (
            f"{'model':<10} {'spelling':<20} {'median us':>10} {'p25-p75 us':>15} {'x bound':>7} "
            f"{'state/dev':>10} {'arg':>10} {'out':>10} {'temp':>10} {'comm/step':>10} "
            f"{'collectives':<14} {'rule':>4} {'loss@4':>9} {'compile s':>9}"
        ),
    ]
    for r in rows:
        start = f"{r['model']:<10} {r['spelling']:<20}"
        if "median_us" not in r:
            out.append(f"{start} n/a: {r.get('error', 'no samples')}")
            continue
        spread = f"{r['p25_us']:.0f}-{r['p75_us']:.0f}"
        rule = {None: "-", True: "yes", False: "NO"}[r.get("census_matches")]
        out.append(
            f"{start} {r['median_us']:>10.0f} {spread:>15} {r['ratio_to_bound']:>7.2f} "
            f"{M.fmt_bytes(r['state_bytes']):>10} {M.fmt_bytes(r['argument_bytes']):>10} "
            f"{M.fmt_bytes(r['output_bytes']):>10} {M.fmt_bytes(r['temp_bytes']):>10} "
            f"{M.fmt_bytes(r['comm_bytes']):>10} {M.kinds_brief(r['executions']):<14} {rule:>4} "
            f"{r['loss_after_4_steps']:>9.5f} {r['compile_s']:>9.2f}"
        )
        if r.get("layout_bytes") is not None and r["layout_bytes"] != r["state_bytes"]:
            out.append(f"{'':<31} shard_state's Layout said {r['layout_bytes']:,} bytes per device")
    out += [
        "x bound: median / bound's median, same run (bound: FSDP by hand under shard_map, donated).",
        "state/dev: bytes on the fullest device, from the arrays' addressable shards after the timed steps.",
        "arg/out/temp: compiled.memory_analysis() of one device's program (outputs alias donated arguments).",
        "comm/step: collective bytes per device per step (substrax.census); collectives: executions per step",
        "(AR all-reduce, AG all-gather, RS reduce-scatter); rule: the census matches the layout's rule.",
        "",
        "goals (issue 10): explicit FSDP within 1.10x of bound; faster than replicated explicit from w1024:",
        *goals(rows),
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="widths 128 and 256, 5 rounds: under a minute")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="width 64, the bounds and each layout in one mode, one round of one-step blocks (make test)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write the rows as JSON and the table beside it (.txt)"
    )
    parser.add_argument("--widths", type=int, nargs="*")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    widths = args.widths or ([64] if args.smoke else [128, 256] if args.quick else [256, 512, 1024, 2048])
    rounds = args.rounds or (1 if args.smoke else 5 if args.quick else 15)
    start = time.perf_counter()
    block_s = 0.0 if args.smoke else 0.01 if args.quick else 0.05
    rows = run(widths, rounds, block_s, args.devices, SMOKE_SPELLINGS if args.smoke else None)
    meta = M.machine() | {"wall_s": time.perf_counter() - start, "quick": args.quick, "smoke": args.smoke}
    text = table(rows, meta)
    print(text)
    M.write(args.json, {"meta": meta, "rows": rows}, text + "\n")
    M.exit_on_failures(rows, "layouts.py")


if __name__ == "__main__":
    main()
