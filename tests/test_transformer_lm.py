"""``examples/transformer_lm.py`` trains: both modes give the same falling losses, on one
process and on two under the launcher.

The two-process run starts first, in the background, and the one-process runs go on
in this process (8 emulated devices, from conftest) while it starts up.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from workers.launching import REPO

import substrax

EXAMPLE = REPO / "examples" / "transformer_lm.py"
STEPS = 4
ARGS = ["--steps", str(STEPS), "--log-every", "1"]


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("transformer_lm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def two_processes() -> Iterator[subprocess.Popen[str]]:
    """2 processes x 4 devices, implicit mode: started now, read by the last test."""
    cmd = [
        sys.executable,
        "-m",
        "substrax.launch",
        "-n",
        "2",
        "-d",
        "4",
        str(EXAMPLE),
        *ARGS,
        "--sample",
        "0",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def runs(two_processes: subprocess.Popen[str]) -> dict[str, tuple[list[float], str]]:
    """Each mode's per-step losses on one process, and what it printed."""
    example = load_example()
    out: dict[str, tuple[list[float], str]] = {}
    for mode in substrax.MODES:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            losses = example.main([*ARGS, "--mode", mode, "--sample", "5" if mode == "implicit" else "0"])
        out[mode] = losses, printed.getvalue()
    return out


@pytest.fixture(scope="module")
def losses(runs: dict[str, tuple[list[float], str]]) -> dict[str, list[float]]:
    return {mode: run[0] for mode, run in runs.items()}


@pytest.mark.parametrize("mode", substrax.MODES)
def test_the_loss_falls(losses: dict[str, list[float]], mode: str) -> None:
    got = losses[mode]
    assert len(got) == STEPS and all(np.isfinite(got))
    assert got[0] > np.log(128) - 0.5  # starts near a uniform guess over 128 codes
    assert got[-1] < got[0] - 0.5, got


def test_both_modes_give_the_same_losses(losses: dict[str, list[float]]) -> None:
    np.testing.assert_allclose(losses["explicit"], losses["implicit"], rtol=1e-5)


def test_it_prints_losses_throughput_and_a_sample(runs: dict[str, tuple[list[float], str]]) -> None:
    out = runs["implicit"][1]
    assert re.search(rf"^step +{STEPS}/{STEPS}  loss [\d.]+ +[\d,]+ tokens/s", out, flags=re.M), out
    assert re.search(r"^sample: def .", out, flags=re.M), out
    assert "\r" not in out  # not a terminal: one line per interval, no redrawn status line


def test_two_processes_give_the_same_losses(two_processes: subprocess.Popen[str], losses: dict) -> None:
    stdout, stderr = two_processes.communicate(timeout=180)
    assert two_processes.returncode == 0, stdout + stderr
    printed = [float(x) for x in re.findall(r"^\[p0\] step +\d+/\d+  loss ([\d.]+)", stdout, flags=re.M)]
    assert "[p1] step" not in stdout  # only process 0 reports
    np.testing.assert_allclose(printed, losses["implicit"], rtol=1e-5)


def test_a_run_resumes_from_its_checkpoint_with_the_same_losses(losses: dict, tmp_path: Any) -> None:
    """Two steps saved as FSDP in explicit mode; resumed replicated in implicit mode for steps 3-4."""
    example = load_example()
    common = ["--log-every", "1", "--sample", "0", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    with contextlib.redirect_stdout(io.StringIO()):
        example.main([*common, "--steps", "2", "--mode", "explicit", "--layout", "fsdp"])
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        resumed = example.main([*common, "--steps", str(STEPS), "--mode", "implicit"])
    assert "resumed from step 2" in printed.getvalue()
    np.testing.assert_allclose(resumed, losses["implicit"][2:], rtol=1e-5)


def test_bfloat16_compute_tracks_the_float32_run(losses: dict) -> None:
    """--precision bf16 (explicit FSDP: bfloat16 gathers, float32 state) within bfloat16's tolerance."""
    example = load_example()
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        got = example.main([*ARGS, "--sample", "0", "--mode", "explicit", "--layout", "fsdp", "--precision", "bf16"])
    assert "bfloat16 compute" in printed.getvalue()
    np.testing.assert_allclose(got, losses["explicit"], rtol=1e-2)  # bfloat16 eps 7.8e-3
