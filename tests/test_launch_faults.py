"""The launcher under faults: preemption, a process that stalls or leaves, a script that
never joins, durations that make no sense, a hang nobody watches.

The workers that need no JAX (``workers/launch_plain.py``, ``workers/plain_worker.py``)
take a few seconds (the launcher imports JAX); the runs of real JAX processes
(``workers/launch_jax.py``) take longer. The coordinator's port, held for the run, is
tested in ``test_launch.py``.
"""

from __future__ import annotations

import inspect
import re
import signal
import subprocess
import time

import optax
import pytest
from flax import nnx
from models import MLP
from workers.launching import REPO, Run, launch, launch_and_signal, launcher_command, reaping, running

import substrax.launch
from substrax import checkpoint
from substrax.launch import __main__ as cli
from substrax.launch import _launcher

BOUND_S = 30


def _steps(directory) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.parametrize("to", ["launcher", "process"])
def test_a_sigterm_saves_the_step_at_hand_on_every_process_and_ends_the_run_with_143(tmp_path, to) -> None:
    # Each process saves only when asked (its interval is never reached; step 1 is saved
    # as the directory's first). SIGTERM to the launcher is passed on to both processes;
    # SIGTERM to process 1 alone reaches process 0 through the managers' agreement.
    directory = tmp_path / "ckpt"
    run = launch_and_signal(
        tmp_path,
        2,
        1,
        "launch_jax.py",
        "train",
        str(directory),
        sig=signal.SIGTERM,
        ready=2,
        options=["--grace", "60"],
        to_process=None if to == "launcher" else 1,
    )
    with reaping(run.pids()) as pids:
        assert run.returncode == 143, run.output
        assert "NOT STOPPED" not in run.stdout
        saved = re.search(r"\[p0\] substrax\.checkpoint: SIGTERM: step (\d+) saved", run.stderr)
        assert saved, run.stderr
        step = int(saved.group(1))
        for i in range(2):  # the step saved is the last step each process took
            last = max(int(s) for s in re.findall(rf"\[p{i}\] STEP (\d+)", run.stdout))
            assert last == step, (i, last, step)
        assert step >= 3
        assert _steps(directory) == [1, step]
        if to == "process":  # both processes save and exit 143; the launcher names whichever it saw first
            named = re.search(r"\[launch\] process ([01]) \(pid (\d+)\) exited with code 143", run.stderr)
            assert named and int(named.group(2)) == pids[int(named.group(1))], run.stderr
        assert run.seconds < BOUND_S and running(pids) == []
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
    with checkpoint.CheckpointManager(directory, read_only=True) as manager:
        assert manager.restore(model, optimizer) == step  # whole: every checksum holds


def test_a_second_signal_kills_at_once(tmp_path) -> None:
    # The workers ignore SIGTERM; the grace (30 s by default) would keep them that long.
    out = tmp_path / "stdout"
    with out.open("w") as o:
        proc = subprocess.Popen(
            launcher_command(2, 1, "plain_worker.py", "wait"),
            cwd=REPO,
            stdout=o,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        deadline = time.monotonic() + 60
        while out.read_text().count("READY") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the workers never got ready"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    with reaping(Run(proc.returncode, out.read_text(), err, seconds).pids()) as pids:
        assert proc.returncode == 130, err
        assert "[launch] got SIGINT again; killing every process now." in err
        assert seconds < 2.5, seconds
        assert running(pids) == []


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("stall", r"process 1 \(pid {pid}\) stalled: it has been stopped \(SIGSTOP, or a debugger\) for "),
        (
            "leave",
            r"process 1 \(pid {pid}\) left early: its script ended [\d.]+ s ago, while process 0 ran on",
        ),
    ],
)
def test_a_failure_after_a_process_stalled_or_left_names_that_process(mode: str, cause: str) -> None:
    # Process 0 exits 134 a moment after process 1 stopped itself, or exited 0: as a JAX
    # process aborts when a peer stops answering, or leaves it alone in a collective.
    run = launch(2, 1, "launch_plain.py", mode, timeout=60)
    with reaping(run.pids()) as pids:
        assert run.returncode == 134, run.output
        said = re.search(
            r"\[launch\] process 0 \(pid \d+\) exited with code 134, probably because (.*)", run.stderr
        )
        assert said, run.stderr
        assert re.search(cause.format(pid=pids[1]), said.group(1)), said.group(1)
        if mode == "stall":
            assert f"[launch] process 1 (pid {pids[1]}) is stopped" in run.stderr
        assert run.seconds < BOUND_S and running(pids) == []


def test_a_jax_process_whose_script_ended_early_is_named_when_its_peer_fails() -> None:
    # Process 1's script ends while process 0 waits for it in a collective: process 1
    # waits at JAX's shutdown barrier (1 s here), which then fails both. Whichever exits
    # first, the launcher names process 1 as the one that left.
    run = launch(2, 1, "launch_jax.py", "leave", timeout=120, options=["--shutdown-timeout", "1"])
    with reaping(run.pids()) as pids:
        assert run.returncode != 0, run.output
        said = re.search(r"\[launch\] (process \d \(pid \d+\)) .*?, probably because (.*)", run.stderr)
        assert said, run.stderr
        first, why = said.groups()
        left = "it" if first == f"process 1 (pid {pids[1]})" else f"process 1 (pid {pids[1]})"
        assert why.startswith(f"{left} left early: its script ended"), why
        assert "process 0 (pid" not in why
        assert run.seconds < BOUND_S and running(pids) == []


def test_a_script_that_never_initializes_is_warned_about_and_one_that_does_is_not() -> None:
    run = launch(2, 1, "plain_worker.py", "env", timeout=60)
    assert run.returncode == 0, run.output
    assert "[launch] warning: no process called substrax.launch.initialize()" in run.stderr
    joined = launch(1, 1, "launch_jax.py", "init", timeout=60)
    assert joined.returncode == 0, joined.output
    assert "warning" not in joined.stderr, joined.stderr


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("grace_s", -1, "grace_s must be a number of seconds, 0 or more; got -1"),
        ("grace_s", float("nan"), "grace_s must be a number of seconds, 0 or more; got nan"),
        ("idle_timeout_s", -5.0, "idle_timeout_s must be a positive number of seconds or None; got -5.0"),
        ("shutdown_timeout_s", -1, "shutdown_timeout_s must be a positive int; got -1"),
        ("shutdown_timeout_s", 0, "shutdown_timeout_s must be a positive int; got 0"),
    ],
)
def test_launch_refuses_negative_durations(option: str, value: object, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        substrax.launch.launch(__file__, num_processes=1, devices_per_process=1, **{option: value})


@pytest.mark.parametrize("option", ["--grace", "--idle-timeout", "--shutdown-timeout"])
def test_the_cli_refuses_a_negative_duration(option: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        cli.main(["-n", "2", option, "-1", __file__])
    assert exit.value.code == 2
    assert re.search(r"error: \w+ must be a (positive|number).* got -1", capsys.readouterr().err)


def test_a_hang_is_bounded_by_default_and_0_lifts_the_bound(monkeypatch) -> None:
    assert inspect.signature(substrax.launch.launch).parameters["idle_timeout_s"].default == 1800
    got = []
    monkeypatch.setattr(cli, "launch", lambda *a, **k: got.append(k["idle_timeout_s"]) or 0)
    cli.main(["-n", "2", __file__])
    cli.main(["-n", "2", "--idle-timeout", "0", __file__])
    cli.main(["-n", "2", "--idle-timeout", "7.5", __file__])
    assert got == [_launcher.IDLE_TIMEOUT_S, None, 7.5]
