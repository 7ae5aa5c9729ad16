"""Checkpoint faults in a process of their own (one CPU device, the MLP 256 wide, unplaced).

``python ckpt_fault_worker.py rotate DIR``: a manager keeping 2 steps saves steps 1 and 2,
then step 3, whose save rotates step 1 out. Every file deletion after that is fatal: at
the second one the process kills itself (SIGKILL), as a machine lost in the middle of
deleting the old step would. It prints ``KILLED <path>`` just before, or ``NOT KILLED``
if nothing was deleted.

``python ckpt_fault_worker.py sigterm DIR``: a manager saving every 100 steps saves step
1, then the state gets 1 added to every floating array at each step and is offered to
``save``; at step 4 the process sends itself SIGTERM just before that step's ``save``.
It prints ``STEP i`` at each step, and ``FINISHED`` if the loop ends.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import jax.numpy as jnp
import optax
from flax import nnx

from substrax import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import MLP  # noqa: E402


def build() -> tuple[MLP, nnx.Optimizer]:
    model = MLP(width=256, seed=0)  # as test_checkpoint_faults builds it
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def bump(model: MLP, optimizer: nnx.Optimizer) -> None:
    """Add 1 to every floating array of the state."""
    for _, variable in nnx.to_flat_state(nnx.state((model, optimizer))):
        value = variable.get_raw_value()
        if jnp.issubdtype(value.dtype, jnp.floating):
            variable.set_raw_value(value + 1)


def rotate(directory: str) -> None:
    model, optimizer = build()
    manager = checkpoint.CheckpointManager(directory, max_to_keep=2, async_save=False)
    manager.save(1, model, optimizer)
    manager.save(2, model, optimizer)
    unlink, deleted = os.unlink, []

    def fatal_unlink(path: str, *args: object, **kwargs: object) -> None:
        deleted.append(path)
        if len(deleted) == 2:
            print(f"KILLED {path}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    os.unlink = fatal_unlink  # type: ignore[assignment]
    manager.save(3, model, optimizer)
    manager.close()
    print("NOT KILLED", flush=True)


def sigterm(directory: str) -> None:
    model, optimizer = build()
    with checkpoint.CheckpointManager(directory, save_interval_steps=100) as ckpt:
        ckpt.save(1, model, optimizer)
        for step in range(2, 10):
            bump(model, optimizer)
            print(f"STEP {step}", flush=True)
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            ckpt.save(step, model, optimizer)
    print("FINISHED", flush=True)


if __name__ == "__main__":
    {"rotate": rotate, "sigterm": sigterm}[sys.argv[1]](sys.argv[2])
