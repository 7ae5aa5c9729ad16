"""Checkpoint workers: several processes saving, and a process killed in the middle of a save.

``python -m substrax.launch -n 2 -d 4 ckpt_worker.py train DIR``: every process builds
the same model, splits it FSDP over the 8 devices of both processes, trains ``STEPS``
explicit-mode steps on its own rows of each batch, saves step ``STEPS`` into ``DIR``,
trains ``STEPS`` more, and prints ``LOSSES <json>``: all the losses of this
uninterrupted run, which a resumed run must reproduce. Then both processes restore the
checkpoint into a fresh FSDP model, train the last ``STEPS`` steps again, and print
``RESUMED <json>``.

``python ckpt_worker.py crash DIR`` (one process, 8 CPU devices): saves step 1, then
starts an asynchronous save of step 2 in which orbax's commit (the rename of the temporary
directory) never returns; it prints ``COMMITTING`` there, with every array of step 2
written, and waits to be killed, its manager's claim on DIR still held. Step 1 holds a
fresh model's FSDP state (seed 0) and its Adam optimizer's, step 2 every array of it plus
one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if sys.argv[1] == "train":
    import substrax.launch

    substrax.launch.initialize()  # first thing: before anything touches a jax backend
else:
    from substrax.mesh import use_cpu_devices

    use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import substrax  # noqa: E402
from substrax import checkpoint  # noqa: E402
from substrax.launch import process_slice  # noqa: E402
from substrax.mesh import create_device_mesh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import MLP, mse, regression_batches  # noqa: E402

ROWS, DIN, STEPS, LR, MIN_SIZE = 32, 4, 4, 1e-2, 8


def batches(steps: int = 2 * STEPS, rows: int = ROWS, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The global batches: the same on every process, and in the test that resumes."""
    return regression_batches(steps, rows, DIN, seed)


def fsdp_model(mesh: jax.sharding.Mesh, seed: int = 0) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(seed=seed)
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh, min_size=MIN_SIZE)
    return model, optimizer


def train(directory: str) -> None:
    mesh = create_device_mesh({"data": jax.device_count()})
    rows = substrax.spmd.create_data_parallel_sharding(mesh)
    mine = process_slice(ROWS)
    placed = [
        substrax.spmd.place_batch_on_shards({k: v[mine] for k, v in b.items()}, rows) for b in batches()
    ]
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    model, optimizer = fsdp_model(mesh)
    losses = []
    for i, batch in enumerate(placed, start=1):
        losses.append(float(step(model, optimizer, batch).addressable_data(0)))
        if i == STEPS:
            checkpoint.save(directory, i, model, optimizer)
    print(f"LOSSES {json.dumps(losses)}", flush=True)
    model, optimizer = fsdp_model(mesh, seed=1)  # every process restores its own shards
    assert checkpoint.restore(directory, model, optimizer) == STEPS
    resumed = [float(step(model, optimizer, batch).addressable_data(0)) for batch in placed[STEPS:]]
    print(f"RESUMED {json.dumps(resumed)}", flush=True)


_rename = os.rename


def _blocked_rename(src: str, dst: str, *args: object, **kwargs: object) -> None:
    """Orbax's commit of a step (the rename of its temporary directory) never returns."""
    if not os.fspath(src).endswith(".orbax-checkpoint-tmp"):
        return _rename(src, dst, *args, **kwargs)  # type: ignore[arg-type]
    print("COMMITTING", flush=True)
    time.sleep(600)


def crash(directory: str) -> None:
    mesh = create_device_mesh({"data": 8})
    model, optimizer = fsdp_model(mesh)
    checkpoint.save(directory, 1, model, optimizer)
    for _, variable in nnx.to_flat_state(nnx.state((model, optimizer))):
        variable.set_raw_value(variable.get_raw_value() + 1)
    os.rename = _blocked_rename  # type: ignore[assignment]
    manager = checkpoint.CheckpointManager(directory, async_save=True)
    manager.save(2, model, optimizer)
    print("SAVING", flush=True)
    manager.wait()
    print("the save of step 2 was committed: the test's kill came too late", flush=True)


if __name__ == "__main__":
    {"train": train, "crash": crash}[sys.argv[1]](sys.argv[2])
