"""Start N copies of a script on this machine, stream their output, end them together.

Three rules keep a local multi-process run from hanging:

- Every child runs in its own session (and so its own process group), and is ended by
  signalling the group: SIGTERM, a short grace, then SIGKILL. JAX catches SIGTERM in
  multi-process runs and a failed process can sit in the distributed shutdown barrier,
  so SIGTERM alone is not enough.
- The first child to exit non-zero ends the run: the others are stopped and the
  launcher exits with that child's code, naming it.
- Ctrl-C, SIGTERM or SIGHUP to the launcher stops every child before it exits.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import BinaryIO

from substrax.launch import _env

GRACE_S = 3.0
POLL_S = 0.05


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    The coordinator binds it a moment later; only loopback is ever used, so the
    coordinator is never reachable from another machine.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: object) -> None:
    raise _Interrupted(signum)


class _Printer:
    """Writes whole lines from every child, each under its prefix, one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, stream: BinaryIO, prefix: bytes, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        with self._lock:
            try:
                stream.write(prefix + line)
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # Our own output is gone (a closed pipe); keep draining the child's.

    def pump(self, pipe: BinaryIO, stream: BinaryIO, prefix: bytes) -> None:
        with pipe:
            for line in iter(pipe.readline, b""):
                self.write(stream, prefix, line)

    def say(self, text: str) -> None:
        self.write(sys.stderr.buffer, b"[launch] ", text.encode())


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # The child leads its own session, so its pid is its group id; while it is not
    # reaped the id cannot have been reused.
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """End every child still running: SIGTERM to its group, then SIGKILL after ``grace_s``."""
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def launch(
    script: str,
    args: Sequence[str] = (),
    *,
    num_processes: int,
    devices_per_process: int,
    grace_s: float = GRACE_S,
    shutdown_timeout_s: int = 20,
) -> int:
    """Run ``python script *args`` as ``num_processes`` JAX processes on this machine.

    Each child learns its place from ``SUBSTRAX_*`` variables, which
    ``substrax.launch.initialize()`` reads. Every line a child prints, to stdout or
    stderr, is passed on to the same stream under ``[p<i>] ``; the launcher's own lines
    go to stderr under ``[launch] ``.

    Args:
      script: The Python script each process runs, with ``sys.executable``.
      args: Its command-line arguments, the same for every process.
      num_processes: How many processes to start.
      devices_per_process: How many CPU devices each process emulates.
      grace_s: How long a child has to exit after SIGTERM before it is killed.
      shutdown_timeout_s: How long JAX's shutdown barrier waits for the other processes
        when one ends; a process that exits with an error skips it.

    Returns:
      0 when every process exited 0; else the first failed process's exit code (128 +
      the signal number when a signal killed it), or 128 + the signal number when the
      launcher itself was interrupted.

    Raises:
      ValueError: If ``num_processes`` or ``devices_per_process`` is not a positive
        int, or ``script`` is not a file.
    """
    for name, value in (("num_processes", num_processes), ("devices_per_process", devices_per_process)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}.")
    if not os.path.isfile(script):
        raise ValueError(f"Script {script!r} is not a file; give the path of the Python script to run.")

    coordinator = f"127.0.0.1:{free_port()}"
    printer = _Printer()
    procs: list[subprocess.Popen] = []
    readers: list[list[threading.Thread]] = []
    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_interrupted) for s in handled} if in_main_thread else {}
    try:
        for i in range(num_processes):
            env = dict(os.environ)
            env.update(
                {
                    _env.COORDINATOR: coordinator,
                    _env.NUM_PROCESSES: str(num_processes),
                    _env.PROCESS_ID: str(i),
                    _env.DEVICES_PER_PROCESS: str(devices_per_process),
                    _env.SHUTDOWN_TIMEOUT: str(shutdown_timeout_s),
                    _env.LAUNCHER_PID: str(os.getpid()),
                    "PYTHONUNBUFFERED": "1",  # lines arrive as they are printed
                }
            )
            proc = subprocess.Popen(
                [sys.executable, script, *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(proc)
            prefix = f"[p{i}] ".encode()
            threads = [
                threading.Thread(target=printer.pump, args=(pipe, stream, prefix), daemon=True)
                for pipe, stream in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer))
            ]
            for t in threads:
                t.start()
            readers.append(threads)
        pids = ", ".join(f"p{i} pid {p.pid}" for i, p in enumerate(procs))
        printer.say(f"started {num_processes} processes ({pids}), coordinator {coordinator}")

        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                for t in readers[failed]:
                    t.join(timeout=1.0)  # its last words (the traceback) before ours
                code = codes[failed]
                others = sum(c is None for c in codes)
                printer.say(
                    f"process {failed} (pid {procs[failed].pid}) {_describe_exit(code)}; "
                    f"stopping the {others} still running."
                )
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(POLL_S)
    except _Interrupted as e:
        printer.say(f"got {e}; stopping all {len(procs)} processes.")
        return 128 + e.signum
    finally:
        for s in handled if in_main_thread else ():
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        _stop(procs, grace_s)
        for threads in readers:
            for t in threads:
                t.join(timeout=1.0)  # a grandchild may hold a pipe open; do not wait on it
        for s, handler in previous.items():
            signal.signal(s, handler)
