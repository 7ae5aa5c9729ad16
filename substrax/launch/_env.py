"""What the launcher tells each process (environment variables only), and where a process runs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

COORDINATOR = "SUBSTRAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "SUBSTRAX_NUM_PROCESSES"
PROCESS_ID = "SUBSTRAX_PROCESS_ID"
DEVICES_PER_PROCESS = "SUBSTRAX_DEVICES_PER_PROCESS"
SHUTDOWN_TIMEOUT = "SUBSTRAX_SHUTDOWN_TIMEOUT"
LAUNCHER_PID = "SUBSTRAX_LAUNCHER_PID"
STATUS_DIR = "SUBSTRAX_STATUS_DIR"  # where a process notes for the launcher what it did (see _child)

# JAX waits 300 s by default; a local run has no reason to wait more than this.
DEFAULT_SHUTDOWN_TIMEOUT_S = 20

# What a process notes in the status directory: an empty file p<i>.<event>.
INITIALIZED = "initialized"  # initialize() joined JAX's distributed runtime
FINISHED = "finished"  # the script ended cleanly; the process waits at JAX's shutdown barrier

REQUIRED = (COORDINATOR, NUM_PROCESSES, PROCESS_ID, DEVICES_PER_PROCESS)


@dataclass(frozen=True)
class LaunchEnv:
    """One process's place in a local launch, as the launcher wrote it."""

    coordinator_address: str
    num_processes: int
    process_id: int
    devices_per_process: int
    shutdown_timeout_s: int
    launcher_pid: int | None
    status_dir: str | None = None


def status_file(status_dir: str, process_id: int, event: str) -> str:
    """The file by which process ``process_id`` tells the launcher of ``event``."""
    return os.path.join(status_dir, f"p{process_id}.{event}")


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """Read the ``SUBSTRAX_*`` variables, or ``None`` when the launcher did not start us.

    Raises:
      RuntimeError: If only some of the variables are set, or one is not a number; the
        message names them.
    """
    env = os.environ if environ is None else environ
    present = [name for name in REQUIRED if name in env]
    if not present:
        return None
    missing = [name for name in REQUIRED if name not in env]
    if missing:
        raise RuntimeError(
            f"{', '.join(present)} set but {', '.join(missing)} not: these variables come "
            f"from `python -m substrax.launch`. Start the script with it, or unset them to "
            f"run as a single process."
        )
    try:
        return LaunchEnv(
            coordinator_address=env[COORDINATOR],
            num_processes=int(env[NUM_PROCESSES]),
            process_id=int(env[PROCESS_ID]),
            devices_per_process=int(env[DEVICES_PER_PROCESS]),
            shutdown_timeout_s=int(env.get(SHUTDOWN_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT_S)),
            launcher_pid=int(env[LAUNCHER_PID]) if LAUNCHER_PID in env else None,
            status_dir=env.get(STATUS_DIR) or None,
        )
    except ValueError as e:
        raise RuntimeError(f"A SUBSTRAX_* launch variable is not an integer: {e}.") from None


def _count(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env.get(name, "0"))
    except ValueError:
        return 0


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
    """Name the multi-process environment we run in, or ``None`` for a lone process.

    Each test is the evidence ``jax.distributed.initialize()`` needs to find its peers
    by itself, narrowed to more than one process, so that a single-task job or a
    notebook in a Kubernetes pod stays a plain single process.
    """
    env = os.environ if environ is None else environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        return "JAX (JAX_COORDINATOR_ADDRESS)"
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in env for name in slurm) and _count(env, "SLURM_NTASKS") > 1:
        return f"SLURM (SLURM_NTASKS={env['SLURM_NTASKS']})"
    if _count(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return f"Open MPI (OMPI_COMM_WORLD_SIZE={env['OMPI_COMM_WORLD_SIZE']})"
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        return "Kubernetes (an indexed Job's pod)"
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in env:
        return "Cloud TPU (several hosts)"
    return None
