"""The local launcher: output, failure, interrupts, and what ``initialize`` does where.

Most launches here run a worker that never imports JAX (``workers/plain_worker.py``),
so they take about a second; the two that need real JAX processes are marked so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest
from workers.launching import REPO, launch, launch_and_signal, reaping, running

import substrax.launch
from substrax.launch import _env
from substrax.launch._env import detect_cluster, launch_env
from substrax.launch._output import drop_gloo_chatter

BOUND_S = 30  # the bound on ending a failed run; everything here is far below it


def test_each_process_gets_its_place_and_its_lines_keep_their_stream() -> None:
    run = launch(3, 2, "plain_worker.py", "env", timeout=60)
    assert run.returncode == 0, run.output
    envs = {}
    for line in run.stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("ENV "):
            envs[prefix] = json.loads(rest[4:])
    assert sorted(envs) == ["[p0]", "[p1]", "[p2]"]
    for i in range(3):
        env = envs[f"[p{i}]"]
        assert env[_env.PROCESS_ID] == str(i)
        assert env[_env.NUM_PROCESSES] == "3"
        assert env[_env.DEVICES_PER_PROCESS] == "2"
        assert env["PYTHONUNBUFFERED"] == "1"
        host, port = env[_env.COORDINATOR].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    assert len({e[_env.COORDINATOR] for e in envs.values()}) == 1
    for i in range(3):  # stderr lines go to stderr, prefixed, and only there
        assert f"[p{i}] to stderr from {i}" in run.stderr.splitlines()
        assert f"to stderr from {i}" not in run.stdout


def test_free_port_is_free_on_loopback() -> None:
    port = substrax.launch.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("how", "code", "said"), [("3", 3, "exited with code 3"), ("kill", 137, "was killed by signal SIGKILL")]
)
def test_a_failed_process_ends_the_run_and_everything_it_started(how: str, code: int, said: str) -> None:
    # The other processes ignore SIGTERM: only the escalation to SIGKILL ends them.
    run = launch(3, 1, "plain_worker.py", "fail", how, timeout=60)
    with reaping(run.pids()) as pids:
        assert run.returncode == code, run.output
        assert f"[launch] process 1 (pid {pids[1]}) {said}" in run.stderr
        assert run.seconds < BOUND_S
        assert len(pids) == 6 and running(pids) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_launcher_leaves_nothing_running(tmp_path, sig: int) -> None:
    # The workers ignore the SIGTERM passed on to them: SIGKILL ends them after --grace.
    run = launch_and_signal(
        tmp_path, 2, 1, "plain_worker.py", "wait", sig=sig, ready=2, timeout=60, options=["--grace", "1"]
    )
    with reaping(run.pids()) as pids:
        assert run.returncode == 128 + sig, run.output
        assert f"got {signal.Signals(sig).name}" in run.stderr
        assert run.seconds < BOUND_S
        assert len(pids) == 4 and running(pids) == []


def test_ctrl_c_ends_jax_processes_stuck_in_a_collective(tmp_path) -> None:
    run = launch_and_signal(tmp_path, 2, 2, "mp_worker.py", "wait", sig=signal.SIGINT, ready=2)
    with reaping(run.pids()) as pids:
        assert run.returncode == 130, run.output
        assert run.seconds < BOUND_S
        assert len(pids) == 4 and running(pids) == []


def test_jax_processes_end_themselves_when_the_launcher_is_killed(tmp_path) -> None:
    # SIGKILL gives the launcher no chance to clean up; initialize()'s watchdog does it.
    run = launch_and_signal(tmp_path, 2, 2, "mp_worker.py", "wait", sig=signal.SIGKILL, ready=2)
    with reaping(run.pids()) as pids:
        assert run.returncode == -signal.SIGKILL
        assert running(pids, settle_s=10) == []


def test_the_cli_refuses_a_missing_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "substrax.launch", "-n", "2", "no_such_script.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "'no_such_script.py' is not a file" in done.stderr


@pytest.mark.parametrize("field", ["num_processes", "devices_per_process"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_launch_refuses_counts_that_are_not_positive_ints(field: str, value: object) -> None:
    counts = {"num_processes": 2, "devices_per_process": 2, field: value}
    with pytest.raises(ValueError, match=f"{field} must be a positive int; got {value!r}"):
        substrax.launch.launch(__file__, **counts)  # type: ignore[arg-type]


SLURM = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


@pytest.mark.parametrize(
    ("env", "found"),
    [
        ({}, None),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "JAX"),
        ({**SLURM, "SLURM_NTASKS": "4"}, "SLURM"),
        ({**SLURM, "SLURM_NTASKS": "1"}, None),  # a one-task job is a single process
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, None),  # salloc shell, outside srun
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI"),
        ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"}, "Kubernetes"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),  # a lone pod, such as a notebook
        ({"TPU_WORKER_HOSTNAMES": "host-a,host-b"}, "Cloud TPU"),
        ({"TPU_WORKER_HOSTNAMES": "host-a"}, None),
    ],
)
def test_cluster_detection(env: dict, found: str | None) -> None:
    got = detect_cluster(env)
    if found is None:
        assert got is None
    else:
        assert got is not None and got.startswith(found)


def _clear_cluster_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        prefixes = ("SUBSTRAX_", "SLURM_", "OMPI_", "JAX_COORDINATOR", "KUBERNETES_", "TPU_", "MEGASCALE_")
        if name.startswith(prefixes):
            monkeypatch.delenv(name)


def test_initialize_alone_does_nothing_and_on_a_cluster_lets_jax_detect(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    _clear_cluster_env(monkeypatch)
    substrax.launch.initialize()
    substrax.launch.initialize(distributed=False)
    assert calls == []
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    substrax.launch.initialize(distributed=False)
    assert calls == []
    substrax.launch.initialize()
    substrax.launch.initialize(distributed=True)
    assert calls == [((), {}), ((), {})]  # no arguments: JAX reads the cluster itself


def test_initialize_under_the_launcher_after_jax_started_says_it_came_too_late(monkeypatch) -> None:
    jax.devices()  # the backend is up, as in a script that made an array first
    monkeypatch.setenv(_env.COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(_env.NUM_PROCESSES, "2")
    monkeypatch.setenv(_env.PROCESS_ID, "0")
    monkeypatch.setenv(_env.DEVICES_PER_PROCESS, "4")
    with pytest.raises(RuntimeError, match="first thing in the script"):
        substrax.launch.initialize()


def test_incomplete_launch_variables_are_named() -> None:
    assert launch_env({}) is None
    with pytest.raises(RuntimeError, match=f"{_env.NUM_PROCESSES}, {_env.DEVICES_PER_PROCESS} not"):
        launch_env({_env.COORDINATOR: "127.0.0.1:5", _env.PROCESS_ID: "0"})


def test_process_slice_on_one_process_is_every_row() -> None:
    assert substrax.launch.process_slice(12) == slice(0, 12)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the port is held with Linux's SO_REUSEPORT")
def test_the_coordinator_port_is_held_for_the_run(tmp_path) -> None:
    # The children import JAX before process 0's coordinator binds the port: seconds in
    # which another process on the machine (a bind to port 0, as gloo's listeners do) could
    # take it, and process 0 would fail with "Address already in use". The launcher holds it.
    script = tmp_path / "bind_coordinator_port.py"
    script.write_text(
        "import os, socket\n"
        "host, port = os.environ['SUBSTRAX_COORDINATOR_ADDRESS'].rsplit(':', 1)\n"
        "with socket.socket() as s:\n"
        "    try:\n"
        "        s.bind((host, int(port)))\n"
        "        print('BOUND')\n"
        "    except OSError as e:\n"
        "        print('REFUSED', e.strerror)\n"
    )
    run = launch(1, 1, str(script), timeout=60)
    assert run.returncode == 0, run.output
    assert run.stdout.splitlines() == ["[p0] REFUSED Address already in use"], run.output


def test_sys_exit_in_a_jax_process_ends_the_run_at_once_with_its_code() -> None:
    # Process 1 calls sys.exit(3) while process 0 waits for it in a collective; without
    # the launcher's care process 1 would wait in JAX's shutdown barrier, then abort.
    # A long shutdown barrier (60 s) sets the old behaviour far from the bound asserted
    # below, which is loose enough for a loaded 2-core machine.
    run = launch(2, 2, "mp_worker.py", "exit", timeout=120, options=["--shutdown-timeout", "60"])
    ended = time.time()
    with reaping(run.pids()) as pids:
        assert run.returncode == 3, run.output
        assert f"[launch] process 1 (pid {pids[1]}) exited with code 3" in run.stderr
        exited = float(re.search(r"\[p1\] EXITING (\S+)", run.stdout).group(1))
        assert ended - exited < 15, f"the run ended {ended - exited:.1f} s after sys.exit(3)"
        assert running(pids) == []


def test_an_idle_run_ends_after_the_idle_timeout_naming_what_it_waited_for() -> None:
    # Both processes print READY, then hang (they ignore SIGTERM, as a JAX process may).
    run = launch(2, 1, "plain_worker.py", "wait", timeout=60, options=["--idle-timeout", "1"])
    with reaping(run.pids()) as pids:
        assert run.returncode == 124, run.output
        said = re.search(r"\[launch\] no process printed a line for 1 s \(--idle-timeout\): (.*)", run.stderr)
        assert said, run.stderr
        for i in (0, 1):  # quietest first: whichever printed READY first
            assert re.search(rf"(^|; )process {i} \(pid {pids[i]}\), no line for \d+ s[;.]", said[1]), said[1]
        assert run.seconds < BOUND_S and running(pids) == []


def test_the_idle_timeout_names_the_process_that_went_quiet_first(tmp_path) -> None:
    # Process 1 goes quiet after READY; process 0 prints for 2 s more, then both hang.
    ready = str(tmp_path / "ready")
    run = launch(2, 1, "plain_worker.py", "quiet", ready, timeout=60, options=["--idle-timeout", "1"])
    with reaping(run.pids()) as pids:
        assert run.returncode == 124, run.output
        said = re.search(
            r"\[launch\] no process printed a line for 1 s \(--idle-timeout\): "
            rf"process 1 \(pid {pids[1]}\), no line for (\d+) s, the first to go quiet; "
            rf"process 0 \(pid {pids[0]}\), no line for (\d+) s\. ",
            run.stderr,
        )
        assert said, run.stderr
        assert int(said[1]) >= int(said[2]) + 1 and int(said[2]) >= 1
        assert run.seconds < BOUND_S and running(pids) == []


def test_launch_refuses_a_bad_idle_timeout() -> None:
    with pytest.raises(ValueError, match="must be a positive number of seconds or None; got 0"):
        substrax.launch.launch(__file__, num_processes=1, devices_per_process=1, idle_timeout_s=0)


def test_gloo_connection_lines_are_silenced_and_other_lines_kept_whole() -> None:
    run = launch(2, 1, "plain_worker.py", "gloo", timeout=60)
    assert run.returncode == 0, run.output
    assert sorted(run.stdout.splitlines()) == ["[p0] line 0 whole", "[p1] line 1 whole"], run.stdout
    assert "Gloo" not in run.output


@pytest.mark.parametrize(
    ("line", "kept"),
    [
        ("[Gloo] Rank 4\n", None),
        ("[Gloo] Rank  is connected to 75 peer ranks.  is connected to peer ranks. \n", None),
        ("Expected number of connected peer ranks is : 7\n", None),
        ("[Gloo] Rank 5 is connected to 7 peer ranks. loss 0.25\n", "57loss 0.25\n"),  # the pieces go
        ("loss 0.25 after 7 peer steps\n", "loss 0.25 after 7 peer steps\n"),
        ("\n", "\n"),
    ],
)
def test_drop_gloo_chatter(line: str, kept: str | None) -> None:
    assert drop_gloo_chatter(line) == kept
