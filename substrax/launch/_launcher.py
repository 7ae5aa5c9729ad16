"""Start N copies of a script on this machine, stream their output, end them together.

Three rules keep a local multi-process run from hanging or leaving strays behind:

- The children run in a process group of their own, apart from the launcher's (so a
  Ctrl-C in the terminal reaches only the launcher), and the run is ended by signalling
  that group: SIGTERM, a short grace, then SIGKILL. JAX catches SIGTERM in multi-process
  runs and a failed process can sit in the distributed shutdown barrier, so SIGTERM
  alone is not enough. The group also holds whatever the scripts started, and one
  group for the whole run lets any child end all of it (see ``_child``).
- The first child to exit non-zero ends the run: the others are stopped and the
  launcher exits with that child's code, naming it.
- Ctrl-C, SIGTERM or SIGHUP to the launcher stops every child before it exits.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from substrax.launch import _env

GRACE_S = 3.0
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
    """Notes the first SIGINT, SIGTERM or SIGHUP; the watch loop acts on it.

    The handler only records: an exception raised from a handler can land anywhere in
    the main thread (inside a finalizer, where it is swallowed); a flag cannot be lost.
    """

    def __init__(self) -> None:
        self.received: int | None = None

    def note(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum

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


def _idle_report(
    children: Sequence[_Child], codes: Sequence[int | None], idle_timeout_s: float
) -> str | None:
    """What the run waited for, when no running child has printed a line for ``idle_timeout_s``."""
    now = time.monotonic()
    running = [c for c, code in zip(children, codes, strict=True) if code is None]
    last = [c.last_output_at or c.started_at for c in running]
    if not running or now - max(last) < idle_timeout_s:
        return None
    waited = ", ".join(
        f"p{c.index} (pid {c.proc.pid}, "
        + (f"last line {now - c.last_output_at:.0f} s ago" if c.last_output_at else "printed nothing")
        + ")"
        for c in running
    )
    return (
        f"no process printed a line for {idle_timeout_s:g} s (--idle-timeout); waited for output "
        f"from {waited}: a process may be hung, or its peers blocked in a collective waiting for "
        f"it. Stopping every process; raise --idle-timeout for a script that is silent for longer."
    )


def _watch(
    children: Sequence[_Child], printer: _Printer, signals: _Signals, idle_timeout_s: float | None
) -> int:
    """Wait until every child exits 0 (0), one fails (its code), the run is idle for
    ``idle_timeout_s`` (124) or a signal comes (128 + it)."""
    while True:
        if signals.received is not None:
            printer.say(f"got {signal.Signals(signals.received).name}; stopping every process.")
            return 128 + signals.received
        codes = [c.exit_code() for c in children]
        if all(code == 0 for code in codes):
            return 0
        failure = _first_failure(children, codes)
        if failure is not None:
            child, code = failure
            child.join_readers(1.0)  # its last words (the traceback) before ours
            printer.say(
                f"process {child.index} (pid {child.proc.pid}) {_describe_exit(code)}; "
                f"stopping the other processes."
            )
            return code if code > 0 else 128 - code
        report = None if idle_timeout_s is None else _idle_report(children, codes, idle_timeout_s)
        if report is not None:
            printer.say(report)
            return IDLE_EXIT_CODE
        time.sleep(POLL_S)


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    num_processes: int,
    devices_per_process: int,
    grace_s: float = GRACE_S,
    shutdown_timeout_s: int = _env.DEFAULT_SHUTDOWN_TIMEOUT_S,
    idle_timeout_s: float | None = None,
) -> int:
    """Run ``python script *args`` as ``num_processes`` JAX processes on this machine.

    Each child learns its place from ``SUBSTRAX_*`` variables, which
    ``substrax.launch.initialize()`` reads. Every line a child prints, to stdout or
    stderr, is passed on to the same stream under ``[p<i>] ``; the launcher's own lines
    (the children's pids, who failed) go to stderr under ``[launch] ``. When the run
    ends, however it ends, nothing the children started is left running.

    Args:
      script: The Python script each process runs, with ``sys.executable``.
      args: Its command-line arguments, the same for every process.
      num_processes: How many processes to start.
      devices_per_process: How many CPU devices each process emulates.
      grace_s: How long the children have after SIGTERM before they are killed.
      shutdown_timeout_s: How long JAX's shutdown barrier waits, when one process ends,
        for the others to end too before every process aborts. Only a process that
        ends cleanly (or with ``sys.exit(0)``) waits there: one that raises or calls
        ``sys.exit`` with another code skips it.
      idle_timeout_s: End the run when no running process has printed a line for this
        many seconds (a hung process, and its peers blocked in a collective waiting for
        it, print nothing); the message names each process and when it last printed.
        ``None`` (the default): no bound, for scripts that are silent for a long time.

    Returns:
      0 when every process exited 0; else the exit code of the process that failed
      first (128 + the signal number when a signal killed it), 124 when the run was
      idle for ``idle_timeout_s``, or 128 + the signal number when the launcher itself
      got SIGINT, SIGTERM or SIGHUP.

    Raises:
      ValueError: If ``num_processes`` or ``devices_per_process`` is not a positive
        int, ``idle_timeout_s`` is not a positive number or ``None``, or ``script`` is
        not a file.
    """
    for name, value in (("num_processes", num_processes), ("devices_per_process", devices_per_process)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}.")
    if idle_timeout_s is not None and (
        isinstance(idle_timeout_s, bool)
        or not isinstance(idle_timeout_s, (int, float))
        or idle_timeout_s <= 0
    ):
        raise ValueError(
            f"idle_timeout_s must be a positive number of seconds or None; got {idle_timeout_s!r}."
        )
    if not os.path.isfile(script):
        raise ValueError(f"Script {script!r} is not a file; give the path of the Python script to run.")

    printer = _Printer()
    children: list[_Child] = []
    with _reserved_port() as port, _Signals().noted() as signals:
        coordinator = f"127.0.0.1:{port}"
        env = {
            **os.environ,
            _env.COORDINATOR: coordinator,
            _env.NUM_PROCESSES: str(num_processes),
            _env.DEVICES_PER_PROCESS: str(devices_per_process),
            _env.SHUTDOWN_TIMEOUT: str(shutdown_timeout_s),
            _env.LAUNCHER_PID: str(os.getpid()),
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
            return _watch(children, printer, signals, idle_timeout_s)
        finally:
            _stop(children, grace_s)
