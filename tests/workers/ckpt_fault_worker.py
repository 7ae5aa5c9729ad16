"""Checkpoint faults in a process of their own (one CPU device, the MLP 256 wide, unplaced).

``python ckpt_fault_worker.py rotate DIR``: a manager keeping 2 steps saves steps 1 and 2,
then step 3, whose save rotates step 1 out (1 is added to the state between saves). Every
file deletion after that is fatal: at the second one the process kills itself (SIGKILL),
as a machine lost in the middle of deleting the old step would. It prints ``KILLED <path>``
just before, or ``NOT KILLED`` if nothing was deleted.

``python ckpt_fault_worker.py sigterm DIR``: a manager saving every 100 steps saves step
1, then the state gets 1 added to every floating array at each step and is offered to
``save``; at step 4 the process sends itself SIGTERM just before that step's ``save``.
It prints ``STEP i`` at each step, and ``FINISHED`` if the loop ends.

``python ckpt_fault_worker.py unclosed DIR HOW``: a manager saves step 1 in the background,
its commit held back 1 s, and the script ends without closing it: ``end`` keeps the
manager to the end, ``raise`` raises an uncaught exception, ``scope`` lets it be
collected (a function's local) and calls ``sys.exit(0)``. It prints ``LISTED <steps>
<latest>`` as the save returns.

``python ckpt_fault_worker.py damaged DIR``: saves steps 1, 2 and 3, damages step 2 (a byte
of its OCDBT manifest flipped) and step 3 (its ``_CHECKPOINT_METADATA`` cut short),
restores step 2 (printing ``REFUSED <error>``), then the latest whole step (``RESTORED
<step>``). The logger ``substrax.checkpoint`` writes to ``DIR.debug`` at DEBUG.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
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
    bump(model, optimizer)  # a state equal to the last saved is not saved again
    manager.save(2, model, optimizer)
    bump(model, optimizer)
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


def hold_commits(seconds: float) -> None:
    """Hold each background save back ``seconds`` before it commits (renames its directory)."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    commit = async_checkpointer._on_commit_callback

    def held(*args: object, **kwargs: object) -> None:
        time.sleep(seconds)
        commit(*args, **kwargs)

    async_checkpointer._on_commit_callback = held


KEPT: list[object] = []


def unclosed(directory: str, how: str) -> None:
    hold_commits(1.0)
    model, optimizer = build()
    ckpt = checkpoint.CheckpointManager(directory)
    ckpt.save(1, model, optimizer)
    print(f"LISTED {ckpt.all_steps()} {ckpt.latest_step()}", flush=True)
    if how == "end":
        KEPT.append(ckpt)
    elif how == "raise":
        raise RuntimeError("the script failed after a save")


def damaged(directory: str) -> None:
    debug = logging.FileHandler(f"{directory}.debug")
    logger = logging.getLogger("substrax.checkpoint")
    logger.addHandler(debug)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    model, optimizer = build()
    for step in (1, 2, 3):
        checkpoint.save(directory, step, model, optimizer)
        bump(model, optimizer)
    manifest = Path(directory) / "2" / "default" / "manifest.ocdbt"
    flipped = bytearray(manifest.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    manifest.write_bytes(flipped)
    metadata = Path(directory) / "3" / "_CHECKPOINT_METADATA"
    metadata.write_bytes(metadata.read_bytes()[:100])
    try:
        checkpoint.restore(directory, *build(), step=2)
    except checkpoint.DamagedCheckpointError as e:
        print(f"REFUSED {e}", flush=True)
    print(f"RESTORED {checkpoint.restore(directory, *build())}", flush=True)
    gc.collect()
    time.sleep(1.0)  # for the reads orbax abandoned to end


if __name__ == "__main__":
    if sys.argv[1] == "unclosed":
        unclosed(sys.argv[2], sys.argv[3])
        sys.exit(0)
    {"rotate": rotate, "sigterm": sigterm, "damaged": damaged}[sys.argv[1]](sys.argv[2])
