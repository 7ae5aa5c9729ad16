"""Gradient accumulation: memory and step time for k microbatches, and against optax.MultiSteps.

A model whose activations dominate its memory: an MLP of ``--layers`` hidden layers of
width ``--width`` (input the same width, output 1, ReLU, mean squared error) on a large
batch, Adam, 8 emulated CPU devices. Times, interleaved round by round after warm-up:

- ``MODE:kK``: ``make_train_step(loss_fn, MODE, microbatches=K).bind(model, optimizer)``
  on the whole batch, for K = 1, 2, 4, 8; K = 1 is the step on the whole batch at once.
  The ratio is to the same mode's K = 1 (issue 11's goal: within 1.15x), and the
  temporary bytes of the step compiled without donation (``memory_analysis()``; the
  update then writes buffers of its own, so they are the microbatches' activations) to
  K = 1's (goal: roughly 1/K).
- ``multisteps:MODE:kK``: the naive accumulation: the optimizer is
  ``optax.MultiSteps(optax.adam, every_k_schedule=K)`` and the plain replicated step
  (``make_train_step(loss_fn, MODE).bind``, one microbatch per call) runs K times per
  optimizer step on the K microbatches of the same global batch (each the rows
  the accumulating step gives microbatch j: every device's j-th slice). Time per
  optimizer step (K calls), its ratio to ``explicit:kK``, and the all-reduces executed
  per optimizer step: each compiled step's census (``TrainStep.census``: executions,
  loops multiplied out by their trip counts) times the calls.

After warm-up (4 optimizer steps from the same initial parameters) each MultiSteps row
reports its parameters' largest difference from ``explicit:kK``'s, so the rows are
known to compute the same update.

    python benchmarks/accumulation.py --quick
    python benchmarks/accumulation.py --json benchmarks/results/accumulation.json
    python benchmarks/accumulation.py --smoke --json out.json   # tests/test_benchmarks.py

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

MODES = ("implicit", "explicit")


@functools.cache  # one MLP class for every spelling, as one model type
def _model(width: int, layers: int) -> tuple[Any, Callable[..., Any]]:
    """``(MLP, loss_fn)``: ``layers`` hidden ReLU layers of ``width``, mean squared error."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.hidden = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])
            self.out = nnx.Linear(width, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            for layer in self.hidden:
                x = jax.nn.relu(layer(x))
            return self.out(x)

    def loss_fn(model: MLP, batch: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    return MLP, loss_fn


def _microbatches(host: dict[str, Any], k: int, sharding: Any) -> list[dict[str, Any]]:
    """Microbatch j: every device's j-th slice of its rows, as the accumulating step cuts them."""
    import numpy as np

    from substrax.spmd import place_batch_on_shards

    devices = sharding.mesh.size
    rows_per_device = len(host["x"]) // devices
    m = rows_per_device // k
    out = []
    for j in range(k):
        rows = np.concatenate(
            [
                np.arange(d * rows_per_device + j * m, d * rows_per_device + (j + 1) * m)
                for d in range(devices)
            ]
        )
        out.append(place_batch_on_shards({key: v[rows] for key, v in host.items()}, sharding))
    return out


def _census_facts(fast: Any, batch: Any, calls_per_step: int) -> dict[str, Any]:
    """The step's census, per optimizer step (``calls_per_step`` calls of ``fast``)."""
    comparison = fast.census(batch)
    brief = M.collectives(comparison.report)
    row: dict[str, Any] = {"census_matches": comparison.matches, "calls_per_optimizer_step": calls_per_step}
    row["comm_bytes"] = brief["comm_bytes"] * calls_per_step
    row["executions"] = {kind: n * calls_per_step for kind, n in brief["executions"].items()}
    row["all_reduces"] = row["executions"].get("all-reduce", 0)
    row["collectives_in_loop"] = brief["in_loop"]
    return row


def _spelling(
    name: str, sharding: Any, host: dict[str, Any], batch: Any, width: int, layers: int
) -> tuple[dict[str, Any], Callable[[], Any] | None, Callable[[], list] | None]:
    """One spelling built, compiled and its census taken: ``(row, call, params)``; a spelling
    that raised has its row's ``error`` and no call."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import substrax

    MLP, loss_fn = _model(width, layers)
    mesh = sharding.mesh
    row: dict[str, Any] = {"spelling": name}
    try:
        *multi, mode, k_text = name.split(":")
        k = int(k_text[1:])
        row |= {"mode": mode, "k": k, "multisteps": bool(multi)}
        model = MLP(nnx.Rngs(0))
        if multi:
            tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=k)
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
            step = substrax.make_train_step(loss_fn, mode, mesh=mesh)
            pieces = _microbatches(host, k, sharding)
            fast = step.bind(model, optimizer)

            def call(fast: Any = fast, pieces: list = pieces) -> Any:
                for piece in pieces:
                    loss = fast(piece)
                return loss

            compiled_batch, calls_per_step = pieces[0], k
        else:
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
            step = substrax.make_train_step(loss_fn, mode, mesh=mesh, microbatches=k)
            fast = step.bind(model, optimizer)
            call = functools.partial(fast, batch)
            compiled_batch, calls_per_step = batch, 1
        row["compile_s"] = M.first_call_s(call, 3)
        fast.sync()  # memory of the step compiled undonated: the update writes buffers of its own,
        lowered = step.lower(model, optimizer, compiled_batch, donate=False)
        row |= M.memory(lowered.compile())  # temp: the activations
        row |= _census_facts(fast, compiled_batch, calls_per_step)

        def params(model: Any = model, fast: Any = fast) -> list:
            fast.sync()
            return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]

    except M.REPORTED as e:
        row["error"] = M.error_text(e)
        return row, None, None
    return row, call, params


def _rows(
    names: list[str], info: dict[str, dict[str, Any]], samples: dict[str, list[float]], common: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per spelling: ``common``, its facts, its timing and its ratio to the one it is compared to."""
    import numpy as np

    medians = {name: float(np.median(samples[name])) * 1e6 for name in samples}
    rows = []
    for name in names:
        row = common | info[name]
        if name in samples:
            row |= M.summary_us(samples[name])
            one = f"{row['mode']}:k1"
            if row["multisteps"]:
                base = f"explicit:k{row['k']}"
                row["vs"] = base
            else:
                base = one
                row["vs"] = one
                if info.get(one, {}).get("temp_bytes"):
                    row["temp_ratio_to_k1"] = row["temp_bytes"] / info[one]["temp_bytes"]
            if base in medians:
                row["ratio"] = medians[name] / medians[base]
        rows.append(row)
    return rows


def run(
    width: int,
    layers: int,
    batch_size: int,
    ks: list[int],
    multi_ks: list[int],
    rounds: int,
    devices: int,
    block_s: float = 0.05,
    modes: tuple[str, ...] = MODES,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(devices)

    import jax
    import numpy as np
    from flax import nnx

    from substrax.mesh import create_device_mesh
    from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

    sharding = create_data_parallel_sharding(create_device_mesh({"data": devices}))
    rng = np.random.default_rng(0)
    host = {
        "x": rng.normal(size=(batch_size, width)).astype(np.float32),
        "y": rng.normal(size=(batch_size, 1)).astype(np.float32),
    }
    batch = place_batch_on_shards(host, sharding)
    names = [f"{mode}:k{k}" for mode in modes for k in ks]
    names += [f"multisteps:{mode}:k{k}" for k in multi_ks for mode in modes]
    calls: dict[str, Callable[[], Any]] = {}
    info: dict[str, dict[str, Any]] = {}
    params_of: dict[str, Callable[[], list]] = {}
    for name in names:
        info[name], call, params = _spelling(name, sharding, host, batch, width, layers)
        if call is not None and params is not None:
            calls[name], params_of[name] = call, params

    for name in names:  # same update as the explicit accumulation, after the same 4 optimizer steps
        twin = f"explicit:k{info[name].get('k')}"
        if info[name].get("multisteps") and name in params_of and twin in params_of:
            diffs = [np.max(np.abs(a - b)) for a, b in zip(params_of[name](), params_of[twin](), strict=True)]
            info[name]["max_param_diff_vs_explicit"] = float(max(diffs))

    print(f"  compiled {len(calls)} spellings; timing", file=sys.stderr)
    samples, block = M.interleaved(calls, rounds, block_s, reference=names[0])
    MLP = _model(width, layers)[0]
    params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(MLP(nnx.Rngs(0)), nnx.Param)))
    common = {"width": width, "layers": layers, "batch": batch_size, "params": params, "devices": devices}
    rows = _rows(names, info, samples, common | {"rounds": rounds, "block": block})
    return rows, {"width": width, "layers": layers, "batch": batch_size, "params": params}


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    title = (
        f"accumulation: MLP {meta['layers']} hidden x {meta['width']} ({meta['params']:,} params), "
        f"global batch {meta['batch']}, Adam, {meta['devices']} emulated {meta['backend']} devices; "
        f"{meta['cpus']} CPUs; jax {meta['jax']}, flax {meta['flax']}, optax {meta['optax']}; {meta['date']}"
    )
    columns = M.timing_columns(22, 17) + [
        ("ratio", ">6", M.ratio_cell("ratio")),
        ("vs", "<12", lambda r: r["vs"]),
        ("temp", ">10", M.bytes_cell("temp_bytes")),
        ("temp/k1", ">7", M.ratio_cell("temp_ratio_to_k1")),
        ("arg", ">10", M.bytes_cell("argument_bytes")),
        ("AR/opt step", ">11", lambda r: r["all_reduces"]),
        ("comm/opt step", ">13", M.bytes_cell("comm_bytes")),
        ("in loop", ">7", lambda r: r["collectives_in_loop"]),
        ("rule", ">4", M.rule_cell),
        ("compile s", ">9", M.compile_cell),
    ]

    def below(r: dict[str, Any]) -> list[str]:
        if "max_param_diff_vs_explicit" not in r:
            return []
        return [
            f"{'':<23} parameters after 4 optimizer steps differ from "
            f"{r['vs']}'s by at most {r['max_param_diff_vs_explicit']:.2e}"
        ]

    notes = [
        "median: per optimizer step (MultiSteps: K calls of the plain step on the K microbatches).",
        "ratio: median / the median of 'vs' (MODE:k1, the whole batch at once; or explicit:kK), same run.",
        "temp: memory_analysis().temp_size_in_bytes of one device's program, compiled undonated",
        "(MultiSteps: one call's).",
        "AR/opt step: all-reduces executed per optimizer step, from the census of each compiled step times",
        "its calls (loops multiplied out); comm: collective bytes per device per optimizer step; in loop:",
        "collective instructions inside a while loop; rule: the census matches the step's expected rule.",
    ]
    return M.table(title, columns, rows, notes, below)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="width 128, batch 2048, 4 rounds: under a minute"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write the rows as JSON and the table beside it (.txt)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="width 32, 1 layer, batch 64, K 1 and 2, explicit only, one round (make test)",
    )
    parser.add_argument("--width", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--k", type=int, nargs="*", help="microbatches per step (default 1 2 4 8)")
    parser.add_argument("--multisteps-k", type=int, nargs="*", help="K of the optax.MultiSteps rows")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    width = args.width or (32 if args.smoke else 128 if args.quick else 256)
    layers = args.layers or (1 if args.smoke else 3)
    batch_size = args.batch or (64 if args.smoke else 2048 if args.quick else 8192)
    ks = args.k or ([1, 2] if args.smoke else [1, 2, 4, 8])
    multi_ks = args.multisteps_k if args.multisteps_k is not None else [max(ks)]
    rounds = args.rounds or (1 if args.smoke else 4 if args.quick else 20)
    block_s = 0.0 if args.smoke else 0.05
    start = time.perf_counter()
    modes = ("explicit",) if args.smoke else MODES
    rows, model = run(
        width, layers, batch_size, sorted(set(ks) | {1}), multi_ks, rounds, args.devices, block_s, modes
    )
    meta = M.machine() | model | {"wall_s": time.perf_counter() - start}
    meta |= {"quick": args.quick, "smoke": args.smoke}
    text = table(rows, meta)
    print(text)
    M.write(args.json, {"meta": meta, "rows": rows}, text + "\n")
    M.exit_on_failures(rows, "accumulation.py")


if __name__ == "__main__":
    main()
