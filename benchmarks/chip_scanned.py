"""One accelerator chip: a scanned Llama-style decoder's step in both modes, side by side.

The model is ``tests/llama.py``'s (RoPE, grouped-query attention, RMSNorm, SwiGLU; blocks stacked by
``nnx.vmap`` and applied by ``nnx.scan``, under ``nnx.remat`` when asked), trained with AdamW through
``make_train_step(loss_fn, MODE).bind(model, optimizer)``. Both modes run interleaved after warm-up
(``benchmarks/_measure.py``); each row gives the median step time and the explicit/implicit ratio
measured in the same rounds.

    python benchmarks/chip_scanned.py --json benchmarks/results/chip_scanned_tpu_v5e.json   # on the chip
    python benchmarks/chip_scanned.py --quick --json benchmarks/results/chip_scanned_quick.json  # make bench
    python benchmarks/chip_scanned.py --smoke --json out.json                                # on a CPU
    python benchmarks/chip_scanned.py --predict --json benchmarks/results/chip_scanned_predicted.json

``--predict`` runs on a CPU (with libtpu): each configuration and mode compiled for a one-chip v5e
topology, its step predicted from the program beside the step the chip measured
(``benchmarks/_predicted.py``). ``--modes implicit,explicit,explicit-bf16-propagation`` adds the
explicit step compiled with the TPU compiler's bfloat16 propagation on; ``--programs-read`` compiles
each mode's step once more and sums its program up (length, digest, bfloat16 and float32 arrays),
to see that the modes' programs differ as their options say.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODES = ("implicit", "explicit")
# a spelling beyond the modes: the explicit step compiled with the TPU compiler's bfloat16 propagation
# on (substrax._shared.compiler turns it off for the explicit step; the planning guide, "Seconds")
PROPAGATED = "explicit-bf16-propagation"
# name: (d, depth, heads, kv_heads, hidden, vocab, seq, batch, precision, remat)
CONFIGS = {
    "245M-bf16": (1024, 16, 16, 4, 3456, 32000, 1024, 8, "bf16", True),
    "245M-f32": (1024, 16, 16, 4, 3456, 32000, 1024, 4, "f32", True),
    "31M-bf16-remat": (512, 8, 8, 2, 1408, 8192, 512, 32, "bf16", True),
    "31M-bf16": (512, 8, 8, 2, 1408, 8192, 512, 16, "bf16", False),
    "quick": (128, 2, 4, 2, 352, 512, 128, 8, "bf16", True),
    "smoke": (32, 2, 4, 2, 64, 128, 16, 4, "bf16", True),
}


def run(
    names: list[str], rounds: int, block_s: float, modes: tuple[str, ...] = MODES, programs: bool = False
) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import llama
    import numpy as np
    import optax
    from flax import nnx

    import substrax
    from substrax.mesh import create_device_mesh

    mesh = create_device_mesh({"data": 1}, devices=jax.devices()[:1])
    rows = []
    for name in names:
        d, depth, heads, kv, hidden, vocab, seq, rows_, precision, remat = CONFIGS[name]
        policy = substrax.MixedPrecision(jnp.bfloat16) if precision == "bf16" else None
        tokens = np.random.default_rng(0).integers(0, vocab, (rows_, seq + 1)).astype(np.int32)
        batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
        calls, first, program = {}, {}, {}
        for mode in modes:
            with jax.set_mesh(mesh):
                model = llama.Llama(vocab, d, depth, heads=heads, kv_heads=kv, hidden=hidden, remat=remat)
                optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
            params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
            with _propagated() if mode == PROPAGATED else contextlib.nullcontext():
                step = substrax.make_train_step(
                    llama.loss_fn, mode.split("-")[0], mesh=mesh, precision=policy
                )
                fast = step.bind(model, optimizer)
                calls[mode] = lambda fast=fast: fast(batch)
                first[mode] = M.first_call_s(calls[mode], warmup=2)  # compiled here
                if programs:  # compiled once more, with the options this mode's step took
                    program[mode] = _program(fast.lower(batch).compile().as_text())
        samples, block = M.interleaved(calls, rounds, block_s, "implicit")
        for mode in modes:
            ratio = M.paired_ratio(samples[mode], [samples["implicit"]])
            median = float(np.median(samples[mode]))
            rows.append({
                "config": name, "params": int(params), "d": d, "depth": depth, "seq": seq, "batch": rows_,
                "precision": precision, "remat": remat, "mode": mode, "median_step_us": median * 1e6,
                "first_call_s": first[mode], "explicit_over_implicit": ratio["paired_ratio"],
                "tokens_per_s": rows_ * seq / median, "block": block, "rounds": rounds,
            } | ({"program": program[mode]} if mode in program else {}))  # fmt: skip
    return rows


def _program(text: str) -> dict[str, Any]:
    """What tells two compiled programs apart: their length, digest, and arrays of each dtype."""
    import hashlib

    return {
        "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "bf16_arrays": text.count("bf16["), "f32_arrays": text.count("f32["),
    }  # fmt: skip


@contextlib.contextmanager
def _propagated():
    """The explicit step's TPU options with bfloat16 propagation on, while it compiles."""
    from substrax._shared import compiler

    was = compiler.TPU_COMPILER_OPTIONS["xla_jf_bf16_propagation"]
    compiler.TPU_COMPILER_OPTIONS["xla_jf_bf16_propagation"] = True
    try:
        yield
    finally:
        compiler.TPU_COMPILER_OPTIONS["xla_jf_bf16_propagation"] = was


