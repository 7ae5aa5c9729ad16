"""Mixed precision: explicit FSDP on the example transformer, float32 vs bfloat16 gathers.

Three steps of ``examples/transformer_lm.py``'s model (AdamW, global batch 32 x 32, 8
emulated CPU devices), each ``make_train_step(loss_fn, "explicit", precision=...)``
after ``shard_state(layout="fsdp")``, then ``.bind`` (donated):

- ``f32``: no policy;
- ``bf16/f32``: ``MixedPrecision(bfloat16, reduce_dtype=float32)``: bfloat16 gathers,
  float32 gradient reductions;
- ``bf16/bf16``: ``MixedPrecision(bfloat16, reduce_dtype=bfloat16)``.

Per step it reports the bytes each collective kind moves per device **as the program
asks for them** (read from the lowered StableHLO: the operands of every
``all_gather``, ``reduce_scatter`` and ``all_reduce`` the explicit step writes), the
same **as the CPU compiler runs them** (the census of the compiled program: XLA's CPU
backend widens bfloat16 collectives to float32, an accelerator does not), the median
step time (interleaved rounds, ratios to ``f32`` measured in the same run), and the
loss after the timed steps. bfloat16 matmuls are slow on this CPU, so the time is not
where bfloat16 pays here; the bytes are the point.

    python benchmarks/precision.py --quick
    python benchmarks/precision.py --json benchmarks/results/precision.json
    python benchmarks/precision.py --smoke --json out.json   # tests/test_benchmarks.py
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import _measure as M  # benchmarks/_measure.py: run as `python benchmarks/NAME.py`

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "transformer_lm.py"
_BITS = {"f32": 32, "bf16": 16, "f16": 16, "f64": 64, "i32": 32, "ui32": 32, "i1": 8, "i8": 8}


def lowered_bytes(text: str) -> dict[str, int]:
    """Bytes per collective kind in a lowered StableHLO program: what the step asks for.

    All-gather counts its result (the gathered array), reduce-scatter and all-reduce
    their operands, as ``substrax.census`` counts the compiled program.
    """
    out = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        found = re.search(r'"stablehlo\.(all_gather|reduce_scatter|all_reduce)"', line)
        if not found:
            continue
        op = found.group(1)
        end = i
        while not re.search(r":\s*\(.*\)\s*->", lines[end]) or (end == i and "({" in line):
            end += 1  # a reduction's body: the types follow its closing "})"
        operands, results = re.search(r":\s*\((.*)\)\s*->\s*(.*)$", lines[end]).groups()
        for shape, dtype in re.findall(
            r"tensor<((?:\d+x)*)(\w+)>", results if op == "all_gather" else operands
        ):
            n = 1
            for d in shape.strip("x").split("x") if shape else ():
                n *= int(d)
            out[op.replace("_", "-")] += n * _BITS[dtype] // 8
    return out


SMOKE_LM = {"seq": 8, "d": 16, "blocks": 1}  # --smoke: the example's model, small enough to compile fast


def run(
    rounds: int, block_s: float, steps: int, sizes: dict[str, int] | None = None, names: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(8)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import substrax
    from substrax.mesh import create_data_parallel_mesh
    from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

    spec = importlib.util.spec_from_file_location("transformer_lm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)

    mesh = create_data_parallel_mesh()
    sharding = create_data_parallel_sharding(mesh)
    sizes = sizes or {}
    data = lm.batches(lm.stdlib_text(), 32, sizes.get("seq", 32), 0)
    batch = place_batch_on_shards(next(data), sharding)
    policies = {
        "f32": None,
        "bf16/f32": substrax.MixedPrecision(jnp.bfloat16, reduce_dtype=jnp.float32),
        "bf16/bf16": substrax.MixedPrecision(jnp.bfloat16, reduce_dtype=jnp.bfloat16),
    }
    policies = {name: policy for name, policy in policies.items() if name in (names or policies)}
    rows, calls, fast = [], {}, {}
    for name, policy in policies.items():
        with jax.set_mesh(mesh):
            model, optimizer = lm.make_model(0, **sizes)
        substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp")
        step = substrax.make_train_step(lm.loss_fn, "explicit", mesh=mesh, precision=policy)
        lowered = step.lower(model, optimizer, batch)
        found = step.census(model, optimizer, batch)
        rows.append(
            {
                "name": name,
                "asked": lowered_bytes(lowered.as_text()),
                "compiled": {
                    k: found.report.bytes_per_step(k) for k in ("all-gather", "reduce-scatter", "all-reduce")
                },
                "census_matches": found.matches,
            }
        )
        fast[name] = step.bind(model, optimizer)
        calls[name] = (lambda f: lambda: f(batch))(fast[name])
    for name in policies:  # interleaved() warms the reference up twice: the others too, so every
        if name != "f32":  # spelling has taken the same steps when its loss is read
            for _ in range(2):
                jax.block_until_ready(calls[name]())
    samples, block = M.interleaved(calls, rounds, block_s, reference="f32")
    base = float(np.median(samples["f32"]))
    for row in rows:
        t = samples[row["name"]]
        row["time_us"] = M.summary_us(t)
        row["ratio_to_f32"] = float(np.median(t)) / base
        row["loss"] = float(fast[row["name"]](batch))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "explicit FSDP, example transformer, 8 emulated CPU devices; bytes per device per step",
        f"{'policy':<10} {'AG asked':>10} {'RS asked':>10} {'AR asked':>9} {'AG compiled':>12} "
        f"{'RS compiled':>12} {'median us':>10} {'x f32':>6} {'loss':>9}",
    ]
    for r in rows:
        a, c = r["asked"], r["compiled"]
        lines.append(
            f"{r['name']:<10} {a['all-gather']:>10,} {a['reduce-scatter']:>10,} {a['all-reduce']:>9,} "
            f"{c['all-gather']:>12,} {c['reduce-scatter']:>12,} {r['time_us']['median_us']:>10,.0f} "
            f"{r['ratio_to_f32']:>6.2f} {r['loss']:>9.5f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of short blocks")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the example's model at 1 block, d 16, seq 8; f32 and bf16/bf16; one round (make test)",
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None, help="write the results here (and a .txt beside it)")
    args = parser.parse_args(argv)
    rounds, block_s = (1, 0.0) if args.smoke else (3, 0.05) if args.quick else (args.rounds, 0.3)
    names = ("f32", "bf16/bf16") if args.smoke else ()
    rows = run(rounds, block_s, steps=3, sizes=SMOKE_LM if args.smoke else None, names=names)
    text = table(rows)
    print(text)
    asked = {r["name"]: r["asked"] for r in rows}
    # the bound this benchmark holds: bfloat16 gathers move half the float32 bytes
    for name in ("bf16/f32", "bf16/bf16"):
        if name in asked:
            assert asked[name]["all-gather"] * 2 == asked["f32"]["all-gather"], asked
    if "bf16/bf16" in asked:
        assert asked["bf16/bf16"]["reduce-scatter"] * 2 == asked["f32"]["reduce-scatter"], asked
    M.write(args.json, {"machine": M.machine(), "rows": rows}, text + "\n")


if __name__ == "__main__":
    sys.exit(main())
