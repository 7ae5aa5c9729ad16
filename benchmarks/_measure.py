"""Shared by the benchmarks: a spelling's first call and warm-up, interleaved timing, the
compiled program's memory and collectives, the state's bytes per device, the table's
cells, and the output files.

Nothing here imports jax at module level: each script sets its emulated device count
(``substrax.mesh.use_cpu_devices``) before jax starts a backend.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# What a spelling may raise and still be a row (``n/a``, its error), not the end of the run.
REPORTED = (ValueError, TypeError, NotImplementedError, RuntimeError)


def error_text(e: BaseException) -> str:
    """A failed row's ``error``: the exception's type and its first line, at most 300 characters."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]


def first_call_s(call: Callable[[], Any], warmup: int, start: float | None = None) -> float:
    """Seconds from ``start`` (default: now) to the end of ``call``'s first run, its compile
    with it; then ``warmup`` runs more, untimed."""
    import jax

    start = time.perf_counter() if start is None else start
    jax.block_until_ready(call())
    seconds = time.perf_counter() - start
    for _ in range(warmup):
        call()
    return seconds


def interleaved(
    calls: dict[str, Callable[[], Any]], rounds: int, block_s: float, reference: str
) -> tuple[dict[str, list[float]], int]:
    """Time every call once per round (A B C ... A B C ...), each sample a block of calls.

    The block is sized once from ``reference`` so a sample takes about ``block_s``; the
    same block is used for every call, so each sample is the mean of ``block`` steps.
    Returns seconds per step for each name, and the block.
    """
    import jax

    start = time.perf_counter()
    for _ in range(2):
        jax.block_until_ready(calls[reference]())
    per_call = (time.perf_counter() - start) / 2
    block = max(1, min(50, round(block_s / max(per_call, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(block):
                out = call()
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / block)
    return samples, block


def load_example() -> Any:
    """``examples/transformer_lm.py`` as a module: the benchmarks train the example's own model."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "transformer_lm.py"
    spec = importlib.util.spec_from_file_location("transformer_lm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary_us(seconds: Iterable[float]) -> dict[str, float]:
    """Median and 25th-75th percentile, in microseconds."""
    import numpy as np

    times = np.asarray(list(seconds)) * 1e6
    return {
        "median_us": float(np.median(times)),
        "p25_us": float(np.percentile(times, 25)),
        "p75_us": float(np.percentile(times, 75)),
    }


def paired_ratio(samples: Iterable[float], bounds: Iterable[Iterable[float]]) -> dict[str, float]:
    """Each round's time over the faster bound's in that round: median and 25th-75th percentile.

    A round times every spelling back to back, so a machine that slows down for a while slows
    a round's spellings together; a ratio within the round cancels that, where the ratio of
    two medians taken over all rounds does not.
    """
    import numpy as np

    rounds = list(zip(samples, *bounds))  # rounds every one of them ran
    ratios = np.asarray([spelling / min(bound) for spelling, *bound in rounds])
    return {
        "paired_ratio": float(np.median(ratios)),
        "paired_p25": float(np.percentile(ratios, 25)),
        "paired_p75": float(np.percentile(ratios, 75)),
    }


def memory(compiled: Any) -> dict[str, int | None]:
    """``compiled.memory_analysis()``: bytes of arguments, outputs, temporaries, and the
    outputs aliased onto donated arguments (per device: the SPMD program of one device), and
    the peak they make (argument + output + temp - alias)."""
    stats = compiled.memory_analysis()
    fields = {
        "argument_bytes": "argument_size_in_bytes",
        "output_bytes": "output_size_in_bytes",
        "temp_bytes": "temp_size_in_bytes",
        "alias_bytes": "alias_size_in_bytes",
    }
    out = {key: (None if stats is None else int(getattr(stats, attr))) for key, attr in fields.items()}
    out["peak_bytes"] = (
        None if stats is None
        else out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    )  # fmt: skip
    return out


def collectives(report: Any) -> dict[str, Any]:
    """A ``substrax.CensusReport`` in brief: bytes per step (loops multiplied out), and per
    kind the instructions and their executions per step."""
    executions: dict[str, int] = {}
    for row in report.rows:
        executions[row.kind] = executions.get(row.kind, 0) + (row.executions or 1)
    return {
        "comm_bytes": int(report.bytes_per_step()),
        "instructions": {kind: total.count for kind, total in report.totals().items()},
        "executions": executions,
        "in_loop": len(report.in_loop()),
    }


def kinds_brief(executions: dict[str, int] | None) -> str:
    """``{"all-gather": 3, "reduce-scatter": 3}`` as ``AG3 RS3``."""
    if executions is None:
        return "-"
    short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A"}
    return " ".join(f"{short.get(k, k)}{n}" for k, n in executions.items()) or "none"


def state_bytes(arrays: Iterable[Any]) -> int:
    """The most bytes any one device holds of these arrays, summed from their addressable shards."""
    per_device: dict[Any, int] = {}
    for array in arrays:
        for shard in array.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def machine() -> dict[str, Any]:
    import os
    import platform

    import flax
    import jax
    import optax

    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
    }


def write(json_path: str | None, payload: dict[str, Any], text: str) -> None:
    """Write the JSON to ``json_path`` and the printed text beside it, ``.txt`` for ``.json``
    (``--json benchmarks/results/layouts.json`` also writes ``benchmarks/results/layouts.txt``)."""
    if not json_path:
        return
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    path.with_suffix(".txt").write_text(text)
    print(f"wrote {path} and {path.with_suffix('.txt')}")


# A table's column: its header, its alignment and width (``"<22"``, ``">10"``), and a row's cell.
Column = tuple[str, str, Callable[[dict[str, Any]], Any]]


def table(
    title: str,
    columns: list[Column],
    rows: Iterable[dict[str, Any]],
    notes: list[str],
    below: Callable[[dict[str, Any]], list[str]] = lambda r: [],
) -> str:
    """``title``, the columns' headers, a line per row (the first column the spelling; a row without
    samples: ``n/a`` and its error) with the lines ``below(row)`` beneath it, then ``notes``."""
    out = [title, " ".join(f"{header:{spec}}" for header, spec, _ in columns)]
    for r in rows:
        if "median_us" not in r:
            out.append(f"{r['spelling']:{columns[0][1]}} n/a: {r.get('error', 'no samples')}")
            continue
        out.append(" ".join(f"{cell(r):{spec}}" for _, spec, cell in columns))
        out += below(r)
    return "\n".join(out + notes)


def timing_columns(spelling: int, spread: int) -> list[Column]:
    """The spelling, the median step time and its 25th-75th percentile, in microseconds."""
    return [
        ("spelling", f"<{spelling}", lambda r: r["spelling"]),
        ("median us", ">10", lambda r: f"{r['median_us']:.0f}"),
        ("p25-p75 us", f">{spread}", lambda r: f"{r['p25_us']:.0f}-{r['p75_us']:.0f}"),
    ]


def ratio_cell(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{r[key]:.2f}" if key in r else "-"


def bytes_cell(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: fmt_bytes(r[key])


def rule_cell(r: dict[str, Any]) -> str:
    """Whether the census matched the step's expected communication: yes, NO, or - (not checked)."""
    return {None: "-", True: "yes", False: "NO"}[r.get("census_matches")]


def compile_cell(r: dict[str, Any]) -> str:
    return f"{r['compile_s']:.2f}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


FAILED = ("error", "census_error")  # what a row records when its spelling, or its census, raised
LABELS = (
    "model",
    "width",
    "depth",
    "scan",
    "devices",
    "mesh",
    "spelling",
    "mode",
    "name",
    "op",
    "size_bytes",
)


def failures(rows: Iterable[dict[str, Any]]) -> list[str]:
    """One line per row that recorded an error: its labels, then the error."""
    lines = []
    for row in rows:
        for key in FAILED:
            if key in row:
                label = " ".join(f"{k}={row[k]}" for k in LABELS if k in row)
                lines.append(f"{label}: {key}: {row[key]}")
    return lines


def exit_on_failures(rows: Iterable[dict[str, Any]], script: str) -> None:
    """Exit with status 1, naming every row that failed, when any did (after the results are written).

    A failed row stays in the table and the JSON as ``n/a``; the status makes ``make bench``
    and ``tests/test_benchmarks.py`` fail on it rather than print it and pass.
    """
    lines = failures(rows)
    if lines:
        print(f"{script}: {len(lines)} row(s) failed:", *lines, sep="\n  ", file=sys.stderr)
        sys.exit(1)
