"""One accelerator chip: the example transformer's step against a hand-written bound, its MFU, and
the plan's peak against the chip's.

Runs on the first device jax finds (a TPU when one is present; ``--smoke`` and ``--quick`` also run
on a CPU). For each size of ``examples/transformer_lm.py``'s model and each precision (float32, and
bfloat16 compute by ``substrax.MixedPrecision``), times on a mesh of that one device:

- ``bound``: a hand-written ``jax.jit`` step of the same computation (a pure function of the split
  state, donated; bfloat16: the parameters cast inside the differentiated function);
- ``plain:MODE``: ``make_train_step(loss_fn, MODE)(model, optimizer, batch)``;
- ``bind:MODE``: ``make_train_step(loss_fn, MODE).bind(model, optimizer)(batch)``.

Spellings run interleaved after warm-up (``benchmarks/_measure.py``); each row gives its median step
time, the ratio to the bound in the same round (median over rounds), tokens per second and the MFU:
``6 * parameters * tokens / time / peak`` (the attention's score and value products left out, as
that count does), with ``--peak-tflops`` or the chip's bfloat16 peak from its device kind (TPU v5e:
197). Per mode and precision, the compiled step's peak (``memory_analysis()``: argument + output +
temp - alias, donated) beside ``substrax.plan``'s ``peak_bytes`` for the same configuration.

With ``--predict`` it runs on a CPU instead (with libtpu): each size, precision and mode compiled for
a one-chip v5e topology, its step predicted from the program (``substrax.timeline.predict``) beside
the step the chip measured (``benchmarks/_predicted.py``; ``--programs DIR`` keeps the compiled
programs and predicts from them again).

    python benchmarks/chip.py --json benchmarks/results/chip_tpu_v5e.json       # on the chip
    python benchmarks/chip.py --quick --json benchmarks/results/chip_quick.json  # make bench
    python benchmarks/chip.py --smoke --json out.json                            # tests/test_benchmarks.py
    python benchmarks/chip.py --predict --programs /tmp/programs --json benchmarks/results/chip_predicted.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

MODES = ("implicit", "explicit")
SIZES = {  # name: (d, blocks, heads, seq, batch)
    "13M": (512, 4, 8, 512, 16),
    "102M": (1024, 8, 16, 1024, 8),
    "342M": (1536, 12, 12, 1024, 4),
    "quick": (128, 2, 4, 128, 8),
    "smoke": (16, 1, 2, 8, 4),
}
PEAK_TFLOPS = {
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v4": 275.0,
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,
}


def run(
    sizes: list[str],
    precisions: list[str],
    rounds: int,
    block_s: float,
    peak: float | None,
    spellings: tuple[str, ...] = ("bound", "plain", "bind"),
    planned: bool = True,
    modes: tuple[str, ...] = MODES,
    compiled: bool = True,
) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import substrax
    from substrax.mesh import create_device_mesh

    example = M.load_example()
    mesh = create_device_mesh({"data": 1}, devices=jax.devices()[:1])
    kind = jax.devices()[0].device_kind
    peak = peak or PEAK_TFLOPS.get(kind)
    rows = []
    for size in sizes:
        d, blocks, heads, seq, batch_rows = SIZES[size]
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, example.VOCAB, size=(batch_rows, seq + 1)).astype(np.int32)
        batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}

        def fresh() -> tuple[Any, Any]:
            with jax.set_mesh(mesh):
                return example.make_model(0, seq=seq, d=d, heads=heads, blocks=blocks)

        for precision_name in precisions:
            policy = substrax.MixedPrecision(jnp.bfloat16) if precision_name == "bf16" else None
            calls: dict[str, Any] = {}
            memory: dict[str, dict[str, Any]] = {}
            model, optimizer = fresh()
            params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
            if "bound" in spellings:
                calls["bound"] = _bound(model, optimizer, example.loss_fn, batch, policy, mesh)
            del model, optimizer  # each mode makes its own
            label = {"size": size, "params": int(params), "precision": precision_name}
            for mode in modes:
                try:
                    made = _mode_calls(
                        example, mode, mesh, policy, batch, fresh, spellings, planned, compiled
                    )
                    memory[mode], more = made
                    calls |= more
                except Exception as e:  # a mode the library refuses: its row says why, the run goes on
                    rows.append({**label, "spelling": mode, "error": f"{type(e).__name__}: {e}"})
            for call in calls.values():  # compiled and run once before any is timed
                jax.block_until_ready(call())
            reference = "bound" if "bound" in calls else next(iter(calls))
            samples, block = M.interleaved(calls, rounds, block_s, reference)
            tokens_per_step = batch_rows * seq
            for name, times in samples.items():
                median = float(np.median(times))
                ratio = M.paired_ratio(times, [samples[reference]])
                mode = name.split(":")[-1]
                row = {
                    "size": size, "params": int(params), "d": d, "blocks": blocks, "seq": seq,
                    "batch": batch_rows, "precision": precision_name, "spelling": name,
                    "median_step_us": median * 1e6, **ratio,
                    "tokens_per_s": tokens_per_step / median,
                    "mfu": None if peak is None else 6 * params * tokens_per_step / median / (peak * 1e12),
                    "block": block, "rounds": rounds,
                }  # fmt: skip
                if name != "bound":
                    row |= {f"{k}": v for k, v in memory[mode].items()}
                rows.append(row)
                print(row, flush=True)
    return rows


def predicted(
    sizes: list[str], precisions: list[str], modes: tuple[str, ...], programs: str | None
) -> list[dict]:
    """Each configuration's step predicted from its program compiled for v5e:1x1, beside the chip's."""
    import _predicted as P  # benchmarks/_predicted.py
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import substrax

    example = M.load_example()
    rows = []
    for size in sizes:
        d, blocks, heads, seq, batch_rows = SIZES[size]
        for precision in precisions:
            policy = substrax.MixedPrecision(jnp.bfloat16) if precision == "bf16" else None

            def build(
                d=d, blocks=blocks, heads=heads, seq=seq, batch_rows=batch_rows, policy=policy
            ) -> tuple:
                model, optimizer = nnx.eval_shape(
                    lambda: example.make_model(0, seq=seq, d=d, heads=heads, blocks=blocks)
                )
                batch = {k: jax.ShapeDtypeStruct((batch_rows, seq), jnp.int32) for k in ("tokens", "targets")}
                return example.loss_fn, model, optimizer, batch, policy

            for mode in modes:
                rows.append(P.predict(f"{size}-{precision}", mode, build, programs))
                print(rows[-1], flush=True)
    return P.joined(rows)


def _mode_calls(
    example: Any,
    mode: str,
    mesh: Any,
    policy: Any,
    batch: Any,
    fresh: Any,
    spellings: Any,
    planned: bool,
    compiled: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One mode's compiled memory (and plan peak) where asked, and its timed spellings' calls."""
    import substrax

    step = substrax.make_train_step(example.loss_fn, mode, mesh=mesh, precision=policy)
    model, optimizer = fresh()
    memory: dict[str, Any] = {}
    if compiled:  # a compile of its own: the timed calls compile theirs on the first call
        started = time.perf_counter()
        program = step.lower(model, optimizer, batch, donate=True).compile()
        memory = {**M.memory(program), "compile_s": time.perf_counter() - started}
        del program
    if planned:
        plan = substrax.plan(
            example.loss_fn, model, optimizer, batch, mesh=mesh, mode=mode,
            layouts=["replicated"], precision=policy,
        )  # fmt: skip
        memory["plan_peak_bytes"] = plan.rows[0].peak_bytes
    calls = {}
    if "plain" in spellings:
        calls[f"plain:{mode}"] = _plain(step, model, optimizer, batch)
    if "bind" in spellings:
        if "plain" not in spellings:  # one copy of the state on the chip, not two
            del model, optimizer
        bound_model, bound_optimizer = fresh()
        calls[f"bind:{mode}"] = _bind(step, bound_model, bound_optimizer, batch)
    return memory, calls


