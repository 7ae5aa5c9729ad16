"""Faults a checkpointed run survives: a state gone NaN, a damaged step, two runs on one
directory, a kill while an old step is deleted, and a SIGTERM.

Each test fails on a manager that saves whatever it is given, restores whatever orbax
reads, shares its directory, deletes old steps in place and dies on SIGTERM. The model is
the small MLP, unplaced (one device); the faults that need a process killed run in
``workers/ckpt_fault_worker.py``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import MLP, mse, regression_batches
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from workers.launching import REPO, WORKERS

import substrax
from substrax import checkpoint
from substrax.checkpoint import (
    CheckpointManager,
    DamagedCheckpointError,
    DirectoryInUseError,
    NonFiniteStateError,
)
from substrax.checkpoint._checksums import _inspect_on_device, _inspect_on_host

WIDTH = 256  # kernels over orbax's 1 KiB inline limit: the largest data file holds their values


def build(seed: int = 0) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(width=WIDTH, seed=seed)
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def values(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state((model, optimizer)))
    return {"/".join(map(str, path)): np.asarray(variable.get_raw_value()) for path, variable in flat}


def assert_values(model: nnx.Module, optimizer: nnx.Optimizer, want: dict[str, np.ndarray]) -> None:
    got = values(model, optimizer)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def add(model: nnx.Module, optimizer: nnx.Optimizer, amount: float) -> None:
    """Add ``amount`` to every floating array of the state (NaN: as a NaN batch leaves it)."""
    for _, variable in nnx.to_flat_state(nnx.state((model, optimizer))):
        value = variable.get_raw_value()
        if jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
            variable.set_raw_value(value + amount)


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKERS / "ckpt_fault_worker.py"), *args],
        cwd=REPO,
        # a CPU process: with the gpu extra installed, jax's CUDA plugin would print its failed
        # driver check (a traceback) on stderr, which test 8 reads line by line
        env=os.environ | {"JAX_PLATFORMS": "cpu"},
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )


# --- 1. a state that is not finite ------------------------------------------------------


def test_a_state_that_is_not_finite_is_refused_and_the_finite_steps_kept(tmp_path: Path) -> None:
    model, optimizer = build()
    with CheckpointManager(tmp_path, max_to_keep=2) as ckpt:
        assert ckpt.save(1, model, optimizer)
        add(model, optimizer, 1.0)  # another state: one equal to the last saved is not saved again
        assert ckpt.save(2, model, optimizer)
        finite = values(model, optimizer)
        add(model, optimizer, float("nan"))  # every parameter NaN, as after one NaN batch
        for step in (3, 4, 5):  # each would have rotated a finite step out
            with pytest.raises(
                NonFiniteStateError,
                match=rf"^step {step} not saved in {tmp_path}: its state is not finite \(model\['hidden'\]"
                r"\['bias'\], model\['hidden'\]\['kernel'\], model\['out'\]\['bias'\] and 9 more hold a "
                r"NaN or an infinity\); the newest step kept there is 2\.$",
            ):
                ckpt.save(step, model, optimizer, force=step == 5)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
        model, optimizer = build(seed=1)
        nu = dict(nnx.to_flat_state(nnx.state(optimizer)))["opt_state", 0, "nu", "out", "bias"]
        nu.set_raw_value(nu.get_raw_value().at[0].set(np.inf))  # one infinity, in one array
        with pytest.raises(
            NonFiniteStateError, match=r"\(optimizer\['opt_state'\]\[0\]\['nu'\]\['out'\]\['bias'\] hold"
        ):
            ckpt.save(6, model, optimizer)
        assert ckpt.restore(model, optimizer) == 2
        assert_values(model, optimizer, finite)


# --- 2. a damaged step --------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """Steps 1 and 2 of the model (step 2: step 1's arrays plus 1), and step 1's values."""
    directory = tmp_path_factory.mktemp("two-steps")
    model, optimizer = build()
    first = values(model, optimizer)
    checkpoint.save(directory, 1, model, optimizer)
    add(model, optimizer, 1.0)
    checkpoint.save(directory, 2, model, optimizer)
    return directory, first


def largest_data_file(step: Path) -> Path:
    """The largest of the files orbax writes the arrays' values into (``.../d/<name>``)."""
    files = [p for p in step.rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: (p.stat().st_size, p.name))


def damage(step: Path, how: str) -> None:
    if how == "_METADATA deleted":
        (step / "default" / "_METADATA").unlink()
        return
    path = largest_data_file(step)
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
        return
    flips = {"1 byte flipped": 1, "64 bytes flipped": 64}[how]
    middle = len(data) // 2 - flips // 2
    for i in range(middle, middle + flips):
        data[i] ^= 0xFF
    path.write_bytes(data)


DAMAGE = {
    "1 byte flipped": (
        r"(model|optimizer)\[.*\] (does not match the checksum recorded when it was saved|could not be read)"
    ),
    "64 bytes flipped": (
        r"(model|optimizer)\[.*\] (does not match the checksum recorded when it was saved|could not be read)"
    ),
    "truncated": r"(model|optimizer)\[.*\] could not be read \(.*\)",
    "_METADATA deleted": r"its index of arrays \(default/_METADATA\) is missing",
}


@pytest.fixture
def damaged(two_steps: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(two_steps[0], directory)
    return directory


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_step_is_refused_in_one_line_or_skipped_for_the_last_whole_one(
    two_steps: tuple[Path, dict[str, np.ndarray]], damaged: Path, how: str
) -> None:
    damage(damaged / "2", how)
    model, optimizer = build(seed=1)
    untouched = values(model, optimizer)
    with pytest.raises(
        DamagedCheckpointError, match=rf"^step 2 in {damaged} is damaged: {DAMAGE[how]}\.$"
    ) as error:
        checkpoint.restore(damaged, model, optimizer, step=2)
    assert error.value.step == 2 and "\n" not in str(error.value)
    assert_values(model, optimizer, untouched)  # filled only from a step that checks out
    with pytest.warns(
        UserWarning, match=rf"restored step 1, the newest whole step: step 2 in {damaged} is damaged"
    ):
        assert checkpoint.restore(damaged, model, optimizer) == 1
    assert_values(model, optimizer, two_steps[1])
    assert sorted(os.listdir(damaged)) == ["1", "2"]  # a restore that only reads moves nothing


def test_a_run_resumes_from_the_last_whole_step_and_saves_past_the_damaged_one(
    two_steps: tuple[Path, dict[str, np.ndarray]], damaged: Path
) -> None:
    damage(damaged / "2", "64 bytes flipped")
    model, optimizer = build(seed=1)
    with CheckpointManager(damaged, max_to_keep=2) as ckpt:
        with pytest.warns(UserWarning, match=r"restored step 1, .* moved to .*\.substrax-damaged\.$"):
            assert ckpt.restore(model, optimizer) == 1
        assert ckpt.all_steps() == [1]
        assert_values(model, optimizer, two_steps[1])
        with pytest.warns(UserWarning, match=r"^step 2 not saved in .*: its state is step 1's, unchanged"):
            assert not ckpt.save(2, model, optimizer)  # the state restored is step 1's
        add(model, optimizer, 1.0)  # as step 2 was
        step2 = values(model, optimizer)
        assert ckpt.save(2, model, optimizer)  # the damaged step's number is free again
    assert [name.split("-")[0] for name in os.listdir(damaged / ".substrax-damaged")] == ["2"]
    assert checkpoint.restore(damaged, model, optimizer) == 2
    assert_values(model, optimizer, step2)


def test_when_every_step_is_damaged_the_latest_is_named(damaged: Path) -> None:
    damage(damaged / "1", "truncated")
    damage(damaged / "2", "_METADATA deleted")
    with pytest.raises(
        DamagedCheckpointError,
        match=r"^step 2 in .* is damaged: its index of arrays .* The older steps \[1\] are damaged too\.$",
    ):
        checkpoint.restore(damaged, *build())


def test_a_step_saved_without_checksums_is_restored_with_a_warning(tmp_path: Path) -> None:
    """Steps written before checksums were recorded (plain orbax, as earlier versions wrote them)."""
    model, optimizer = build()
    want = values(model, optimizer)
    tree: dict = {}
    for root, obj in (("model", model), ("optimizer", optimizer)):
        for path, variable in nnx.to_flat_state(nnx.state(obj)):
            node = tree.setdefault(root, {})
            for part in map(str, path[:-1]):
                node = node.setdefault(part, {})
            node[str(path[-1])] = variable.get_raw_value()
    with ocp.CheckpointManager(tmp_path, item_handlers=ocp.StandardCheckpointHandler()) as old:
        old.save(7, args=ocp.args.StandardSave(tree))
    model, optimizer = build(seed=1)
    with pytest.warns(UserWarning, match=r"step 7 in .* has no checksums .*: restored without checking them"):
        assert checkpoint.restore(tmp_path, model, optimizer) == 7
    assert_values(model, optimizer, want)


# --- 3. one run per directory -----------------------------------------------------------


def claim(directory: Path, **fields: object) -> None:
    held = {"host": socket.gethostname(), "since": "2000-01-01T00:00:00+00:00", "run": "test", "command": "x"}
    (directory / "substrax.lock").write_text(json.dumps(held | fields))


def test_a_directory_belongs_to_one_manager_at_a_time(tmp_path: Path) -> None:
    model, optimizer = build()
    with CheckpointManager(tmp_path) as first:
        held = json.loads((tmp_path / "substrax.lock").read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        assert {"run", "since", "command", "token"} <= held.keys()
        with pytest.raises(
            DirectoryInUseError,
            match=(
                rf"^{tmp_path} is already open in this process \(since {re.escape(held['since'])}\): "
                r".* close the other first\.$"
            ),
        ):
            CheckpointManager(tmp_path)
        with pytest.raises(DirectoryInUseError):
            checkpoint.save(tmp_path, 5, model, optimizer)
        assert first.save(1, model, optimizer)
        first.wait()
        assert checkpoint.restore(tmp_path, model, optimizer) == 1  # reading takes no claim
        with CheckpointManager(tmp_path, read_only=True) as reader:
            assert reader.all_steps() == [1]
            with pytest.raises(ValueError, match=r"this manager of .* is read-only: it does not save\."):
                reader.save(2, model, optimizer)
    assert not (tmp_path / "substrax.lock").exists()
    with CheckpointManager(tmp_path) as second:  # released by the first's close
        assert second.all_steps() == [1]


def test_another_live_run_is_named_and_keeps_its_directory(tmp_path: Path) -> None:
    claim(tmp_path, pid=os.getppid())  # a process that lives, on this host
    with pytest.raises(
        DirectoryInUseError,
        match=rf"^{tmp_path} is in use by another run: pid {os.getppid()} on {socket.gethostname()} since "
        r"2000-01-01T00:00:00\+00:00 \(test: x\)\. .* delete .*substrax\.lock\.$",
    ):
        CheckpointManager(tmp_path)
    claim(tmp_path, pid=1, host="elsewhere")  # another host's: whether it lives cannot be told
    with pytest.raises(DirectoryInUseError, match=r"pid 1 on elsewhere since"):
        CheckpointManager(tmp_path)
    assert json.loads((tmp_path / "substrax.lock").read_text())["host"] == "elsewhere"


def test_the_claim_of_a_process_that_is_gone_is_taken_over(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    claim(tmp_path, pid=gone.pid)
    with pytest.warns(UserWarning, match=rf"took over {tmp_path} from a run that is gone: pid {gone.pid} "):
        manager = CheckpointManager(tmp_path)
    assert json.loads((tmp_path / "substrax.lock").read_text())["pid"] == os.getpid()
    manager.close()
    claim(tmp_path, pid=os.getppid(), started=-1)  # a pid now used by a later process
    with pytest.warns(UserWarning, match=r"took over"):
        CheckpointManager(tmp_path).close()
    assert not (tmp_path / "substrax.lock").exists()


# --- 4. a kill while an old step is deleted -------------------------------------------------


def test_a_kill_while_an_old_step_is_deleted_leaves_only_whole_steps(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    done = run_worker("rotate", str(directory))
    assert done.returncode == -signal.SIGKILL and "KILLED" in done.stdout, done.stdout + done.stderr
    model, optimizer = build(seed=1)
    with pytest.warns(UserWarning, match=r"took over"):  # the killed run's claim
        ckpt = CheckpointManager(directory, max_to_keep=2)
    with ckpt:
        assert ckpt.all_steps() == [2, 3]  # step 1 is gone whole, or listed whole
        assert ckpt.restore(model, optimizer, step=2) == 2
        assert ckpt.restore(model, optimizer) == 3
    assert sorted(os.listdir(directory)) == ["2", "3"]  # the trash the killed run left is emptied


# --- 5. SIGTERM ---------------------------------------------------------------------------------


def test_a_sigterm_saves_the_step_at_hand_and_exits_143(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    done = run_worker("sigterm", str(directory))
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert "STEP 4" in done.stdout and "STEP 5" not in done.stdout
    assert f"SIGTERM: step 4 saved in {directory}; exiting (143)" in done.stderr
    assert sorted(os.listdir(directory)) == ["1", "4"]  # saved every 100 steps, and at the SIGTERM
    model, optimizer = build(seed=1)
    assert checkpoint.restore(directory, model, optimizer) == 4
    want, _ = build()
    np.testing.assert_array_equal(
        np.asarray(model.out.bias.get_value()), np.asarray(want.out.bias.get_value()) + 3
    )


# --- 6. a run of skipped steps ------------------------------------------------------------------


def test_a_run_of_skipped_steps_does_not_rotate_out_the_distinct_steps_before_it(
    tmp_path: Path, mesh8: jax.sharding.Mesh
) -> None:
    model, optimizer = build()
    train_step = substrax.make_train_step(mse, "implicit", mesh=mesh8, max_skips_in_a_row=None)
    good = regression_batches(4, 32)
    nan = {"x": np.full_like(good[0]["x"], np.nan), "y": good[0]["y"]}
    with CheckpointManager(tmp_path, max_to_keep=3) as ckpt, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            train_step(model, optimizer, good[step - 1])
            assert ckpt.save(step, model, optimizer)
        third = values(model, optimizer)
        for step in range(4, 14):  # 10 NaN batches in a row, each skipped by the step's guard
            assert np.isnan(train_step(model, optimizer, nan))
            assert not ckpt.save(step, model, optimizer)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2, 3]  # not [11, 12, 13]: three copies of step 3's state
        mine = [str(w.message) for w in said if str(w.message).startswith("step 4 not saved")]
        assert mine == [
            f"step 4 not saved in {tmp_path}: its state is step 3's, unchanged since (the train step "
            "skips non-finite updates, leaving the state as it was); step 3 is kept and no step is "
            "rotated out, and later saves of this same state are skipped without a word."
        ]
        assert [w.filename for w in said if str(w.message) in mine] == [__file__]  # the caller's line
        train_step(model, optimizer, good[3])  # finite again: a new state
        assert ckpt.save(14, model, optimizer)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3, 14]
    model, optimizer = build(seed=1)
    assert checkpoint.restore(tmp_path, model, optimizer, step=3) == 3
    assert_values(model, optimizer, third)


# --- 7. a save in flight ---------------------------------------------------------------------------


@pytest.fixture
def held_commits(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Background saves wait for this event (at most 30 s) before they commit."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    commit, release = async_checkpointer._on_commit_callback, threading.Event()

    def held(*args: object, **kwargs: object) -> None:
        release.wait(30)
        commit(*args, **kwargs)

    monkeypatch.setattr(async_checkpointer, "_on_commit_callback", held)
    return release


def test_only_committed_steps_are_listed_or_named(tmp_path: Path, held_commits: threading.Event) -> None:
    model, optimizer = build()
    with CheckpointManager(tmp_path) as ckpt:
        assert ckpt.save(1, model, optimizer)
        assert ckpt.all_steps() == [] and ckpt.latest_step() is None  # written, not yet committed
        threading.Timer(1.0, held_commits.set).start()
        add(model, optimizer, float("nan"))
        with pytest.raises(NonFiniteStateError, match=r"; the newest step kept there is 1\.$"):
            ckpt.save(2, model, optimizer)
        assert (tmp_path / "1").is_dir()  # committed before it was named
        assert ckpt.all_steps() == [1]


@pytest.mark.parametrize(
    ("how", "code", "said"),
    [
        (
            "end",
            0,
            (
                "the CheckpointManager of {d} was still open as the script ended: step 1, still being "
                "written, was committed."
            ),
        ),
        (
            "raise",
            1,
            (
                "the CheckpointManager of {d} was still open as the script ended: step 1, still being "
                "written, was committed."
            ),
        ),
        (
            "scope",
            0,
            (
                "a CheckpointManager of {d} was collected unclosed while saving; its save was finished as "
                "the script ended."
            ),
        ),
    ],
)
def test_a_save_in_flight_when_the_script_ends_is_committed(
    tmp_path: Path, how: str, code: int, said: str
) -> None:
    """Before, the script hung for 300 s on orbax's signal barrier and left ``1.orbax-checkpoint-tmp``."""
    directory = tmp_path / "ckpt"
    started = time.monotonic()
    done = run_worker("unclosed", str(directory), how)
    seconds = time.monotonic() - started
    assert done.returncode == code, done.stdout + done.stderr
    assert seconds < 60, f"the script took {seconds:.0f} s to end"  # a guard, not a speed test
    assert "LISTED [] None" in done.stdout  # in flight as save returned: not listed
    assert f"substrax.checkpoint: {said.format(d=directory)}" in done.stderr
    assert sorted(os.listdir(directory)) == ["1"]  # committed, the claim released, no tmp
    assert checkpoint.restore(directory, *build(seed=1)) == 1


# --- 8. what a damaged step prints ---------------------------------------------------------------


def test_a_damaged_step_says_one_line_and_orbax_the_rest_at_debug(tmp_path: Path) -> None:
    """Before, up to hundreds of lines: ``RuntimeError: Event loop is closed`` tracebacks,
    ``Exception ignored in: <coroutine ...>``, ``ERROR:absl:Failed to json parse ...``."""
    directory = tmp_path / "ckpt"
    done = run_worker("damaged", str(directory))
    assert done.returncode == 0, done.stdout + done.stderr
    refused, restored = done.stdout.splitlines()
    assert re.match(
        rf"^REFUSED step 2 in {directory} is damaged: (model|optimizer)\[.*\] could not be read "
        r"\(DATA_LOSS: .*\)\.$",
        refused,
    ), refused
    assert restored == "RESTORED 1"
    warning, source = done.stderr.splitlines()  # the warning, and the line that restored
    assert warning.endswith(
        f"UserWarning: restored step 1, the newest whole step: step 3 in {directory} is damaged: its "
        "_CHECKPOINT_METADATA cannot be read (Unterminated string starting at: line 1 column 31 "
        "(char 30)) (older damaged steps skipped too: [2])."
    ), done.stderr
    assert source.strip().startswith('print(f"RESTORED {checkpoint.restore(directory')
    debug = (tmp_path / "ckpt.debug").read_text()
    assert f"orbax: Failed to json parse Metadata file: {directory}/3/_CHECKPOINT_METADATA" in debug


# --- the checksum ---------------------------------------------------------------------------


def test_a_checksum_is_the_same_in_any_layout_and_read_on_the_host_or_the_devices(
    mesh8: jax.sharding.Mesh,
) -> None:
    """A small array of one process is checked by NumPy, any other on its devices: the same sums."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 24)).astype(np.float32)
    layouts = [jax.device_put(x, NamedSharding(mesh8, spec)) for spec in (P(), P("data"), P(None, "data"))]
    others = [
        jax.numpy.asarray(x[:3], dtype=jax.numpy.bfloat16),
        jax.numpy.asarray(np.int32(7)),
        jax.numpy.asarray(x[0] > 0),
        jax.numpy.asarray([1.0, np.nan], np.float32),
    ]
    answers = []
    for array in layouts + others:
        finite, sums = _inspect_on_device(array)
        host = _inspect_on_host(array)
        assert bool(finite) == host[0] and np.array_equal(np.asarray(sums), host[1]), array.dtype
        answers.append((host[0], tuple(host[1])))
    assert answers[0] == answers[1] == answers[2]  # the same values in three layouts
    assert [a[0] for a in answers[3:]] == [True, True, True, False]
    assert len(set(answers)) == len(answers) - 2  # other values, other sums


def test_an_abandoned_reads_unretrieved_future_goes_to_debug_and_others_pass(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found flaky in a clean-clone CI run (2 of 8 damaged-step runs): asyncio logged
    "Future exception was never retrieved" for a read orbax abandoned at the damaged step."""
    from substrax.checkpoint._quiet import leftovers_dropped

    def never_retrieved(error: Exception) -> None:
        logging.getLogger("asyncio").error(
            "Future exception was never retrieved\nfuture: <Future finished>",
            exc_info=(type(error), error, None),
        )

    with caplog.at_level(logging.DEBUG), leftovers_dropped():
        never_retrieved(ValueError('DATA_LOSS: Error opening "zarr" driver'))  # tensorstore's: dropped
        never_retrieved(ValueError("a future of the user's own"))  # not a read's: passed on
    said = [(r.name, r.levelname, r.getMessage().splitlines()[0]) for r in caplog.records]
    assert said == [
        (
            "substrax.checkpoint",
            "DEBUG",
            (
                "a read abandoned at a damaged step ended late: "
                "ValueError('DATA_LOSS: Error opening \"zarr\" driver')"
            ),
        ),
        ("asyncio", "ERROR", "Future exception was never retrieved"),
    ], said
