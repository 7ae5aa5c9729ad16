"""Every benchmark in ``benchmarks/`` runs: each script with ``--smoke``, every row without an error.

``--smoke`` is each script at tiny sizes, one round of one-step blocks: it checks that the
script runs, not how fast. Each runs as ``make bench`` runs it, a process of its own with
its own emulated devices, writing its JSON to a temporary path, which is then read back:
a row that failed (its spelling or its census raised) fails the test by its label and
error, as does a nonzero exit status (every script exits 1 when a row failed). The
scripts run a few at a time (a compile takes one core), XLA at its lowest optimization
level, sharing the suite's compilation cache (``tests/conftest.py``; ``make test`` keeps
it between runs), so a program compiled twice (a step, then its census) compiles once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import conftest
import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
# the key each script's rows time themselves under
TIMED = {  # in the order they are started: the longest first
    "train_step": "median_step_us",
    "precision": "time_us",
    "tensor_parallel": "median_us",
    "accumulation": "median_us",
    "pipeline": "median_us",
    "layouts": "median_us",
    "collectives": "median_us",
    "memory": "peak_bytes",  # compiled, not run: its rows measure memory
    "units": "median_us",
    "hsdp": "bytes_per_step",  # compiled, not run: its rows measure bytes
    "plan": "ratio",  # compiled, not run: its rows measure the estimate against the compiled peak
    "chip": "median_step_us",  # on the first device jax finds (here one CPU device)
    "chip_scanned": "median_step_us",  # likewise
    "tinyllama_plan": "peak_bytes",  # planned, not run (--smoke: on 8 emulated CPU devices)
}
# conftest's LLVM level (set here even under SUBSTRAX_TEST_XLA_OPT=default), and fewer passes
FAST_COMPILE = f"{conftest.FAST_COMPILE} --xla_llvm_disable_expensive_passes=true"


def _measure():
    """``benchmarks/_measure.py``, imported from its file (the scripts import it as ``_measure``)."""
    spec = importlib.util.spec_from_file_location("_measure", BENCHMARKS / "_measure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_is_smoke_tested_and_in_make_bench() -> None:
    scripts = {p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_")}
    assert scripts == set(TIMED), f"add the new benchmark to TIMED here: {sorted(scripts ^ set(TIMED))}"
    makefile = (REPO / "Makefile").read_text()
    bench = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"benchmarks/(\w+)\.py", bench)) == scripts, bench


def test_a_failed_row_makes_the_script_exit_1_naming_it(capsys) -> None:
    rows = [
        {"model": "transformer", "devices": 8, "mode": "bound", "median_step_us": 1.0},
        {"model": "transformer", "devices": 8, "mode": "make_train_step:implicit", "error": "ValueError: no"},
        {"spelling": "fsdp:explicit", "census_error": "KeyError: 'x'"},
    ]
    with pytest.raises(SystemExit) as exit_:
        _measure().exit_on_failures(rows, "train_step.py")
    assert exit_.value.code == 1
    said = capsys.readouterr().err
    assert "train_step.py: 2 row(s) failed" in said
    assert "model=transformer devices=8 mode=make_train_step:implicit: error: ValueError: no" in said
    assert "spelling=fsdp:explicit: census_error: KeyError: 'x'" in said
    _measure().exit_on_failures(rows[:1], "train_step.py")  # nothing failed: no exit


def _smoke(script: str, out: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip(),
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The selected scripts' smoke runs, started together, a few at a time (each compiles on one core)."""
    mine = [getattr(i, "callspec", None) for i in request.session.items if i.module is request.module]
    selected = [c.params["script"] for c in mine if c is not None and "script" in c.params]
    out, cache = tmp_path_factory.mktemp("smoke"), Path(os.environ["SUBSTRAX_TEST_CACHE"])  # conftest's
    with ThreadPoolExecutor(max_workers=max(1, min(3, os.cpu_count() or 1))) as pool:
        yield {s: (pool.submit(_smoke, s, out / f"{s}.json", cache), out / f"{s}.json") for s in selected}


@pytest.mark.parametrize("script", list(TIMED))
def test_benchmark_smoke_run_has_every_row(script: str, smoke_runs: dict) -> None:
    future, out = smoke_runs[script]
    run = future.result()
    assert run.returncode == 0, f"{script}.py --smoke exited {run.returncode}:\n{run.stderr[-4000:]}"
    payload = json.loads(out.read_text())
    rows = payload if isinstance(payload, list) else payload["rows"]
    assert rows, f"{script}.py wrote no rows"
    assert not _measure().failures(rows), _measure().failures(rows)
    untimed = [r for r in rows if TIMED[script] not in r]
    assert not untimed, f"{script}.py: rows without {TIMED[script]!r}: {untimed}"


def test_the_paired_ratio_divides_each_round_by_its_faster_bound() -> None:
    # rounds 2 and 3 ran on a machine twice as slow: the paired ratio is 1.1 in every round
    step = [1.1, 2.2, 2.2, 1.1, 1.1]
    jit_bound, shard_map_bound = [1.0, 2.0, 2.4, 1.0, 1.2], [1.2, 2.4, 2.0, 1.3, 1.0]
    got = _measure().paired_ratio(step, [jit_bound, shard_map_bound])
    assert got["paired_ratio"] == pytest.approx(1.1)
    assert got["paired_p25"] == pytest.approx(1.1) and got["paired_p75"] == pytest.approx(1.1)
    # a round a bound did not run is left out, not divided by another round's time
    assert _measure().paired_ratio([2.0, 9.0], [[1.0], [1.0, 1.0]])["paired_ratio"] == pytest.approx(2.0)