def _bound(model: Any, optimizer: Any, loss_fn: Any, batch: Any, policy: Any, mesh: Any) -> Any:
    """By hand: one donated ``jax.jit`` step of the split state (bfloat16: parameters cast inside)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split((model, optimizer))
    treedef = jax.tree.structure(state)
    cast = policy is not None

    def pure(arrays: list, batch: Any) -> tuple:
        model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
        model_graph, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_of(params: Any) -> Any:
            if cast:
                params = jax.tree.map(
                    lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
                )
            return loss_fn(nnx.merge(model_graph, params, rest), batch)

        loss, grads = jax.value_and_grad(loss_of)(params)
        optimizer.update(model, grads)
        return jax.tree.leaves(nnx.state((model, optimizer))), loss

    with jax.set_mesh(mesh):
        jitted = jax.jit(pure, donate_argnums=0)
    box = [jax.tree.leaves(state)]

    def call() -> Any:
        with jax.set_mesh(mesh):
            box[0], loss = jitted(box[0], batch)
        return loss

    return call


def _plain(step: Any, model: Any, optimizer: Any, batch: Any) -> Any:
    return lambda: step(model, optimizer, batch)


def _bind(step: Any, model: Any, optimizer: Any, batch: Any) -> Any:
    fast = step.bind(model, optimizer)
    return lambda: fast(batch)


def table(rows: list[dict], machine: dict[str, Any]) -> str:
    lines = [
        f"{machine['device_kind']} ({machine['backend']}), jax {machine['jax']}, flax {machine['flax']}, "
        f"optax {machine['optax']}, {machine['date']}",
        f"{'size':<6} {'prec':<5} {'spelling':<15} {'step ms':>9} {'x bound':>8} {'tokens/s':>11} {'MFU':>6} "
        f"{'compiled peak':>14} {'plan peak':>12} {'plan/comp':>9}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['size']:<6} {r['precision']:<5} {r['spelling']:<15} n/a: {r['error']}")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
        peak = r.get("peak_bytes")
        plan = r.get("plan_peak_bytes")
        ratio = f"{plan / peak:.3f}" if peak and plan else "-"
        lines.append(
            f"{r['size']:<6} {r['precision']:<5} {r['spelling']:<15} {r['median_step_us'] / 1e3:>9.3f} "
            f"{r['paired_ratio']:>8.3f} {r['tokens_per_s']:>11,.0f} {mfu:>6} {M.fmt_bytes(peak):>14} "
            f"{M.fmt_bytes(plan):>12} {ratio:>9}"
        )
    lines.append(
        "x bound: the median over rounds of the step's time / the bound's in that round (same run); "
        "without the bound, the first spelling's"
    )
    lines.append(
        "MFU: 6 * parameters * tokens / step time / the chip's bf16 peak; peaks: memory_analysis(), donated"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="13M,102M", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--precisions", default="f32,bf16")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block-s", type=float, default=0.5, help="seconds of steps per sample")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the chip's bf16 peak (default: by kind)"
    )
    parser.add_argument("--quick", action="store_true", help="a small size, 3 rounds (runs on a CPU too)")
    parser.add_argument("--smoke", action="store_true", help="tiny, one round of one step: that it runs")
    parser.add_argument("--spellings", default="bound,plain,bind", help="of bound, plain, bind")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="implicit, explicit (--predict: explicit-bf16-propagation)"
    )
    parser.add_argument("--no-plan", action="store_true", help="skip substrax.plan's peak (a compile each)")
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the compiled step's memory_analysis (a compile each)"
    )
    parser.add_argument("--predict", action="store_true", help="on a CPU: predicted beside the chip's")
    parser.add_argument("--programs", default=None, help="with --predict: where to keep the programs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.predict:
        import _predicted as P

        sizes = args.sizes if args.sizes != "13M,102M" else "13M,102M,342M"
        rows = predicted(
            sizes.split(","), args.precisions.split(","), tuple(args.modes.split(",")), args.programs
        )
        text = P.table(rows)
        print(text)
        M.write(args.json, {"machine": M.machine(), "rows": rows}, text + "\n")
        return
    if args.smoke or args.quick:
        args.sizes, args.rounds, args.block_s = ("smoke", 1, 0.0) if args.smoke else ("quick", 3, 0.2)
    if args.smoke:  # bfloat16 alone: every spelling once, with the policy's cast
        args.precisions = "bf16"

    import jax

    spellings = tuple(args.spellings.split(","))
    rows = run(
        args.sizes.split(","), args.precisions.split(","), args.rounds, args.block_s, args.peak_tflops,
        spellings, not args.no_plan, tuple(args.modes.split(",")), not args.no_memory,
    )  # fmt: skip
    machine = {**M.machine(), "device_kind": jax.devices()[0].device_kind}
    text = table(rows, machine)
    print(text)
    M.write(args.json, {"machine": machine, "rows": rows}, text + "\n")
    M.exit_on_failures(rows, "chip.py")


if __name__ == "__main__":
    main()
