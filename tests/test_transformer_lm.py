"""``examples/transformer_lm.py`` trains: both modes give the same falling losses, on one
process and on two under the launcher, on the ``data=8`` mesh and on ``data=4,model=2``,
and its stacked blocks pipelined over ``stage=4,data=2`` (both schedules); with dropout in the
stacked blocks, both modes train.

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
from substrax.mesh import create_device_mesh
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

EXAMPLE = REPO / "examples" / "transformer_lm.py"
STEPS = 4
ARGS = ["--steps", str(STEPS), "--log-every", "1"]
MESH_2D = ["--mesh", "data=4,model=2"]
# A 2-D mesh changes only the order of the sums (the model axis's partial products, the
# data axis's 4 shards of rows instead of 8). Measured over 60 steps in both modes and all
# three layouts, data=4,model=2's losses were within 3.6e-7 relative (3 float32 ulps) of
# data=8's; data=8's own modes and layouts differ among themselves by up to 1.6e-7.
# 1e-5 leaves 30x room and is this file's tolerance between modes and process counts;
# one AdamW step here moves the loss by 1e-2 or more.
RTOL_2D = 1e-5


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
            losses = example.main([*ARGS, "--mode", mode, "--sample", "0"])
        out[mode] = losses, printed.getvalue()
    # The 2-D mesh, implicit and ZeRO-1, and a sample from it; explicit FSDP on it is the
    # checkpoint test's first run.
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        losses = example.main([*ARGS, *MESH_2D, "--mode", "implicit", "--layout", "zero1", "--sample", "5"])
    out["2d"] = losses, printed.getvalue()
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
    step_line = rf"^step +{STEPS}/{STEPS}  loss [\d.]+ +[\d,]+ tokens/s"
    for out in (runs["implicit"][1], runs["2d"][1]):
        assert re.search(step_line, out, flags=re.MULTILINE), out
        assert "\r" not in out  # not a terminal: one line per interval, no redrawn status line
    assert re.search(r"^sample: def .", runs["2d"][1], flags=re.MULTILINE), runs["2d"][1]  # on data=4,model=2


def test_two_processes_give_the_same_losses(two_processes: subprocess.Popen[str], losses: dict) -> None:
    stdout, stderr = two_processes.communicate(timeout=180)
    assert two_processes.returncode == 0, stdout + stderr
    printed = [
        float(x) for x in re.findall(r"^\[p0\] step +\d+/\d+  loss ([\d.]+)", stdout, flags=re.MULTILINE)
    ]
    assert "[p1] step" not in stdout  # only process 0 reports
    np.testing.assert_allclose(printed, losses["implicit"], rtol=1e-5)


def test_a_run_resumes_from_its_checkpoint_with_the_same_losses(losses: dict, tmp_path: Any) -> None:
    """Two steps saved as FSDP in explicit mode on data=4,model=2; resumed replicated in
    implicit mode on data=8 for steps 3-4. The first two are explicit FSDP on the 2-D mesh."""
    example = load_example()
    common = ["--log-every", "1", "--sample", "0", "--checkpoint-every", "2"]
    common += ["--checkpoint-dir", str(tmp_path)]
    with contextlib.redirect_stdout(io.StringIO()):
        first = example.main([*common, *MESH_2D, "--steps", "2", "--mode", "explicit", "--layout", "fsdp"])
    np.testing.assert_allclose(first, losses["explicit"][:2], rtol=RTOL_2D)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        resumed = example.main([*common, "--steps", str(STEPS), "--mode", "implicit", "--mesh", "data=8"])
    assert "resumed from step 2" in printed.getvalue()
    np.testing.assert_allclose(resumed, losses["implicit"][2:], rtol=1e-5)


def test_pipelined_blocks_give_the_data_parallel_losses_and_resume_without_stage(tmp_path: Any) -> None:
    """4 stacked blocks on data=8 (no pipeline), against the same blocks pipelined over stage=4,data=2
    in 8 microbatches: explicit 1F1B for steps 1-2, saved, resumed on data=8 (no stage axis) for
    steps 3-4; implicit GPipe, explicit ZB-H1 and explicit interleaved 1F1B (8 blocks, two chunks a
    stage, against their own data=8 run) for steps 1-2. (data=8 equals one device to round-off: the
    tests above.)"""
    example = load_example()
    stacked = ["--log-every", "1", "--sample", "0", "--blocks", "4", "--scan"]
    pipe = ["--mesh", "stage=4,data=2", "--microbatches", "8", "--steps", "2"]
    saved = ["--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path)]
    with contextlib.redirect_stdout(io.StringIO()):
        want = example.main([*stacked, "--steps", str(STEPS), "--mesh", "data=8"])
        first = example.main([*stacked, *pipe, *saved, "--mode", "explicit", "--schedule", "1f1b"])
        gpipe = example.main([*stacked, *pipe, "--mode", "implicit", "--schedule", "gpipe"])
        zb = example.main([*stacked, *pipe, "--mode", "explicit", "--schedule", "zb-h1"])
        deep = [*stacked[:-2], "8", "--scan"]  # 8 blocks: 4 stages x 2 chunks of one
        want8 = example.main([*deep, "--steps", "2", "--mesh", "data=8"])
        chunked = ["--schedule", "interleaved-1f1b", "--virtual-stages", "2"]
        interleaved = example.main([*deep, *pipe, "--mode", "explicit", *chunked])
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        resumed = example.main([*stacked, *saved, "--steps", str(STEPS), "--mesh", "data=8"])
    assert "resumed from step 2" in printed.getvalue()
    np.testing.assert_allclose(first, want[:2], rtol=RTOL_2D)
    np.testing.assert_allclose(gpipe, want[:2], rtol=RTOL_2D)
    np.testing.assert_allclose(zb, want[:2], rtol=RTOL_2D)
    np.testing.assert_allclose(interleaved, want8, rtol=RTOL_2D)
    np.testing.assert_allclose(resumed, want[2:], rtol=RTOL_2D)


DROPOUT = ["--scan", "--dropout", "0.1", "--steps", "2", "--log-every", "1", "--sample", "0"]


def test_dropout_in_the_scanned_blocks_trains_in_both_modes() -> None:
    """``--scan --dropout 0.1`` (#60 item 3): each stacked block draws from its own stream
    (``nnx.split_rngs``), into whose key the explicit step folds each data device's index. Both modes
    train; their losses differ (the implicit step draws one mask for the global batch, the explicit
    step each device's own: the modes guide)."""
    example = load_example()
    got = {}
    for mode in substrax.MODES:
        with contextlib.redirect_stdout(io.StringIO()):
            got[mode] = example.main([*DROPOUT, "--mode", mode])
    for mode, losses in got.items():
        assert len(losses) == 2 and all(np.isfinite(losses)), (mode, losses)
        assert losses[1] < losses[0] - 0.5, (mode, losses)
    assert not np.allclose(got["explicit"], got["implicit"], rtol=1e-5), got


def test_a_2d_mesh_gives_the_data_parallel_losses(runs: dict[str, tuple[list[float], str]]) -> None:
    """data=4,model=2 (implicit, ZeRO-1) against data=8 (replicated); it prints the splits."""
    got, out = runs["2d"]
    np.testing.assert_allclose(got, runs["implicit"][0], rtol=RTOL_2D)
    assert "8 cpu devices as data=4 x model=2" in out, out
    up = r"\['blocks'\]\[0\]\['up'\]\['kernel'\] +\(64, 256\) +float32 +"
    param, moment = (
        rf"^model{up}dim 1 over 'model'$",
        rf"^optimizer\[.*\]\['mu'\]{up}dim 0 over 'data'; dim 1 over 'model'$",
    )
    assert re.search(param, out, flags=re.MULTILINE), out  # ZeRO-1: the parameter whole over data
    assert re.search(moment, out, flags=re.MULTILINE), out  # its optimizer state split over both


def test_the_batch_is_split_over_data_and_whole_on_each_model_device() -> None:
    """As main places it on data=4,model=2: 8 rows per data index, the same on both its model devices."""
    example = load_example()
    mesh = create_device_mesh(example.mesh_shape(example.parse_mesh("data=4,model=2"), 8, 32))
    rows = np.arange(32)[:, None] * np.ones((1, 3), np.int32)
    placed = place_batch_on_shards({"tokens": rows}, create_data_parallel_sharding(mesh))["tokens"]
    coords = {d.id: (i, j) for (i, j), d in np.ndenumerate(mesh.devices)}
    for shard in placed.addressable_shards:
        i, _ = coords[shard.device.id]
        np.testing.assert_array_equal(shard.data[:, 0], np.arange(8 * i, 8 * i + 8))


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ("data=4,model=2,pipe=1", "unknown mesh axis 'pipe'"),
        ("data=4,model", "'model' in 'data=4,model' is not axis=size"),
        ("data=4,model=0", "is not axis=size with a positive int size"),
        ("data=4,data=2", "mesh axis 'data' is named twice"),
        ("data=2,model=2", "2 x 2 = 4 devices, but there are 8"),
        ("data=1,model=8", "model=8 does not divide the model's 4 attention heads"),
        ("model=3", "model=3: 3 does not divide the 8 devices"),
        ("stage=4,data=2", "a stage axis in --mesh pipelines the blocks: pass it with --scan and --schedule"),
    ],
)
def test_a_bad_mesh_is_a_clear_usage_error(
    mesh: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example()
    with pytest.raises(SystemExit) as exit_info:
        example.main([*ARGS, "--mesh", mesh])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err, err


def test_bfloat16_compute_tracks_the_float32_run(losses: dict) -> None:
    """--precision bf16 (explicit FSDP: bfloat16 gathers, float32 state) within bfloat16's tolerance."""
    example = load_example()
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        got = example.main(
            [*ARGS, "--sample", "0", "--mode", "explicit", "--layout", "fsdp", "--precision", "bf16"]
        )
    assert "bfloat16 compute" in printed.getvalue()
    np.testing.assert_allclose(got, losses["explicit"], rtol=1e-2)  # bfloat16 eps 7.8e-3
