"""Run one training script as several JAX processes: locally, or on a cluster.

On this machine::

    python -m substrax.launch --num-processes 2 --devices-per-process 4 train.py --steps 100

starts two processes of ``python train.py --steps 100``, each with 4 emulated CPU
devices, joined into one 8-device JAX system. The script calls ``initialize()`` first
thing; on a cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) the same call joins the
cluster's processes instead, and run alone it does nothing. The training step does not
change: each process loads its rows of the global batch (``process_slice``) and
``substrax.spmd.place_batch_on_shards`` assembles the global array.
"""

from __future__ import annotations

import jax

from substrax.launch._child import initialize_launched
from substrax.launch._env import detect_cluster, launch_env
from substrax.launch._launcher import launch
from substrax.launch._port import free_port

__all__ = ["free_port", "initialize", "launch", "process_slice"]


def initialize(*, distributed: bool | None = None) -> None:
    """Join this process to its peers, if it has any; call it first thing in the script.

    It must run before anything touches a JAX backend (before the first array). What
    it does depends on where the script runs, checked in this order:

    1. Started by ``python -m substrax.launch`` (the ``SUBSTRAX_*`` variables are set):
       runs on the CPU (``jax_platforms="cpu"``) with ``--devices-per-process`` emulated
       devices, uses gloo for cross-process CPU collectives, and calls
       ``jax.distributed.initialize`` with the launcher's coordinator on 127.0.0.1, its
       process count and this process's id. It also shortens JAX's heartbeat (30 s)
       and shutdown-barrier (``--shutdown-timeout``) waits, turns off JAX's preemption
       service (which would swallow the launcher's SIGTERM even where nothing saves; an
       open ``substrax.checkpoint.CheckpointManager`` catches SIGTERM itself, and its
       ``save`` has every process save the same step and exit 143), makes an uncaught
       exception (code 1) or a ``sys.exit`` with a non-zero code (that code) end the
       process at once instead of waiting for its peers at the shutdown barrier, and
       ends the process if the launcher dies. It tells the launcher (a file in the
       launcher's status directory) that it joined, and at exit that the script ended,
       so the launcher can warn of a script that never calls ``initialize()`` and name
       a process that left its peers early.
    2. ``distributed=True``, or ``distributed=None`` and one of these holds:
       ``JAX_COORDINATOR_ADDRESS`` is set; SLURM runs more than one task
       (``SLURM_NTASKS`` > 1 inside an ``srun`` step, with ``SLURM_JOB_ID``,
       ``SLURM_STEP_NODELIST``, ``SLURM_PROCID`` and ``SLURM_LOCALID`` set); Open MPI
       runs more than one rank (``OMPI_COMM_WORLD_SIZE`` > 1); a Kubernetes indexed
       Job's pod (``KUBERNETES_SERVICE_HOST`` and ``JOB_COMPLETION_INDEX``); a
       multi-host Cloud TPU (``TPU_WORKER_HOSTNAMES`` lists several hosts, or
       ``MEGASCALE_COORDINATOR_ADDRESS`` is set): calls ``jax.distributed.initialize()``
       with no arguments, so JAX finds the coordinator, process count and id itself.
       Where JAX can find its peers but none of these is set (a Cloud TPU VM whose
       hosts are listed only in its metadata, say), pass ``distributed=True``.
    3. Otherwise (or ``distributed=False``): nothing. JAX runs as one process on all
       its local devices.

    A second call, once JAX's distributed system is up, does nothing.

    Args:
      distributed: Outside the launcher, whether to call ``jax.distributed.initialize()``:
        ``None`` (the default) decides from the environment as above.

    Raises:
      RuntimeError: Under the launcher, if a JAX backend is already running (the call
        came too late), or the ``SUBSTRAX_*`` variables are incomplete.
    """
    if jax.distributed.is_initialized():
        return
    env = launch_env()
    if env is not None:
        initialize_launched(env)
    elif distributed or (distributed is None and detect_cluster() is not None):
        jax.distributed.initialize()


def process_slice(global_size: int) -> slice:
    """The rows of a global batch that this process loads: its block, in process order.

    ``place_batch_on_shards`` stitches the processes' rows together in process order,
    so process ``i`` of ``n`` loads rows ``[i * global_size // n, (i + 1) * global_size // n)``.
    On a single process that is every row.

    Args:
      global_size: The global batch's number of rows.

    Returns:
      The slice of rows this process loads.

    Raises:
      ValueError: If ``global_size`` does not divide by the number of processes.
    """
    count, index = jax.process_count(), jax.process_index()
    if global_size % count:
        raise ValueError(
            f"A global batch of {global_size} rows does not split evenly over {count} "
            f"processes; make it a multiple of {count}."
        )
    per_process = global_size // count
    return slice(index * per_process, (index + 1) * per_process)
