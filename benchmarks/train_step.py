"""Step time of each training-step spelling against a hand-written bound.

Two models: an MLP at a sweep of widths (small, where per-call dispatch dominates, up to
large, where the math does), and the char-level transformer of
``examples/transformer_lm.py`` (d=64, 2 blocks, 4 heads, seq 32, batch 32, AdamW). For 1
and 8 emulated CPU devices, times every spelling of one data-parallel step on the same
batch:

- ``implicit``:  ``spmd_train_step`` inside the user's own ``nnx.jit`` (the reference spelling)
- ``explicit``:  ``explicit_train_step`` inside the user's own ``nnx.jit``
- ``make_train_step:MODE``: the plain call ``make_train_step(loss_fn, MODE)(model, optimizer, batch)``
- ``bound_step:MODE``: ``make_train_step(...).bind(model, optimizer)``
- ``bound_step_undonated:MODE``: the same with ``bind(..., donate=False)``
- ``make_train_step_unguarded:MODE`` / ``bound_step_unguarded:MODE`` (transformer): the
  plain call and ``.bind`` with ``skip_nonfinite=False``, beside the guarded ones: the
  non-finite guard's price
- ``make_train_step:MODE:LAYOUT`` / ``bound_step:MODE:LAYOUT`` (transformer): the state
  placed by ``substrax.shard_state`` first, ``zero1`` or ``fsdp``
- two hand-written bounds, each a pure function of the split state (a flat list of
  arrays) with donated buffers: ``bound``, the step in ``jax.jit`` (XLA inserts the
  all-reduce), and ``bound_shard_map``, the step under ``jax.shard_map`` (loss
  ``pmean``-ed before ``grad``, replicated state).

Every ratio is to the faster of the two bounds, measured in the same run (the layouts'
rows too: the bounds are the replicated step). Spellings run interleaved
(A B C ... A B C ...) after warm-up, each run a block of steps; the median over runs and
the spread (25th-75th percentile) are reported, with compile time (first call) and the
bytes the compiled step communicates per device per step (``substrax.census``; for a
``TrainStep`` also whether that matches its layout's expected communication). Each
device count runs in its own process, since jax fixes the device count at start.

    python benchmarks/train_step.py --json benchmarks/results/train_step.json
    python benchmarks/train_step.py --quick --json out.json   # make bench
    python benchmarks/train_step.py --smoke --json out.json   # tests/test_benchmarks.py

``--smoke`` checks that the script runs, in seconds: 8 devices, every kind of spelling
once (the MLP at width 32: the bounds, the reference spellings, ``.bind`` undonated; the
example's model at 1 block of width 16: the bounds, the plain call, ``.bind``), one
round of one-step blocks.

A row whose spelling (or census) raised is printed ``n/a`` with its error and written
so; the script then exits with status 1, naming every such row.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

Spelling = tuple[Callable[[], Any], Callable[[], Any] | None]  # the step call; its census call or None
BOUNDS = ("bound", "bound_shard_map")
MODES = ("implicit", "explicit")
LAYOUTS = ("zero1", "fsdp")  # beside the replicated state every spelling uses
SMOKE_LM = {"seq": 8, "d": 16, "blocks": 1}
# the plain call and .bind with the non-finite guard (the default) and without it, side by side
GUARD_KINDS = (
    "make_train_step",
    "bound_step",
    "make_train_step_unguarded",
    "bound_step_unguarded",
)  # --smoke: the example's model, small enough to compile fast


def reference_spellings() -> list[str]:
    return [*BOUNDS, *MODES]


def mode_spellings(kinds: tuple[str, ...], layouts: tuple[str, ...] = ()) -> list[str]:
    names = [f"{kind}:{mode}" for kind in kinds for mode in MODES]
    return names + [f"{kind}:{mode}:{layout}" for layout in layouts for kind in kinds[:2] for mode in MODES]


def communication(take_census: Callable[[], Any] | None) -> tuple[int | None, bool | None]:
    """Bytes the compiled step moves through collectives per step, per device, and whether
    that matches its layout's rule.

    ``take_census()`` returns ``TrainStep.census(...)`` (a ``substrax.Comparison``, whose
    ``.matches`` holds the census against the layout's expected communication) or, for
    the hand-written bounds, ``substrax.census`` of the compiled program (a
    ``CensusReport``). Bytes are its ``bytes_per_step()``: buffer sizes as nccl-tests
    count them, loops multiplied out. ``(None, None)`` (printed "-") without a census
    (``--no-census``, ``--quick``) or where the spelling does not compile by itself (the
    reference spellings, inside the user's ``nnx.jit``).
    """
    if take_census is None:
        return None, None
    result = take_census()
    report = getattr(result, "report", result)
    return int(report.bytes_per_step()), getattr(result, "matches", None)


@dataclasses.dataclass
class _Setup:
    """What every measurement of one worker shares."""

    mesh: Any
    rounds: int
    block_s: float
    with_census: bool


@dataclasses.dataclass
class _Found:
    """What ``_measure`` found of its spellings: calls, compile seconds, census, errors, samples."""

    calls: dict[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)
    # by program: MODE[:LAYOUT], or the bound
    comm: dict[str, tuple[int | None, bool | None]] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    census_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    block: int = 0

    def failed(self, name: str, e: Exception) -> None:  # a spelling the library refuses: reported, not fatal
        self.errors[name] = M.error_text(e)
        self.calls.pop(name, None)


def _stepper(setup: _Setup, jitted: Any, arrays: list, batch: Any) -> Spelling:
    import substrax

    program_census = substrax.census if setup.with_census else None
    box = [arrays]

    def call() -> Any:
        box[0], loss = jitted(box[0], batch)
        return loss

    take = (lambda: program_census(jitted.lower(box[0], batch).compile())) if program_census else None
    return call, take


def _jit_bound(setup: _Setup, model: Any, optimizer: Any, loss_fn: Callable, batch: Any) -> Spelling:
    """By hand: split once, and step a flat list of arrays (an nnx.State argument would
    cost a Python pytree flatten per call), donated; XLA inserts the all-reduce."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split((model, optimizer))
    treedef = jax.tree.structure(state)

    def pure(arrays: list, batch: Any) -> tuple:
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return jax.tree.leaves(nnx.state((model, optimizer))), loss

    return _stepper(setup, jax.jit(pure, donate_argnums=0), jax.tree.leaves(state), batch)


def _shard_map_bound(setup: _Setup, model: Any, optimizer: Any, loss_fn: Callable, batch: Any) -> Spelling:
    """The same step under shard_map: each device its shard, the loss pmean-ed before grad."""
    import jax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    graphdef, state = nnx.split((model, optimizer))
    treedef = jax.tree.structure(state)

    def per_device(arrays: list, shard: Any) -> tuple:
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
        global_loss = lambda model: jax.lax.pmean(loss_fn(model, shard), "data")  # noqa: E731
        loss, grads = nnx.value_and_grad(global_loss)(model)
        optimizer.update(model, grads)
        return jax.tree.leaves(nnx.state((model, optimizer))), loss

    mapped = jax.shard_map(
        per_device, mesh=setup.mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=True
    )
    return _stepper(setup, jax.jit(mapped, donate_argnums=0), jax.tree.leaves(state), batch)


def _spelling(
    setup: _Setup, name: str, fresh: Callable[[], tuple], loss_fn: Callable, batch: Any
) -> Spelling:
    """One spelling on a model and optimizer of its own: its step call (no arguments)
    and, where it compiles by itself, a call that takes its census."""
    from flax import nnx

    import substrax
    from substrax.explicit import explicit_train_step
    from substrax.spmd import spmd_train_step

    model, optimizer = fresh()
    if name in BOUNDS:
        return (_jit_bound if name == "bound" else _shard_map_bound)(setup, model, optimizer, loss_fn, batch)
    if name in MODES:
        inner = spmd_train_step if name == "implicit" else explicit_train_step
        jitted = nnx.jit(functools.partial(lambda m, o, b, inner: inner(m, o, loss_fn, b), inner=inner))
        return functools.partial(jitted, model, optimizer, batch), None
    kind, mode, *layout = name.split(":")
    if layout:
        substrax.shard_state(model, optimizer, mesh=setup.mesh, params=layout[0] == "fsdp")
    guarded = not kind.endswith("_unguarded")  # the non-finite guard on (the default) or off
    step = substrax.make_train_step(loss_fn, mode, skip_nonfinite=guarded)  # type: ignore[arg-type]
    if kind.startswith("bound_step"):
        fast = step.bind(model, optimizer, donate=kind != "bound_step_undonated")
        take = functools.partial(fast.census, batch) if setup.with_census else None
        return functools.partial(fast, batch), take
    take = functools.partial(step.census, model, optimizer, batch) if setup.with_census else None
    return functools.partial(step, model, optimizer, batch), take


def _program(name: str) -> str:
    """The plain, bound and undonated calls of one mode and layout compile one program
    (unguarded: another)."""
    if ":" not in name:
        return f"{name} (own)"
    kind, rest = name.split(":", 1)
    return f"{rest} unguarded" if kind.endswith("_unguarded") else rest


def _warm(found: _Found, built: dict[str, Spelling]) -> None:
    """Each built spelling's first call (its compile, timed), three more, and its census."""
    import jax

    for name, (call, take_census) in built.items():
        try:
            start = time.perf_counter()
            jax.block_until_ready(call())
            found.compile_s[name] = time.perf_counter() - start
            for _ in range(3):
                jax.block_until_ready(call())
            found.calls[name] = call
        except Exception as e:
            found.failed(name, e)
            continue
        try:
            if found.comm.get(_program(name), (None, None))[0] is None:
                found.comm[_program(name)] = communication(take_census)
        except Exception as e:  # the census failed, not the step: time it anyway
            found.census_errors[name] = M.error_text(e)


def _time(found: _Found, rounds: int, block_s: float) -> None:
    """Every call once per round, interleaved, each sample a block of calls sized from the bound."""
    import jax

    calls = found.calls
    start = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(calls["bound"]())
    block = max(1, min(50, int(block_s / ((time.perf_counter() - start) / 3))))  # each run ~block_s
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in list(calls.items()):  # interleaved: every spelling once per round
            try:
                start = time.perf_counter()
                for _ in range(block):
                    out = call()
                jax.block_until_ready(out)
                samples[name].append((time.perf_counter() - start) / block)
            except Exception as e:
                found.failed(name, e)
    found.samples, found.block = samples, block


def _rows(
    setup: _Setup, found: _Found, label: dict[str, Any], names: list[str], params: int
) -> list[dict[str, Any]]:
    import jax
    import numpy as np

    samples = found.samples
    bounds_us = {name: float(np.median(samples[name])) * 1e6 for name in BOUNDS}
    bound_us = min(bounds_us.values())
    rows = []
    for name in names:
        row = {
            **label,
            "params": params,
            "devices": setup.mesh.size,
            "mode": name,
            "backend": jax.default_backend(),
        }
        row |= {
            "rounds": setup.rounds,
            "block": found.block,
            "bound_us": bounds_us,
            "faster_bound": min(bounds_us, key=lambda name: bounds_us[name]),
        }
        if name in found.errors or not samples.get(name):
            rows.append(row | {"error": found.errors.get(name, "no samples")})
            continue
        times = np.asarray(samples[name]) * 1e6
        comm = found.comm.get(_program(name), (None, None))
        rows.append(
            row
            | {
                "median_step_us": float(np.median(times)),
                "p25_step_us": float(np.percentile(times, 25)),
                "p75_step_us": float(np.percentile(times, 75)),
                "ratio_to_bound": float(np.median(times)) / bound_us,
                **M.paired_ratio(samples[name], [samples[b] for b in BOUNDS]),
                "compile_s": found.compile_s[name],
                "comm_bytes": comm[0],
                "comm_as_expected": comm[1],
            }
            | ({"census_error": found.census_errors[name]} if name in found.census_errors else {})
        )
    return rows


def _measure(
    setup: _Setup,
    label: dict[str, Any],
    names: list[str],
    fresh: Callable[[], tuple],
    loss_fn: Callable,
    host_batch: Any,
) -> list[dict[str, Any]]:
    """Build every spelling, warm each up, then time them in interleaved rounds."""
    import jax
    from flax import nnx

    from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

    batch = place_batch_on_shards(host_batch, create_data_parallel_sharding(setup.mesh))
    found = _Found()
    with jax.set_mesh(setup.mesh):
        params = int(sum(x.size for x in jax.tree.leaves(nnx.state(fresh()[0], nnx.Param))))
        # Build every spelling before running any: shard_state invalidates the plain
        # call's cached split of every model, so a layout placed after a plain step's
        # first call would recompile that step once, inside the timing.
        built = {}
        for name in names:
            try:
                built[name] = _spelling(setup, name, fresh, loss_fn, batch)
            except Exception as e:
                found.failed(name, e)
        _warm(found, built)
        _time(found, setup.rounds, setup.block_s)
    return _rows(setup, found, label, names, params)


@functools.cache  # one MLP class for every width, as one model type
def _mlp() -> tuple[Any, Callable[..., Any]]:
    """``(MLP, mse)``: 64 features, two ReLU layers of ``width``, one output."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, width: int, rngs: nnx.Rngs) -> None:
            self.inp = nnx.Linear(64, width, rngs=rngs)
            self.mid = nnx.Linear(width, width, rngs=rngs)
            self.out = nnx.Linear(width, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(jax.nn.relu(self.mid(jax.nn.relu(self.inp(x)))))

    def mse(model: MLP, batch: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    return MLP, mse


def _mlp_rows(setup: _Setup, widths: list[int], smoke: bool) -> list[dict[str, Any]]:
    import numpy as np
    import optax
    from flax import nnx

    MLP, mse = _mlp()
    rng = np.random.default_rng(0)
    host = {
        "x": rng.normal(size=(256, 64)).astype(np.float32),
        "y": rng.normal(size=(256, 1)).astype(np.float32),
    }
    names = reference_spellings() + mode_spellings(("make_train_step", "bound_step", "bound_step_undonated"))
    if smoke:  # each spelling the transformer's rows leave out, in one mode
        names = [*reference_spellings(), "bound_step_undonated:explicit"]
    rows: list[dict[str, Any]] = []
    for width in widths:

        def fresh_mlp(width: int = width) -> tuple[Any, nnx.Optimizer]:
            model = MLP(width, nnx.Rngs(0))
            return model, nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)

        rows += _measure(setup, {"model": f"mlp-w{width}", "width": width}, names, fresh_mlp, mse, host)
    return rows


def _transformer_rows(
    setup: _Setup, layouts: tuple[str, ...], quick: bool, smoke: bool
) -> list[dict[str, Any]]:
    lm = M.load_example()
    sizes = SMOKE_LM if smoke else {}
    host = next(lm.batches(lm.stdlib_text(), 32, sizes.get("seq", 32), seed=0))
    if smoke:  # the plain call and .bind, one mode each, and one unguarded
        names = [
            *BOUNDS,
            "make_train_step:implicit",
            "bound_step:explicit",
            "bound_step_unguarded:implicit",
        ]
    elif quick:  # its compiles dominate: the bounds, the plain call and .bind, guarded and not
        names = [*BOUNDS, *mode_spellings(GUARD_KINDS)]
    else:
        names = reference_spellings() + mode_spellings(GUARD_KINDS)
        names += mode_spellings(("make_train_step", "bound_step", "bound_step_undonated"), layouts)
        names = list(dict.fromkeys(names))
    fresh = functools.partial(lm.make_model, **sizes)
    return _measure(setup, {"model": "transformer", **sizes}, names, fresh, lm.loss_fn, host)


def run_worker(
    devices: int,
    models: list[str],
    widths: list[int],
    layouts: tuple[str, ...],
    rounds: int,
    block_s: float,
    quick: bool = False,
    with_census: bool = True,
    smoke: bool = False,
) -> list[dict[str, Any]]:
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(devices)  # affects the CPU backend only; on a GPU run pass --devices 1

    from substrax.mesh import create_device_mesh

    setup = _Setup(create_device_mesh({"data": devices}), rounds, block_s, with_census)
    rows: list[dict[str, Any]] = []
    if "mlp" in models:
        rows += _mlp_rows(setup, widths, smoke)
    if "transformer" in models:
        rows += _transformer_rows(setup, layouts, quick, smoke)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'model':<12} {'dev':>3} {'spelling':<36} {'median us':>10} {'p25-p75 us':>16} {'x bound':>8}"
    print(header + f" {'paired (p25-p75)':>17} {'compile s':>9} {'comm bytes':>11} {'expected':>8}")
    for r in rows:
        start = f"{r['model']:<12} {r['devices']:>3} {r['mode']:<36}"
        if "error" in r:
            print(f"{start} n/a: {r['error']}")
            continue
        spread = f"{r['p25_step_us']:.0f}-{r['p75_step_us']:.0f}"
        paired = f"{r['paired_ratio']:.2f} ({r['paired_p25']:.2f}-{r['paired_p75']:.2f})"
        comm = "-" if r["comm_bytes"] is None else f"{r['comm_bytes']:,}"
        expected = {None: "-", True: "yes", False: "NO"}[r["comm_as_expected"]]
        print(
            f"{start} {r['median_step_us']:>10.0f} {spread:>16} {r['ratio_to_bound']:>8.2f} "
            f"{paired:>17} "
            f"{r['compile_s']:>9.2f} {comm:>11} {expected:>8}"
        )
        if "census_error" in r:
            print(f"{'':<53} census failed: {r['census_error']}")
    print("x bound: median step time / the faster of bound (jax.jit) and bound_shard_map, same run")
    print("paired: the median (p25-p75) over rounds of the step's time / the faster bound's in that round")
    print(
        "comm bytes: collective buffers per device per step (substrax.census); expected: as its layout's rule"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="two MLP widths, fewer rounds; the transformer replicated, donated only",
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--devices", type=int, nargs="*", help="default 1 8 (--smoke: 8)")
    parser.add_argument("--models", nargs="*", choices=("mlp", "transformer"), default=["mlp", "transformer"])
    parser.add_argument("--widths", type=int, nargs="*", help="MLP widths")
    parser.add_argument("--layouts", nargs="*", choices=LAYOUTS, help="state layouts for the transformer")
    parser.add_argument("--rounds", type=int)
    parser.add_argument(
        "--no-census", action="store_true", help="leave the comm bytes column empty (--quick does)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="that the script runs, in seconds (see the module docstring; make test)",
    )
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.quick = args.quick or args.smoke
    args.devices = args.devices or ([8] if args.smoke else [1, 8])
    widths = args.widths or ([32] if args.smoke else [32, 512] if args.quick else [32, 256, 1024, 2048])
    layouts = args.layouts if args.layouts is not None else ([] if args.quick else list(LAYOUTS))
    rounds = args.rounds or (1 if args.smoke else 15 if args.quick else 30)

    if args.worker:
        block_s = 0.0 if args.smoke else 0.01 if args.quick else 0.03
        rows = run_worker(
            args.worker,
            args.models,
            widths,
            tuple(layouts),
            rounds,
            block_s,
            args.quick,
            not args.no_census,
            args.smoke,
        )
        print(json.dumps(rows))
        return

    rows = []
    for devices in args.devices:
        cmd = [sys.executable, __file__, "--worker", str(devices), "--rounds", str(rounds)]
        cmd += ["--models", *args.models, "--widths", *map(str, widths), "--layouts", *layouts]
        cmd += ["--smoke"] if args.smoke else ["--quick"] if args.quick else []
        cmd += ["--no-census"] if args.no_census or args.quick else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"worker for {devices} device(s) failed:\n{out.stderr}")
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")
    M.exit_on_failures(rows, "train_step.py")


if __name__ == "__main__":
    main()
