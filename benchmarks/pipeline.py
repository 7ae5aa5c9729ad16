"""Pipelines: step time and memory of GPipe, 1F1B, ZB-H1 and interleaved 1F1B against the data-parallel step.

One model, an embedding, ``--depth`` residual blocks (``Linear(width, width)``, ``tanh``)
stacked by ``nnx.vmap`` and applied by ``substrax.nn.scan_layers``, a head; mean squared
error, Adam, the same global batch cut into ``K`` microbatches, 8 emulated CPU devices.
Timed, interleaved round by round after warm-up (``.bind``, the state donated):

- ``data8:MODE:kK``: the data-parallel step on ``data=8``, replicated, ``microbatches=K``
  (gradient accumulation): the bound each pipelined row is a ratio to;
- ``stage4xdata2:MODE:SCHEDULE:kK``: the blocks split over ``stage=4`` (``shard_state(...,
  stages=Block)``) beside ``data=2``, replicated over ``data``, ``make_train_step(...,
  microbatches=K, schedule=...)``, each schedule the mode runs (ZB-H1 and interleaved 1F1B:
  explicit mode; interleaved with ``virtual_stages=2``, two chunks of blocks a stage).

Each row: the median step time, its ratio to the same mode's data-parallel row (of each
round, the paired ratio), the compiled step's memory per device (``memory_analysis()``:
arguments, temporaries, peak), its collectives per step from the census (bytes, the
permutes' among them), whether the census matches, and the schedule's bubble (``bubble_fraction``).
On emulated devices sharing 2 cores the stages do not run at once: the times say what
the schedules cost in work (1F1B's recomputed forward, ZB-H1's held pullbacks, interleaved
1F1B's chunk moves and its ticks of one chunk each, about twice as many; the bubble's idle slots
skipped), not what a pipeline gains on real devices (see docs/benchmarks.md).

    python benchmarks/pipeline.py --quick
    python benchmarks/pipeline.py --json benchmarks/results/pipeline.json
    python benchmarks/pipeline.py --smoke --json out.json   # tests/test_benchmarks.py

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

MODES = ("explicit", "implicit")
SCHEDULES = {"explicit": ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b"), "implicit": ("gpipe", "1f1b")}
CHUNKS = 2  # interleaved 1F1B's chunks a stage (virtual_stages): the depth must divide by stages x 2


def _model(width: int, depth: int) -> tuple[Any, Any, Callable[..., Any]]:
    """``(Block, Net, loss_fn)``: the residual blocks, the model, mean squared error."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import substrax

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(width, width, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + jnp.tanh(self.linear(x))

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Linear(16, width, rngs=rngs)

            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def stack(rngs: nnx.Rngs) -> Block:
                return Block(rngs)

            self.blocks = stack(rngs)
            self.head = nnx.Linear(width, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.head(substrax.nn.scan_layers(self.blocks, self.embed(x)))[:, 0]

    def loss_fn(model: Net, batch: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    return Block, Net, loss_fn


def _spellings(modes: tuple[str, ...], ks: list[int], stages: int) -> list[str]:
    names = []
    for k in ks:
        for mode in modes:
            names.append(f"data8:{mode}:k{k}")
            names += [f"stage{stages}xdata{8 // stages}:{mode}:{s}:k{k}" for s in SCHEDULES[mode]]
    return names


def _build(
    name: str, batch_size: int, width: int, depth: int
) -> tuple[dict[str, Any], Any, Callable[[], Any]]:
    """One spelling: its row's labels and compiled facts, its step, and a call of it."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import substrax
    from substrax.mesh import create_device_mesh

    Block, Net, loss_fn = _model(width, depth)
    mesh_text, mode, *schedule, k_text = name.split(":")
    k = int(k_text[1:])
    schedule = schedule[0] if schedule else None
    stages = 1 if schedule is None else int(mesh_text[len("stage") :].split("x")[0])
    shape = {"data": 8} if schedule is None else {"data": 8 // stages, "stage": stages}
    mesh = create_device_mesh(shape)
    with jax.set_mesh(mesh):
        model = Net(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    chunks = CHUNKS if schedule == "interleaved-1f1b" else 1
    substrax.shard_state(
        model, optimizer, mesh=mesh, layout="replicated", stages=None if schedule is None else Block,
        **({"virtual_stages": chunks} if chunks > 1 else {}),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(batch_size, 16)).astype(np.float32),
        "y": rng.normal(size=(batch_size,)).astype(np.float32),
    }
    step = substrax.make_train_step(loss_fn, mode, mesh=mesh, microbatches=k, schedule=schedule)
    row: dict[str, Any] = {
        "spelling": name,
        "mesh": mesh_text,
        "mode": mode,
        "schedule": schedule or "-",
        "k": k,
        "virtual_stages": chunks,
    }
    row["bubble"] = 0.0 if schedule is None else substrax.bubble_fraction(stages, k, schedule, chunks)
    row |= M.memory(step.lower(model, optimizer, batch).compile())  # the program the call runs
    comparison = step.check_communication(model, optimizer, batch)
    row["census_matches"] = comparison.matches
    row |= M.collectives(comparison.report)
    row["permute_bytes"] = comparison.report.bytes_per_step("collective-permute")
    fast = step.bind(model, optimizer)
    return row, fast, functools.partial(fast, batch)


def run(
    width: int, depth: int, batch_size: int, ks: list[int], rounds: int, block_s: float,
    modes: tuple[str, ...] = MODES, stages: int = 4,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(8)

    names = _spellings(modes, ks, stages)
    calls: dict[str, Callable[[], Any]] = {}
    info: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            start = time.perf_counter()  # compile_s: the build (its census) and the first call
            row, _, call = _build(name, batch_size, width, depth)
            row["compile_s"] = M.first_call_s(call, 2, start)
            calls[name] = call
        except M.REPORTED as e:
            row = {"spelling": name, "error": M.error_text(e)}
        info[name] = row
    print(f"  compiled {len(calls)} spellings; timing", file=sys.stderr)
    samples, block = M.interleaved(calls, rounds, block_s, reference=next(iter(calls), names[0]))
    rows = []
    for name in names:
        row = {"width": width, "depth": depth, "batch": batch_size, "rounds": rounds, "block": block} | info[
            name
        ]
        if name in calls:
            row |= M.summary_us(samples[name])
            base = f"data8:{row['mode']}:k{row['k']}"
            row["vs"] = base
            if base in samples:
                row |= M.paired_ratio(samples[name], [samples[base]])
                row["temp_ratio"] = row["temp_bytes"] / max(1, info[base].get("temp_bytes") or 1)
        rows.append(row)
    return rows, {"width": width, "depth": depth, "batch": batch_size, "stages": stages}


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    title = (
        f"pipeline: {meta['depth']} residual blocks of width {meta['width']} "
        "between an embedding and a head, "
        f"global batch {meta['batch']}, Adam, 8 emulated {meta['backend']} devices; {meta['cpus']} CPUs; "
        f"jax {meta['jax']}, flax {meta['flax']}, optax {meta['optax']}; {meta['date']}"
    )
    columns = M.timing_columns(42, 15) + [
        ("ratio", ">6", M.ratio_cell("paired_ratio")),
        ("bubble", ">6", lambda r: f"{r['bubble']:.0%}"),
        ("arg", ">10", M.bytes_cell("argument_bytes")),
        ("temp", ">10", M.bytes_cell("temp_bytes")),
        ("temp/dp", ">7", M.ratio_cell("temp_ratio")),
        ("peak", ">10", M.bytes_cell("peak_bytes")),
        ("comm/step", ">11", M.bytes_cell("comm_bytes")),
        ("permutes", ">10", M.bytes_cell("permute_bytes")),
        ("rule", ">4", M.rule_cell),
        ("compile s", ">9", M.compile_cell),
    ]
    notes = [
        (
            "median: per step (.bind, donated); ratio: the paired ratio to the same mode's data8 row at the "
            "same K"
        ),
        (
            "(each round's time over that row's, median over rounds). bubble: the schedule's bubble_fraction "
            f"(interleaved: {CHUNKS} chunks a stage)."
        ),
        "arg, temp, peak: memory_analysis() of one device's program (arguments: its state and batch; peak:",
        "argument + output + temp - alias); temp/dp: temp over the data8 row's. comm: collective bytes per",
        (
            "device per step from the census (loops multiplied out), permutes: the collective-permutes among "
            "them;"
        ),
        (
            "rule: the census matches the step's expected communication (implicit pipelines: XLA's own "
            "choice)."
        ),
    ]
    return M.table(title, columns, rows, notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="width 128, batch 512, K 8, 4 rounds: a few minutes"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write the rows as JSON and the table beside it (.txt)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="width 16, batch 64, K 2, explicit only, 2 stages, one round (make test)",
    )
    parser.add_argument("--width", type=int)
    parser.add_argument("--depth", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--k", type=int, nargs="*", help="microbatches per step (default 4 16)")
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args()
    width = args.width or (16 if args.smoke else 128 if args.quick else 256)
    depth = args.depth or (4 if args.smoke else 8)
    batch_size = args.batch or (64 if args.smoke else 512 if args.quick else 2048)
    ks = args.k or ([2] if args.smoke else [8] if args.quick else [4, 16])
    rounds = args.rounds or (1 if args.smoke else 4 if args.quick else 10)
    block_s = 0.0 if args.smoke else 0.05
    modes = ("explicit",) if args.smoke else MODES
    start = time.perf_counter()
    rows, model = run(width, depth, batch_size, ks, rounds, block_s, modes, stages=2 if args.smoke else 4)
    meta = (
        M.machine()
        | model
        | {"wall_s": time.perf_counter() - start, "quick": args.quick, "smoke": args.smoke}
    )
    text = table(rows, meta)
    print(text)
    M.write(args.json, {"meta": meta, "rows": rows}, text + "\n")
    M.exit_on_failures(rows, "pipeline.py")


if __name__ == "__main__":
    main()
