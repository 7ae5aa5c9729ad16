"""Start N copies of a script on this machine, stream their output, end them together.

The children share a process group of their own, ended as one (SIGTERM, a grace,
SIGKILL); the first to fail ends the run; a signal to the launcher passes on as SIGTERM
with ``--grace`` to save; an idle run is ended. See the processes guide, "The local
launcher".
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from substrax.launch import _env, _processes, _reports
from substrax.launch._output import Printer
from substrax.launch._port import reserved_port
from substrax.launch._processes import POLL_S, Child

GRACE_S = 30.0  # after a SIGTERM passed on: time to save a checkpoint and exit
STOP_GRACE_S = 3.0  # after a failure or a hang: nothing can be saved, so no more than this
IDLE_TIMEOUT_S = 1800.0  # by default a run silent for 30 minutes is taken for hung
TERMINATED = 128 + signal.SIGTERM  # 143: the exit code of a process that saved and ended on SIGTERM
IDLE_EXIT_CODE = 124  # as timeout(1) exits
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Signals:
    """Records SIGINT, SIGTERM, SIGHUP (first, last, count) for the watch loop; it acts on them."""

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


@dataclass
class _Ending:
    code: int  # what the launcher exits with
    wind_down: bool = False  # whether the children get --grace to save and end (else: stopped at once)
    forward: bool = False  # whether SIGTERM is passed on to them first


def _watch(
    children: Sequence[Child],
    printer: Printer,
    signals: _Signals,
    idle_timeout_s: float | None,
    grace_s: float,
    status_dir: str | None,
) -> _Ending:
    """Wait for all 0 (0), a failure (its code), a 143 (143), idleness (124) or a signal (128+)."""
    while True:
        if signals.received is not None:
            printer.say(
                f"got {signal.Signals(signals.received).name}; passing SIGTERM on to every process: "
                f"they have {grace_s:g} s (--grace) to save and end. Another signal kills them at once."
            )
            return _Ending(128 + signals.received, wind_down=True, forward=True)
        codes = _processes.observe(children, status_dir, printer)
        if all(code == 0 for code in codes):
            return _Ending(0)
        failure = _reports.first_failure(children, codes)
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
            printer.say(_reports.failure_report(child, code, children))
            return _Ending(code if code > 0 else 128 - code)
        report = None if idle_timeout_s is None else _reports.idle_report(children, codes, idle_timeout_s)
        if report is not None:
            printer.say(report)
            return _Ending(IDLE_EXIT_CODE)
        time.sleep(POLL_S)


def _wind_down(
    children: Sequence[Child],
    printer: Printer,
    signals: _Signals,
    grace_s: float,
    forward: bool,
    status_dir: str | None,
) -> bool:
    """Give the children ``grace_s`` to end (SIGTERM first if ``forward``); whether they all ended."""
    if forward:
        _processes.terminate(children)
    seen = signals.count
    deadline = time.monotonic() + grace_s
    while True:
        codes = _processes.observe(children, status_dir, printer)
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
            _processes.terminate(children)
        if time.monotonic() >= deadline:
            printer.say(
                f"{_reports.names(running)} had not ended {grace_s:g} s later (--grace); killing "
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


def _check_counts(**counts: object) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}.")


def _children_env(
    coordinator: str, num_processes: int, devices_per_process: int, shutdown_timeout_s: int, status_dir: str
) -> dict[str, str]:
    """The environment every child starts with (its ``SUBSTRAX_*`` variables but its index)."""
    return {
        **os.environ,
        _env.COORDINATOR: coordinator,
        _env.NUM_PROCESSES: str(num_processes),
        _env.DEVICES_PER_PROCESS: str(devices_per_process),
        _env.SHUTDOWN_TIMEOUT: str(shutdown_timeout_s),
        _env.LAUNCHER_PID: str(os.getpid()),
        _env.STATUS_DIR: status_dir,
        "PYTHONUNBUFFERED": "1",  # lines arrive as they are printed
    }


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

    Each child learns its place from ``SUBSTRAX_*`` variables (read by ``initialize()``);
    its lines are passed on under ``[p<i>] ``, the launcher's own on stderr under
    ``[launch] ``. Nothing the children started is left running. See the processes guide.

    Args:
      script: The Python script each process runs, with ``sys.executable``.
      args: Its command-line arguments, the same for every process.
      num_processes: How many processes to start.
      devices_per_process: How many CPU devices each process emulates.
      grace_s: How long the children have to end (to save and exit 143) after the
        launcher passes on a SIGTERM, or after one child exits 143; then they are killed.
        After a failure or an idle timeout it is ``min(grace_s, STOP_GRACE_S)`` (3 s).
      shutdown_timeout_s: How long JAX's shutdown barrier waits for the others when a
        process ends cleanly, before every process aborts.
      idle_timeout_s: End the run when no running process has printed a line for this
        many seconds (30 minutes by default), naming them quietest first; ``None``: no
        bound.

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
    _check_counts(
        num_processes=num_processes,
        devices_per_process=devices_per_process,
        shutdown_timeout_s=shutdown_timeout_s,
    )
    _check_seconds("grace_s", grace_s, positive=False)
    _check_seconds("idle_timeout_s", idle_timeout_s, positive=True, none=True)
    if not os.path.isfile(script):
        raise ValueError(f"Script {script!r} is not a file; give the path of the Python script to run.")

    printer = Printer()
    children: list[Child] = []
    stop_grace_s = min(grace_s, STOP_GRACE_S)
    with reserved_port() as port, _status_dir() as status_dir, _Signals().noted() as signals:
        coordinator = f"127.0.0.1:{port}"
        env = _children_env(coordinator, num_processes, devices_per_process, shutdown_timeout_s, status_dir)
        try:
            for i in range(num_processes):
                if signals.received is None:
                    group = children[0].proc.pid if children else 0
                    child_env = {**env, _env.PROCESS_ID: str(i)}
                    children.append(_processes.start(i, script, args, child_env, group, printer))
            pids = ", ".join(f"p{c.index} pid {c.proc.pid}" for c in children)
            printer.say(f"started {len(children)} processes ({pids}); coordinator {coordinator}")
            if not children:
                return 128 + (signals.received or signal.SIGTERM)
            ending = _watch(children, printer, signals, idle_timeout_s, grace_s, status_dir)
            if ending.wind_down:
                if not _wind_down(children, printer, signals, grace_s, ending.forward, status_dir):
                    stop_grace_s = 0.0  # they have had their grace
            elif ending.code == 0:
                warning = _reports.never_initialized_warning(children)
                if warning is not None:
                    printer.say(warning)
            return ending.code
        finally:
            _processes.stop(children, stop_grace_s)
