"""The launcher's hold on each child process: start it, watch it, end the run's process group.

A child is left unreaped until the group is stopped, so the group's id cannot be reused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from substrax.launch import _env
from substrax.launch._output import Printer

STALL_NOTICE_S = 1.0  # how long a process must stay stopped before the launcher says so
HEARTBEAT_S = 30  # _child.HEARTBEAT_TIMEOUT_S, without importing JAX here
POLL_S = 0.05


@dataclass
class Child:
    index: int
    proc: subprocess.Popen
    readers: list[threading.Thread]
    started_at: float = field(default_factory=time.monotonic)
    exited_at: float | None = None  # when it exited, as a waiting thread saw it (to blame the first)
    last_output_at: float | None = None  # when it last printed a line (for the idle timeout)
    initialized: bool = False  # it told us initialize() joined it to the others
    finished_at: float | None = None  # when its script ended cleanly (or it exited 0), as first seen
    stopped_since: float | None = None  # since when it has been seen stopped (SIGSTOP, a debugger)
    stall_announced: bool = False

    @property
    def name(self) -> str:
        return f"process {self.index} (pid {self.proc.pid})"

    def observe(self, status_dir: str | None, code: int | None, printer: Printer) -> None:
        """Read what the child told us (its status files), and whether it is stopped."""
        now = time.monotonic()
        if status_dir is not None:
            if not self.initialized:
                self.initialized = os.path.exists(_env.status_file(status_dir, self.index, _env.INITIALIZED))
            if self.finished_at is None and os.path.exists(
                _env.status_file(status_dir, self.index, _env.FINISHED)
            ):
                self.finished_at = now
        if code is not None:
            if code == 0 and self.finished_at is None:
                self.finished_at = self.exited_at or now
            self.stopped_since = None
            return
        if not _is_stopped(self.proc.pid):
            self.stopped_since, self.stall_announced = None, False
            return
        if self.stopped_since is None:
            self.stopped_since = now
        if not self.stall_announced and now - self.stopped_since >= STALL_NOTICE_S:
            self.stall_announced = True
            printer.say(
                f"{self.name} is stopped (SIGSTOP, or a debugger): the others cannot go on without "
                f"it, and give up on it after about {HEARTBEAT_S} s."
            )

    def wait_in_background(self) -> None:
        """Note the moment the child exits, without reaping it (see ``exit_code``)."""
        if not hasattr(os, "waitid"):
            return

        def wait() -> None:
            try:
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                pass  # already reaped by stop
            self.exited_at = time.monotonic()

        threading.Thread(target=wait, name=f"substrax-wait-p{self.index}", daemon=True).start()

    def exit_code(self) -> int | None:
        """The exit code (minus the signal that killed it), or None while it runs.

        The child is left unreaped (a zombie) until ``stop``: the first child's pid is
        the run's process group id, and the kernel cannot reuse it while we hold it.
        """
        if self.proc.returncode is not None:
            return self.proc.returncode
        if not hasattr(os, "waitid"):  # macOS: reap now; the group id stays in use
            return self.proc.poll()  # while any member of the group lives
        info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def join_readers(self, timeout_s: float) -> None:
        # A grandchild may hold a pipe open after the child is gone: never wait long.
        for t in self.readers:
            t.join(timeout=timeout_s)


def start(
    index: int, script: str, args: Sequence[str], env: dict[str, str], group: int, printer: Printer
) -> Child:
    """Start ``python script *args`` as process ``index`` in process group ``group`` (0: a new one)."""
    proc = subprocess.Popen(
        [sys.executable, script, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=group,  # 0: a new group, led by this child
    )
    child = Child(index, proc, [])

    def noted() -> None:
        child.last_output_at = time.monotonic()

    prefix = f"[p{index}] "
    child.readers = [
        threading.Thread(target=printer.pump, args=(pipe, stream, prefix, noted), daemon=True)
        for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
    ]
    for t in child.readers:
        t.start()
    child.wait_in_background()
    return child


def observe(children: Sequence[Child], status_dir: str | None, printer: Printer) -> list[int | None]:
    """Each child's exit code (None while it runs), having read what each told us."""
    codes = [c.exit_code() for c in children]
    for child, code in zip(children, codes, strict=True):
        child.observe(status_dir, code, printer)
    return codes


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (by SIGSTOP or SIGTSTP, or at a debugger's stop); Linux only."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass  # nobody left in it (a group of zombies alone may refuse the signal)


def terminate(children: Sequence[Child]) -> None:
    """SIGTERM to the run's process group, and SIGCONT: a stopped process acts on SIGTERM only once
    continued."""
    group = children[0].proc.pid
    _signal_group(group, signal.SIGTERM)
    _signal_group(group, signal.SIGCONT)


def stop(children: Sequence[Child], grace_s: float) -> None:
    """End the run's process group: SIGTERM, up to ``grace_s``, SIGKILL; then reap."""
    if not children:
        return
    terminate(children)
    deadline = time.monotonic() + grace_s
    while any(c.exit_code() is None for c in children) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _signal_group(children[0].proc.pid, signal.SIGKILL)  # also whatever a script started and left behind
    for child in children:
        child.proc.wait()
        child.join_readers(1.0)
