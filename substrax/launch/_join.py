"""How a script joins its run: ``initialize`` (under the launcher, on a cluster, or alone) and
the rows each process loads (``process_slice``)."""

from __future__ import annotations

import jax

from substrax.launch._child import initialize_launched
from substrax.launch._env import detect_cluster, launch_env

__all__ = ["initialize", "process_slice"]


def initialize(*, distributed: bool | None = None) -> None:
    """Join this process to its peers, if it has any; call it first thing in the script.

    It must run before anything touches a JAX backend. Under ``python -m substrax.launch``
    it joins the launcher's run (emulated CPU devices, gloo, a coordinator on 127.0.0.1);
    on a cluster it recognises (SLURM, Open MPI, Kubernetes, Cloud TPU,
    ``JAX_COORDINATOR_ADDRESS``) it calls ``jax.distributed.initialize()``; otherwise it
    does nothing. A second call does nothing. See the processes guide.

    Args:
      distributed: Outside the launcher, whether to call ``jax.distributed.initialize()``:
        ``None`` (the default) decides from the environment.

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
    """The rows of a global batch this process loads: its block, in process order.

    Process ``i`` of ``n`` loads ``[i * global_size // n, (i + 1) * global_size // n)``.

    Args:
      global_size: The global batch's number of rows.

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
