"""What the launcher says when a run fails, hangs, or ran without ``initialize()``."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence

from substrax.launch._processes import Child


def first_failure(children: Sequence[Child], codes: Sequence[int | None]) -> tuple[Child, int] | None:
    """The child that failed first, with its code: one failure often brings down its peers."""
    failed = [(c, code) for c, code in zip(children, codes, strict=True) if code not in (None, 0)]
    if not failed:
        return None
    return min(failed, key=lambda pair: (pair[0].exited_at is None, pair[0].exited_at or 0.0, pair[0].index))


def names(children: Sequence[Child]) -> str:
    """The children named in words: "process 0", "process 0 and process 1", ..."""
    said = [f"process {c.index}" for c in children]
    return said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _causes(children: Sequence[Child], until: float, now: float, failed: Child | None = None) -> list[str]:
    """Who had stalled or left early (before ``until``, while another ran on): the likelier cause."""
    said = [
        f"{c.name} stalled: it has been stopped (SIGSTOP, or a debugger) for "
        f"{now - c.stopped_since:.1f} s, and its peers cannot go on without it"
        for c in children
        if c.stopped_since is not None
    ]
    left = [c for c in children if c.finished_at is not None and c.finished_at <= until]
    if left and len(left) < len(children):
        ran_on = names([c for c in children if c not in left])
        said += [
            f"{'it' if c is failed else c.name} left early: its script ended "
            f"{now - (c.finished_at or now):.1f} s ago, while "
            f"{ran_on} ran on, and a collective waiting for a process that left never completes "
            f"(if {ran_on} only worked on alone, raise --shutdown-timeout)"
            for c in left
        ]
    return said


def failure_report(child: Child, code: int, children: Sequence[Child]) -> str:
    """Who failed, how, and probably why; the others are about to be stopped."""
    now = time.monotonic()
    causes = _causes(children, child.exited_at or now, now, child)
    said = f"{child.name} {_describe_exit(code)}"
    if causes:
        said += ", probably because " + "; and ".join(causes)
    return said + "; stopping the other processes."


def idle_report(children: Sequence[Child], codes: Sequence[int | None], idle_timeout_s: float) -> str | None:
    """Who went quiet, when no running child has printed a line for ``idle_timeout_s``.

    The running processes are named quietest first (index, pid, how long since each
    printed a line, or since it started if it never did), with what else is known of
    them: stopped, or its script ended.
    """
    now = time.monotonic()
    running = [c for c, code in zip(children, codes, strict=True) if code is None]
    if not running:
        return None
    quiet = {c.index: now - (c.last_output_at or c.started_at) for c in running}
    if min(quiet.values()) < idle_timeout_s:
        return None

    def state(c: Child) -> str:
        said = (
            f"{c.name}, no line for {quiet[c.index]:.0f} s"
            if c.last_output_at
            else f"{c.name}, no line since it started {quiet[c.index]:.0f} s ago"
        )
        if c.stopped_since is not None:
            said += f" (stopped for {now - c.stopped_since:.0f} s)"
        elif c.finished_at is not None:
            said += f" (its script ended {now - c.finished_at:.0f} s ago)"
        return said

    quietest = sorted(running, key=lambda c: (-quiet[c.index], c.index))
    first = len(quietest) > 1 and quiet[quietest[0].index] - quiet[quietest[1].index] >= 1.0
    causes = _causes(children, now, now)
    return (
        f"no process printed a line for {idle_timeout_s:g} s (--idle-timeout): "
        f"{state(quietest[0])}{', the first to go quiet' if first else ''}"
        + "".join(f"; {state(c)}" for c in quietest[1:])
        + ". "
        + ("; ".join(causes) + ". " if causes else "")
        + "A process may be hung, or its peers blocked in a collective waiting for it. Stopping "
        "every process; raise --idle-timeout (0: no bound) for a script that is silent for longer."
    )


def never_initialized_warning(children: Sequence[Child]) -> str | None:
    """A warning naming the processes that never called ``initialize()``; None when all did."""
    never = [c for c in children if not c.initialized]
    if not never:
        return None
    every = len(never) == len(children)
    return (
        f"warning: {'no process' if every else names(never)} called substrax.launch.initialize()"
        + ("" if every else " (the others did)")
        + ": each such process ran as a JAX job of its own, on its own devices, sharing nothing "
        "with the others. Call substrax.launch.initialize() first thing in the script."
    )
