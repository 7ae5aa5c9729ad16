"""Start N copies of a script on this machine, stream their output, end them together.

These rules keep a local multi-process run from hanging, losing its progress or
leaving strays behind:

- The children run in a process group of their own, apart from the launcher's (so a
  Ctrl-C in the terminal reaches only the launcher), and the run is ended by signalling
  that group: SIGTERM, a grace, then SIGKILL. A process blocked in a collective or
  sitting in JAX's shutdown barrier may not end on SIGTERM, so SIGTERM alone is not
  enough. The group also holds whatever the scripts started, and one group for the
  whole run lets any child end all of it (see ``_child``).
- The first child to exit non-zero ends the run: the others are stopped at once
  (SIGTERM, at most ``STOP_GRACE_S``, SIGKILL) and the launcher exits with that child's
  code, naming it, and naming a process that had stalled (stopped by SIGSTOP or a
  debugger) or left early (its script ended while its peers ran on), the likelier
  cause when the first to fail is a healthy peer that gave up waiting.
- Ctrl-C, SIGTERM or SIGHUP to the launcher is passed on to every child as SIGTERM,
  and they have ``--grace`` seconds to end: time for a ``CheckpointManager`` to save the
  step at hand and exit 143. A child that exits 143 by itself (a SIGTERM sent to it
  alone) gives the others the same time to save that step and end. A second signal to
  the launcher kills them at once.
- A run in which no process prints a line for ``--idle-timeout`` seconds (30 minutes
  by default) is ended: a hang is bounded even when nobody watches.
- The coordinator's port is held by the launcher for the whole run (see
  ``_reserved_port``), and each process tells the launcher (by files in a private
  status directory) when it joined the run and when its script ended, so the launcher
  can warn of a script that never called ``initialize()``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from substrax.launch import _env

GRACE_S = 30.0  # after a SIGTERM passed on: time to save a checkpoint and exit
STOP_GRACE_S = 3.0  # after a failure or a hang: nothing can be saved, so no more than this
IDLE_TIMEOUT_S = 1800.0  # by default a run silent for 30 minutes is taken for hung
TERMINATED = 128 + signal.SIGTERM  # 143: the exit code of a process that saved and ended on SIGTERM
STALL_NOTICE_S = 1.0  # how long a process must stay stopped before the launcher says so
HEARTBEAT_S = 30  # _child.HEARTBEAT_TIMEOUT_S, without importing JAX here
POLL_S = 0.05
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    The coordinator binds it a moment later; only loopback is ever used, so the
    coordinator is never reachable from another machine.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _reserved_port() -> Iterator[int]:
    """A free loopback port for the coordinator, held until the run ends.

    Between choosing a port and process 0's coordinator binding it lie seconds (each
    child imports JAX first), in which any other process on the machine can take it: a
    bind to port 0 (as gloo's listeners do) or a connection's ephemeral port. Process 0
    then fails with "Address already in use". So on Linux the launcher keeps a socket
    bound to the port with ``SO_REUSEPORT``, never listening: the coordinator (gRPC sets
    ``SO_REUSEPORT`` on its listeners) binds beside it and gets every connection, while
    any other bind to the port fails and no connection takes it as its local port.
    Elsewhere the port is only chosen (``free_port``). The children do not inherit the
    socket (Python's sockets are close-on-exec).
    """
    if not (sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")):
        yield free_port()
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


class _Signals:
    """Notes SIGINT, SIGTERM and SIGHUP (the first, the last, how many); the watch loop acts on them.

    The handler only records: an exception raised from a handler can land anywhere in
    the main thread (inside a finalizer, where it is swallowed); a flag cannot be lost.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.last: int | None = None
        self.count = 0

    def note(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        self.last = signum
        self.count += 1

    @contextlib.contextmanager
    def noted(self) -> Iterator[_Signals]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # only the main thread may set handlers; the caller owns signals
            return
        previous = {s: signal.signal(s, self.note) for s in _HANDLED}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


# When its connections are up, gloo prints "[Gloo] Rank R is connected to N peer ranks.
# Expected number of connected peer ranks is : N" once per device, from one thread per
# device, one piece at a time: the pieces interleave ("[Gloo] Rank 4", "[Gloo] Rank  is
# connected to 75 peer ranks.  is connected to peer ranks. "), numbers astray.
_GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank ?| ?is connected to ?| ?peer ranks\. ?|Expected number of connected peer ranks is : ?"
)


def drop_gloo_chatter(line: str) -> str | None:
    """``line`` without gloo's "Rank R is connected" pieces; ``None`` when only they were in it.

    They carry no information. A line that held only their pieces and numbers is dropped;
    any other line keeps everything but the pieces.
    """
    rest, found = _GLOO_PIECES.subn("", line)
    if not found:
        return line
    return rest if rest.strip(" \t\r\n0123456789") else None


class _Printer:
    """Writes whole lines from every child, each under its prefix, one at a time.

    Streams are named ("stdout", "stderr") and looked up at each write, so output
    follows any redirection of ``sys.stdout`` (a notebook, pytest's capture).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, stream: str, prefix: str, line: str) -> None:
        with self._lock:
            out = getattr(sys, stream)
            try:
                out.write(prefix + line.rstrip("\n") + "\n")
                out.flush()
            except (BrokenPipeError, ValueError):
                pass  # our own output is gone (a closed pipe); keep draining the child's

    def pump(
        self, pipe: BinaryIO, stream: str, prefix: str, on_line: Callable[[], None] = lambda: None
    ) -> None:
        with pipe:
            after_gloo = False  # gloo's pieces leave stray newlines and digits on the lines after them
            for raw in iter(pipe.readline, b""):
                on_line()
                text = raw.decode(errors="replace")
                line = drop_gloo_chatter(text)
                if line is not None and after_gloo and not line.strip(" \t\r\n0123456789"):
                    line = None
                after_gloo = line is None or line != text
                if line is not None:
                    self.write(stream, prefix, line)

    def say(self, text: str) -> None:
        self.write("stderr", "[launch] ", text)


@dataclass
class _Child:
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

    def observe(self, status_dir: str | None, code: int | None, printer: _Printer) -> None:
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
                pass  # already reaped by _stop
            self.exited_at = time.monotonic()

        threading.Thread(target=wait, name=f"substrax-wait-p{self.index}", daemon=True).start()

    def exit_code(self) -> int | None:
        """The exit code (minus the signal that killed it), or None while it runs.

        The child is left unreaped (a zombie) until ``_stop``: the first child's pid is
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


def _start(
    index: int, script: str, args: Sequence[str], env: dict[str, str], group: int, printer: _Printer
) -> _Child:
    proc = subprocess.Popen(
        [sys.executable, script, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=group,  # 0: a new group, led by this child
    )
    child = _Child(index, proc, [])

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


def _stop(children: Sequence[_Child], grace_s: float) -> None:
    """End the run's process group: SIGTERM, up to ``grace_s``, SIGKILL; then reap."""
    if not children:
        return
    group = children[0].proc.pid
    _signal_group(group, signal.SIGTERM)
    _signal_group(group, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    deadline = time.monotonic() + grace_s
    while any(c.exit_code() is None for c in children) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _signal_group(group, signal.SIGKILL)  # also whatever a script started and left behind
    for child in children:
        child.proc.wait()
        child.join_readers(1.0)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


IDLE_EXIT_CODE = 124  # as timeout(1) exits


def _first_failure(children: Sequence[_Child], codes: Sequence[int | None]) -> tuple[_Child, int] | None:
    """The child that failed first, with its code: one failure often brings down its peers."""
    failed = [(c, code) for c, code in zip(children, codes, strict=True) if code not in (None, 0)]
    if not failed:
        return None
    return min(failed, key=lambda pair: (pair[0].exited_at is None, pair[0].exited_at or 0.0, pair[0].index))


def _names(children: Sequence[_Child]) -> str:
    names = [f"process {c.index}" for c in children]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _causes(children: Sequence[_Child], until: float, now: float, failed: _Child | None = None) -> list[str]:
    """Who had stalled (is stopped) or left early (its script ended, or it exited 0, before
    ``until`` while another ran on): the likelier cause of a failure (of ``failed``) or a hang."""
    said = [
        f"{c.name} stalled: it has been stopped (SIGSTOP, or a debugger) for "
        f"{now - c.stopped_since:.1f} s, and its peers cannot go on without it"
        for c in children
        if c.stopped_since is not None
    ]
    left = [c for c in children if c.finished_at is not None and c.finished_at <= until]
    if left and len(left) < len(children):
        ran_on = _names([c for c in children if c not in left])
        said += [
            f"{'it' if c is failed else c.name} left early: its script ended "
            f"{now - (c.finished_at or now):.1f} s ago, while "
            f"{ran_on} ran on, and a collective waiting for a process that left never completes "
            f"(if {ran_on} only worked on alone, raise --shutdown-timeout)"
            for c in left
        ]
    return said


def _failure_report(child: _Child, code: int, children: Sequence[_Child]) -> str:
    now = time.monotonic()
    causes = _causes(children, child.exited_at or now, now, child)
    said = f"{child.name} {_describe_exit(code)}"
    if causes:
        said += ", probably because " + "; and ".join(causes)
    return said + "; stopping the other processes."


def _idle_report(
    children: Sequence[_Child], codes: Sequence[int | None], idle_timeout_s: float
) -> str | None:
    """What the run waited for, when no running child has printed a line for ``idle_timeout_s``."""
    now = time.monotonic()
    running = [c for c, code in zip(children, codes, strict=True) if code is None]
    last = [c.last_output_at or c.started_at for c in running]
    if not running or now - max(last) < idle_timeout_s:
        return None

    def state(c: _Child) -> str:
        said = f"last line {now - c.last_output_at:.0f} s ago" if c.last_output_at else "printed nothing"
        if c.stopped_since is not None:
            said += f", stopped for {now - c.stopped_since:.0f} s"
        elif c.finished_at is not None:
            said += f", its script ended {now - c.finished_at:.0f} s ago"
        return f"p{c.index} (pid {c.proc.pid}, {said})"

    causes = _causes(children, now, now)
    return (
        f"no process printed a line for {idle_timeout_s:g} s (--idle-timeout); waited for output "
        f"from {', '.join(state(c) for c in running)}: "
        + ("; ".join(causes) + ". " if causes else "")
        + "A process may be hung, or its peers blocked in a collective waiting for it. Stopping "
        "every process; raise --idle-timeout (0: no bound) for a script that is silent for longer."
    )


@dataclass
class _Ending:
    code: int  # what the launcher exits with
    wind_down: bool = False  # whether the children get --grace to save and end (else: stopped at once)
    forward: bool = False  # whether SIGTERM is passed on to them first


def _observe(children: Sequence[_Child], status_dir: str | None, printer: _Printer) -> list[int | None]:
    codes = [c.exit_code() for c in children]
    for child, code in zip(children, codes, strict=True):
        child.observe(status_dir, code, printer)
    return codes


def _watch(
    children: Sequence[_Child],
    printer: _Printer,
    signals: _Signals,
    idle_timeout_s: float | None,
    grace_s: float,
    status_dir: str | None,
) -> _Ending:
    """Wait until every child exits 0 (0), one fails (its code), one exits 143 after a
    SIGTERM (143, the others given ``grace_s`` to end), the run is idle for
    ``idle_timeout_s`` (124) or a signal comes (128 + it, passed on as SIGTERM)."""
    while True:
        if signals.received is not None:
            printer.say(
                f"got {signal.Signals(signals.received).name}; passing SIGTERM on to every process: "
                f"they have {grace_s:g} s (--grace) to save and end. Another signal kills them at once."
            )
            return _Ending(128 + signals.received, wind_down=True, forward=True)
        codes = _observe(children, status_dir, printer)
        if all(code == 0 for code in codes):
            return _Ending(0)
        failure = _first_failure(children, codes)
        if failure is not None:
            child, code = failure
            child.join_readers(1.0)  # its last words (the traceback) before ours
            if code == TERMINATED:
                printer.say(
                    f"{child.name} exited with code {code}: it ended on a SIGTERM (after saving its "
                    f"step, if a CheckpointManager was open); the others have {grace_s:g} s (--grace) "
                    f"to end too."
                )
                return _Ending(code, wind_down=True)
            printer.say(_failure_report(child, code, children))
            return _Ending(code if code > 0 else 128 - code)
        report = None if idle_timeout_s is None else _idle_report(children, codes, idle_timeout_s)
        if report is not None:
            printer.say(report)
            return _Ending(IDLE_EXIT_CODE)
        time.sleep(POLL_S)


def _wind_down(
    children: Sequence[_Child],
    printer: _Printer,
    signals: _Signals,
    grace_s: float,
    forward: bool,
    status_dir: str | None,
) -> bool:
    """Give the children up to ``grace_s`` to end by themselves (passing SIGTERM on first if
    ``forward``); a signal then passes SIGTERM on if it was not, or else ends the wait.

    Returns:
      Whether they all ended; if not, they have had their grace and are to be killed.
    """
    group = children[0].proc.pid
    if forward:
        _signal_group(group, signal.SIGTERM)
        _signal_group(group, signal.SIGCONT)
    seen = signals.count
    deadline = time.monotonic() + grace_s
    while True:
        codes = _observe(children, status_dir, printer)
        running = [c for c, code in zip(children, codes, strict=True) if code is None]
        if not running:
            return True
        if signals.count > seen:
            name = signal.Signals(signals.last).name if signals.last else "a signal"
            if forward:
                printer.say(f"got {name} again; killing every process now.")
                return False
            printer.say(f"got {name}; passing SIGTERM on to every process.")
            forward, seen = True, signals.count
            _signal_group(group, signal.SIGTERM)
            _signal_group(group, signal.SIGCONT)
        if time.monotonic() >= deadline:
            printer.say(
                f"{_names(running)} had not ended {grace_s:g} s later (--grace); killing "
                f"{'it' if len(running) == 1 else 'them'}."
            )
            return False
        time.sleep(POLL_S)


@contextlib.contextmanager
def _status_dir() -> Iterator[str]:
    """A private directory where the children note what they did (see ``_child``)."""
    path = tempfile.mkdtemp(prefix="substrax-launch-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _warn_never_initialized(children: Sequence[_Child], printer: _Printer) -> None:
    never = [c for c in children if not c.initialized]
    if not never:
        return
    every = len(never) == len(children)
    printer.say(
        f"warning: {'no process' if every else _names(never)} called substrax.launch.initialize()"
        + ("" if every else " (the others did)")
        + ": each such process ran as a JAX job of its own, on its own devices, sharing nothing "
        "with the others. Call substrax.launch.initialize() first thing in the script."
    )


def _check_seconds(name: str, value: object, *, positive: bool, none: bool = False) -> None:
    if none and value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or value < 0
        or (positive and value == 0)
    ):
        what = "a positive number of seconds" if positive else "a number of seconds, 0 or more"
        raise ValueError(f"{name} must be {what}{' or None' if none else ''}; got {value!r}.")


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    num_processes: int,
    devices_per_process: int,
    grace_s: float = GRACE_S,
    shutdown_timeout_s: int = _env.DEFAULT_SHUTDOWN_TIMEOUT_S,
    idle_timeout_s: float | None = IDLE_TIMEOUT_S,
) -> int:
    """Run ``python script *args`` as ``num_processes`` JAX processes on this machine.

    Each child learns its place from ``SUBSTRAX_*`` variables, which
    ``substrax.launch.initialize()`` reads. Every line a child prints, to stdout or
    stderr, is passed on to the same stream under ``[p<i>] ``; the launcher's own lines
    (the children's pids, who failed) go to stderr under ``[launch] ``. When the run
    ends, however it ends, nothing the children started is left running. When every
    process exits 0 but one never called ``substrax.launch.initialize()`` (so it ran as
    a JAX job of its own), the launcher says so on stderr.

    Args:
      script: The Python script each process runs, with ``sys.executable``.
      args: Its command-line arguments, the same for every process.
      num_processes: How many processes to start.
      devices_per_process: How many CPU devices each process emulates.
      grace_s: How long the children have to end after the launcher passes on a
        SIGTERM (when it gets SIGINT, SIGTERM or SIGHUP), or after one child exits 143
        (a SIGTERM sent to it alone): time for a ``CheckpointManager`` to save the step
        at hand and exit 143. Then they are killed. After a failure or an idle timeout
        the others are stopped with ``min(grace_s, STOP_GRACE_S)`` (3 s): a run that
        lost a process can save nothing.
      shutdown_timeout_s: How long JAX's shutdown barrier waits, when one process ends,
        for the others to end too before every process aborts. Only a process that
        ends cleanly (or with ``sys.exit(0)``) waits there: one that raises or calls
        ``sys.exit`` with another code skips it.
      idle_timeout_s: End the run when no running process has printed a line for this
        many seconds (a hung process, and its peers blocked in a collective waiting for
        it, print nothing); the message names each process, when it last printed, and
        whether it is stopped or its script has ended. The default, 30 minutes, bounds
        a hang even when nobody watches, yet leaves room for a long silent compile or
        evaluation; ``None``: no bound, for scripts that are silent for longer.

    Returns:
      0 when every process exited 0; else the exit code of the process that failed
      first (128 + the signal number when a signal killed it; 143 when it saved and
      ended on a SIGTERM), 124 when the run was idle for ``idle_timeout_s``, or 128 +
      the signal number when the launcher itself got SIGINT, SIGTERM or SIGHUP.

    Raises:
      ValueError: If ``num_processes``, ``devices_per_process`` or
        ``shutdown_timeout_s`` is not a positive int, ``grace_s`` is negative or not a
        number, ``idle_timeout_s`` is not a positive number or ``None``, or ``script``
        is not a file.
    """
    for name, value in (
        ("num_processes", num_processes),
        ("devices_per_process", devices_per_process),
        ("shutdown_timeout_s", shutdown_timeout_s),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}.")
    _check_seconds("grace_s", grace_s, positive=False)
    _check_seconds("idle_timeout_s", idle_timeout_s, positive=True, none=True)
    if not os.path.isfile(script):
        raise ValueError(f"Script {script!r} is not a file; give the path of the Python script to run.")

    printer = _Printer()
    children: list[_Child] = []
    stop_grace_s = min(grace_s, STOP_GRACE_S)
    with _reserved_port() as port, _status_dir() as status_dir, _Signals().noted() as signals:
        coordinator = f"127.0.0.1:{port}"
        env = {
            **os.environ,
            _env.COORDINATOR: coordinator,
            _env.NUM_PROCESSES: str(num_processes),
            _env.DEVICES_PER_PROCESS: str(devices_per_process),
            _env.SHUTDOWN_TIMEOUT: str(shutdown_timeout_s),
            _env.LAUNCHER_PID: str(os.getpid()),
            _env.STATUS_DIR: status_dir,
            "PYTHONUNBUFFERED": "1",  # lines arrive as they are printed
        }
        try:
            for i in range(num_processes):
                if signals.received is None:
                    group = children[0].proc.pid if children else 0
                    child_env = {**env, _env.PROCESS_ID: str(i)}
                    children.append(_start(i, script, args, child_env, group, printer))
            pids = ", ".join(f"p{c.index} pid {c.proc.pid}" for c in children)
            printer.say(f"started {len(children)} processes ({pids}); coordinator {coordinator}")
            if not children:
                return 128 + (signals.received or signal.SIGTERM)
            ending = _watch(children, printer, signals, idle_timeout_s, grace_s, status_dir)
            if ending.wind_down:
                if not _wind_down(children, printer, signals, grace_s, ending.forward, status_dir):
                    stop_grace_s = 0.0  # they have had their grace
            elif ending.code == 0:
                _warn_never_initialized(children, printer)
            return ending.code
        finally:
            _stop(children, stop_grace_s)
