"""What a process the launcher started sets up for itself, before JAX starts."""

from __future__ import annotations

import atexit
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import jax

from substrax.launch import _env
from substrax.launch._env import LaunchEnv
from substrax.mesh import use_cpu_devices

# A peer killed behind the launcher's back (by the OOM killer, say) is noticed in this
# many seconds rather than JAX's default 100.
HEARTBEAT_TIMEOUT_S = 30


def initialize_launched(env: LaunchEnv) -> None:
    """Join the local run ``env`` describes: CPU devices, gloo, the 127.0.0.1 coordinator.

    Raises:
      RuntimeError: If a JAX backend is already running.
    """
    from jax._src import xla_bridge  # The only way to ask without starting a backend.

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "substrax.launch.initialize() came after JAX started its backend, too late to "
            "set up the CPU devices and join the other processes. Call it first thing in "
            "the script, before creating any array."
        )
    jax.config.update("jax_platforms", "cpu")
    use_cpu_devices(env.devices_per_process)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _set_if_known("jax_enable_preemption_service", False)  # it would swallow our SIGTERM
    end_if_orphaned = _follow_launcher(env.launcher_pid)
    exit_code = None
    if env.num_processes > 1:
        _exit_at_once_on_uncaught_exception(before_exit=end_if_orphaned)
        exit_code = _watch_system_exit()
    jax.distributed.initialize(
        coordinator_address=env.coordinator_address,
        num_processes=env.num_processes,
        process_id=env.process_id,
        **_accepted_by(
            jax.distributed.initialize,
            # JAX's default binds every interface; the launcher's address is loopback.
            coordinator_bind_address=env.coordinator_address,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
            shutdown_timeout_seconds=env.shutdown_timeout_s,
        ),
    )
    _tell_launcher(env, _env.INITIALIZED)
    # Registered after JAX's own exit handlers, so these run before them (atexit is LIFO):
    # before the shutdown barrier, where a process that ended early waits for its peers.
    atexit.register(_tell_launcher_finished, env, exit_code)
    if exit_code is not None:
        atexit.register(_exit_at_once_on_failed_exit, exit_code, end_if_orphaned)


def _tell_launcher(env: LaunchEnv, event: str) -> None:
    """Leave ``event`` (``initialized``, ``finished``) as a file where the launcher looks."""
    if env.status_dir is None:
        return
    try:
        with open(_env.status_file(env.status_dir, env.process_id, event), "w"):
            pass
    except OSError:
        pass  # the launcher is gone, or the variables were copied from another run


def _tell_launcher_finished(env: LaunchEnv, exit_code: Callable[[], int | str | None] | None) -> None:
    """At exit, tell the launcher the script ended cleanly (not with a failing ``sys.exit``)."""
    code = exit_code() if exit_code is not None else None
    if code is None or code == 0:
        _tell_launcher(env, _env.FINISHED)


def _accepted_by(fn: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes; older JAX releases lack some timeouts."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _set_if_known(name: str, value: Any) -> None:
    try:
        jax.config.update(name, value)
    except AttributeError:
        pass  # an older JAX without this option


def _exit_at_once_on_uncaught_exception(before_exit: Callable[[], None]) -> None:
    # A process that raises would otherwise wait in JAX's shutdown barrier, at exit,
    # for peers that may be blocked in a collective waiting for it.
    print_traceback = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        print_traceback(exc_type, exc, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        before_exit()
        os._exit(1)

    sys.excepthook = hook


def _watch_system_exit() -> Callable[[], int | str | None] | None:
    """Watch for the main thread's SystemExit (``sys.monitoring``); its code's reader, or None."""
    monitoring = sys.monitoring
    tool = next((t for t in range(5, -1, -1) if monitoring.get_tool(t) is None), None)
    if tool is None:
        return None
    main = threading.main_thread().ident
    in_flight: list[SystemExit] = []

    def raised(code: object, offset: int, exc: BaseException) -> None:
        if isinstance(exc, SystemExit) and threading.get_ident() == main:
            in_flight[:] = [exc]

    def handled(code: object, offset: int, exc: BaseException) -> None:
        if isinstance(exc, SystemExit) and threading.get_ident() == main:
            in_flight.clear()

    events = monitoring.events
    monitoring.use_tool_id(tool, "substrax.launch")
    monitoring.register_callback(tool, events.RAISE, raised)
    monitoring.register_callback(tool, events.RERAISE, raised)
    monitoring.register_callback(tool, events.EXCEPTION_HANDLED, handled)
    monitoring.set_events(tool, events.RAISE | events.RERAISE | events.EXCEPTION_HANDLED)
    return lambda: in_flight[0].code if in_flight else None


def _exit_at_once_on_failed_exit(
    exit_code: Callable[[], int | str | None], before_exit: Callable[[], None]
) -> None:
    """At exit, end the process at once on a non-zero ``SystemExit``; a clean one waits at JAX's barrier."""
    code = exit_code()
    if code is None or code == 0:
        return
    if not isinstance(code, int):
        print(code, file=sys.stderr)  # what Python prints for sys.exit("message")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    before_exit()
    os._exit(code & 0xFF)


def _follow_launcher(launcher_pid: int | None) -> Callable[[], None]:
    """End the run's process group when the launcher is gone (a thread, every 0.5 s); returns the check."""
    if launcher_pid is None or os.getppid() != launcher_pid:
        return lambda: None  # started by hand or through a wrapper: nothing to follow
    run_group = os.getpgrp()
    if run_group == os.getpgid(launcher_pid):
        return lambda: None  # sharing the launcher's group, killing it would hit the shell

    def end_if_orphaned() -> None:
        if os.getppid() != launcher_pid:
            os.killpg(run_group, signal.SIGKILL)

    def watch() -> None:
        while True:
            end_if_orphaned()
            time.sleep(0.5)

    threading.Thread(target=watch, name="substrax-follow-launcher", daemon=True).start()
    atexit.register(end_if_orphaned)
    return end_if_orphaned
