"""The chip's steps predicted from a CPU, beside the times measured on the chip.

Each configuration is compiled here for a one-chip TPU v5e topology (``topology_mesh("v5e:1x1")``,
libtpu), its step predicted from the program (``substrax.timeline.predict``: every operation at its
bound, 197 TFLOP/s bfloat16 and 819 GB/s), and set beside the median step the chip measured for the
same configuration (``benchmarks/results/chip_*.json``). ``--programs DIR`` keeps each compiled
program's HLO there and predicts from it again without compiling (a 342M step takes minutes to
compile on a 2-core machine).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def measured() -> dict[tuple[str, str], tuple[float, str]]:
    """Each configuration's measured step, ``(name, mode) -> (seconds, source)``, from the chip's
    result files ``chip_*tpu_v5e*.json`` (their ``bind:MODE`` rows, and ``chip_scanned``'s ``mode``
    rows); where two files measured the same configuration, the later run's: by the run's date, and
    on one date a file named with that date (``chip_tpu_v5e_2026-12-07.json``) after one without."""
    found: dict[tuple[str, str], tuple[float, str]] = {}
    for result, name in sorted(
        ((json.loads(path.read_text()), path.name) for path in RESULTS.glob("chip_*tpu_v5e*.json")),
        key=_run_order,
    ):
        for row in result["rows"]:
            if "error" in row or "median_step_us" not in row:
                continue
            if "config" in row:  # chip_scanned.py's
                key = (row["config"], row["mode"])
            elif row.get("spelling", "").startswith("bind:"):
                key = (f"{row['size']}-{row['precision']}", row["spelling"].split(":")[1])
            else:
                continue
            found[key] = (row["median_step_us"] * 1e-6, name)
    return found


def _run_order(run: tuple[dict[str, Any], str]) -> tuple[str, bool, str]:
    """A results file's place among the chip's runs: its date, whether its name says it, its name."""
    date = run[0]["machine"].get("date", "")
    return date, bool(date) and run[1].endswith(f"_{date}.json"), run[1]


def predict(
    name: str, mode: str, build: Callable[[], tuple[Any, Any, Any, Any, Any]], programs: str | None
) -> dict[str, Any]:
    """One configuration's predicted step: ``build()`` gives ``(loss_fn, model, optimizer, batch,
    policy)``, abstract; compiled for ``v5e:1x1`` unless ``programs`` holds its HLO already."""
    import jax
    from flax import nnx

    import substrax
    from substrax.mesh import topology_mesh
    from substrax.timeline import model_flops
    from substrax.timeline import predict as predict_program

    mesh = topology_mesh("v5e:1x1", {"data": 1})
    loss_fn, model, optimizer, batch, policy = build()
    substrax.shard_state(model, optimizer, mesh=mesh, layout="replicated")
    cached = Path(programs, f"{name}_{mode}.hlo") if programs else None
    compile_s = None
    if cached is not None and cached.exists():
        text = cached.read_text()
    else:
        started = time.perf_counter()
        step = substrax.make_train_step(loss_fn, mode.split("-")[0], mesh=mesh, precision=policy)
        # "explicit-bf16-propagation": the explicit step with the TPU compiler's bfloat16 propagation on
        options = {"xla_jf_bf16_propagation": True} if mode.endswith("-bf16-propagation") else None
        text = step.lower(model, optimizer, batch, donate=True).compile(compiler_options=options).as_text()
        compile_s = time.perf_counter() - started
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(text)
    timeline = predict_program(text, target="v5e")
    flops = model_flops(loss_fn, model, batch, mesh)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {
        "config": name, "mode": mode, "params": int(params), "predicted_step_s": timeline.step_seconds,
        "compute_s": timeline.compute_seconds, "flops": timeline.flops, "model_flops": flops,
        "predicted_mfu": None if flops is None else flops / (197e12 * timeline.step_seconds),
        "compile_s": compile_s,
    }  # fmt: skip


def joined(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with the measured step beside each prediction, and predicted / measured."""
    chip = measured()
    out = []
    for row in rows:
        seconds, source = chip.get((row["config"], row["mode"]), (None, ""))
        ratio = None if seconds is None else row["predicted_step_s"] / seconds
        out.append(
            {**row, "measured_step_s": seconds, "measured_in": source, "predicted_over_measured": ratio}
        )
    return out


def table(rows: Iterable[dict[str, Any]]) -> str:
    lines = [
        "predicted: compiled for v5e:1x1 on this CPU, substrax.timeline.predict; measured: the chip's median",
        f"{'config':<16} {'params':>8} {'mode':<26} {'predicted ms':>12} {'measured ms':>11} "
        f"{'pred/meas':>9} {'MFU (pred.)':>11}  measured in",
    ]
    for r in rows:
        meas = "-" if r["measured_step_s"] is None else f"{r['measured_step_s'] * 1e3:.2f}"
        ratio = "-" if r["predicted_over_measured"] is None else f"{r['predicted_over_measured']:.3f}"
        mfu = "-" if r["predicted_mfu"] is None else f"{r['predicted_mfu']:.3f}"
        pred = f"{r['predicted_step_s'] * 1e3:.2f}"
        lines.append(
            f"{r['config']:<16} {r['params'] / 1e6:>7.1f}M {r['mode']:<26} {pred:>12} {meas:>11} {ratio:>9} "
            f"{mfu:>11}  {r['measured_in']}"
        )
    return "\n".join(lines)
