"""``python -m substrax.launch``: run a script as several JAX processes on this machine."""

from __future__ import annotations

import argparse
import sys

from substrax.launch._env import DEFAULT_SHUTDOWN_TIMEOUT_S
from substrax.launch._launcher import GRACE_S, IDLE_TIMEOUT_S, STOP_GRACE_S, launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m substrax.launch",
        description=(
            "Start N processes of `python SCRIPT ARGS...` on this machine, each with K emulated "
            "CPU devices, joined into one JAX system (the script calls "
            "substrax.launch.initialize() first). Output lines carry a [p<i>] prefix. When one "
            "process fails, the others are stopped and its exit code is returned. SIGINT, SIGTERM "
            "or SIGHUP to the launcher is passed on to every process as SIGTERM, and they have "
            "--grace seconds to save a checkpoint (substrax.checkpoint.CheckpointManager) and "
            "exit 143; a second signal kills them at once."
        ),
    )
    parser.add_argument(
        "--num-processes", "-n", type=int, required=True, metavar="N", help="how many processes to start"
    )
    parser.add_argument(
        "--devices-per-process",
        "-d",
        type=int,
        default=1,
        metavar="K",
        help="how many emulated CPU devices each process has (default 1)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=GRACE_S,
        metavar="SECONDS",
        help=(
            "how long the processes have to save and end after a SIGTERM passed on to them (the "
            "launcher got SIGINT, SIGTERM or SIGHUP), or after one of them exits 143 (a SIGTERM sent "
            f"to it alone), before they are killed (default {GRACE_S:g}). After a failure or an "
            f"idle timeout they get at most {STOP_GRACE_S:g} s: a run that lost a process can "
            "save nothing"
        ),
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=int,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help=(
            "how long a process that has finished waits at JAX's shutdown barrier for the "
            f"others before all abort (default {DEFAULT_SHUTDOWN_TIMEOUT_S}); raise it if one "
            "process works on alone at the end"
        ),
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help=(
            "end the run (exit code 124) when no process has printed a line for this long: a hung "
            "process, and peers waiting for it in a collective, print nothing. The default, "
            f"{IDLE_TIMEOUT_S:g} (30 minutes), bounds a hang nobody watches; raise it for a script "
            "that is silent for longer, or give 0 for no bound"
        ),
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    try:
        return launch(
            ns.script,
            ns.args,
            num_processes=ns.num_processes,
            devices_per_process=ns.devices_per_process,
            grace_s=ns.grace,
            shutdown_timeout_s=ns.shutdown_timeout,
            idle_timeout_s=None if ns.idle_timeout == 0 else ns.idle_timeout,
        )
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