def predicted(names: list[str], programs: str | None, modes: tuple[str, ...] = MODES) -> list[dict]:
    """Each configuration's step predicted from its program compiled for v5e:1x1, beside the chip's."""
    import _predicted as P  # benchmarks/_predicted.py
    import jax
    import jax.numpy as jnp
    import llama
    import optax
    from flax import nnx

    import substrax

    rows = []
    for name in names:
        d, depth, heads, kv, hidden, vocab, seq, rows_, precision, remat = CONFIGS[name]
        policy = substrax.MixedPrecision(jnp.bfloat16) if precision == "bf16" else None

        def build(d=d, depth=depth, heads=heads, kv=kv, hidden=hidden, vocab=vocab, seq=seq, rows_=rows_,
                  remat=remat, policy=policy) -> tuple:  # fmt: skip
            def make() -> tuple:
                model = llama.Llama(vocab, d, depth, heads=heads, kv_heads=kv, hidden=hidden, remat=remat)
                return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

            model, optimizer = nnx.eval_shape(make)
            batch = {k: jax.ShapeDtypeStruct((rows_, seq), jnp.int32) for k in ("tokens", "targets")}
            return llama.loss_fn, model, optimizer, batch, policy

        for mode in modes:
            rows.append(P.predict(name, mode, build, programs))
            print(rows[-1], flush=True)
    return P.joined(rows)


def table(rows: list[dict], machine: dict[str, Any]) -> str:
    lines = [
        f"{machine['device_kind']} ({machine['backend']}), jax {machine['jax']}, {machine['date']}",
        f"{'config':<16} {'params':>8} {'mode':<26} {'step ms':>9} {'expl/impl':>9} {'tokens/s':>11}",
    ]
    for r in rows:
        lines.append(
            f"{r['config']:<16} {r['params'] / 1e6:>7.1f}M {r['mode']:<26} {r['median_step_us'] / 1e3:>9.2f} "
            f"{r['explicit_over_implicit']:>9.3f} {r['tokens_per_s']:>11,.0f}"
            + (f"  {r['program']}" if "program" in r else "")
        )
    lines.append("expl/impl: the median over rounds of explicit's time / implicit's in that round (same run)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="245M-bf16,245M-f32,31M-bf16-remat,31M-bf16")
    parser.add_argument("--modes", default=",".join(MODES), help=f"implicit, explicit, {PROPAGATED}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block-s", type=float, default=0.5, help="seconds of steps per sample")
    parser.add_argument("--quick", action="store_true", help="a small size, 3 rounds (runs on a CPU too)")
    parser.add_argument("--smoke", action="store_true", help="tiny, one round: that it runs")
    parser.add_argument("--predict", action="store_true", help="on a CPU: predicted beside the chip's")
    parser.add_argument("--programs", default=None, help="with --predict: where to keep the programs")
    parser.add_argument(
        "--programs-read", action="store_true", help="each mode's compiled program summed up (a compile more)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.predict:
        import _predicted as P

        rows = predicted(args.configs.split(","), args.programs, tuple(args.modes.split(",")))
        text = P.table(rows)
        print(text)
        M.write(args.json, {"machine": M.machine(), "rows": rows}, text + "\n")
        return
    if args.smoke or args.quick:
        args.configs, args.rounds, args.block_s = ("smoke", 1, 0.0) if args.smoke else ("quick", 3, 0.2)

    import jax

    rows = run(
        args.configs.split(","), args.rounds, args.block_s, tuple(args.modes.split(",")), args.programs_read
    )
    machine = {**M.machine(), "device_kind": jax.devices()[0].device_kind}
    text = table(rows, machine)
    print(text)
    M.write(args.json, {"machine": machine, "rows": rows}, text + "\n")


if __name__ == "__main__":
    main()
