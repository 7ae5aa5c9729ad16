"""Run ``python -m substrax.launch`` from a test, and check what it left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def pids(self) -> list[int]:
        """Every child and grandchild pid the launcher and the workers reported."""
        started = re.search(r"\[launch\] started \d+ processes \(([^)]*)\)", self.stderr)
        assert started, f"the launcher did not report its children:\n{self.stderr}"
        children = [int(p) for p in re.findall(r"pid (\d+)", started.group(1))]
        return children + [int(p) for p in re.findall(r"GRANDCHILD (\d+)", self.stdout)]


def launcher_command(
    num: int, devices: int, worker: str, *args: str, grace: float | None = None, options: Sequence[str] = ()
) -> list[str]:
    cmd = [sys.executable, "-m", "substrax.launch", "-n", str(num), "--devices-per-process", str(devices)]
    if grace is not None:
        cmd += ["--grace", str(grace)]
    return cmd + [*options, str(WORKERS / worker), *args]


def launch(
    num: int, devices: int, worker: str, *args: str, timeout: float = 120, options: Sequence[str] = ()
) -> Run:
    """Run the launcher to its end; ``options`` go to it, before the worker."""
    start = time.monotonic()
    done = subprocess.run(
        launcher_command(num, devices, worker, *args, options=options),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def launch_and_signal(
    tmp_path: Path,
    num: int,
    devices: int,
    worker: str,
    *args: str,
    sig: int,
    ready: int,
    timeout: float = 120,
    options: Sequence[str] = (),
    to_process: int | None = None,
) -> Run:
    """Start the launcher, wait until ``ready`` workers print READY, send it ``sig``.

    ``options`` go to the launcher, before the worker; with ``to_process`` the signal
    goes to that process of the run instead of the launcher.
    """
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(
            launcher_command(num, devices, worker, *args, options=options), cwd=REPO, stdout=o, stderr=e
        )
    try:
        deadline = time.monotonic() + timeout
        while out.read_text().count("READY") < ready:
            assert proc.poll() is None, f"the launcher ended early:\n{out.read_text()}\n{err.read_text()}"
            assert time.monotonic() < deadline, "the workers never got ready"
            time.sleep(0.1)
        start = time.monotonic()
        if to_process is None:
            proc.send_signal(sig)
        else:
            os.kill(Run(0, "", err.read_text(), 0.0).pids()[to_process], sig)
        code = proc.wait(timeout=timeout)
        return Run(code, out.read_text(), err.read_text(), time.monotonic() - start)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def running(pids: list[int], *, settle_s: float = 5.0) -> list[int]:
    """Those of ``pids`` still running after up to ``settle_s``: not gone, not a zombie.

    A pid counts only while its command line is still one of ours (python or sleep), so a
    number the kernel has handed to an unrelated process is not mistaken for a survivor.
    """

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state != "Z" and (b"python" in cmdline or b"sleep" in cmdline)

    deadline = time.monotonic() + settle_s
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@contextmanager
def reaping(pids: list[int]) -> Iterator[list[int]]:
    """``pids``, and those of them still running when the block ends killed (``kill_all``)."""
    try:
        yield pids
    finally:
        kill_all(pids)


def kill_all(pids: list[int]) -> None:
    """Clean up after a failed test, so it does not leave processes for the next one."""
    for pid in running(pids, settle_s=0):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
