"""JAX processes for the launcher's fault tests, started by ``python -m substrax.launch``.

``train DIR``: every process trains a small replicated model, one step at a time,
printing ``STEP <i>`` after each, and calls ``CheckpointManager.save`` at every step
with an interval no step reaches, so only the first step and a step asked for by a
SIGTERM are saved. At step 3 it prints ``READY``, for the test to send its signal.
It sleeps between steps, so the signal lands mid-run; if no SIGTERM stops it within
``STEPS`` steps it prints ``NOT STOPPED`` and exits 0.
``leave``: process 1's script ends (cleanly, code 0) while process 0 waits for it in
a collective that never completes.
``init``: joins the run and ends at once.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import substrax.launch

substrax.launch.initialize()  # first thing: before anything touches a jax backend

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import substrax
from substrax import checkpoint
from substrax.launch import process_slice
from substrax.mesh import create_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import MLP, mse, regression_batches

ROWS, STEPS = 8, 300


def train(directory: str) -> None:
    mesh = create_device_mesh({"data": jax.device_count()})
    rows = substrax.spmd.create_data_parallel_sharding(mesh)
    mine = process_slice(ROWS)
    batches = [
        substrax.spmd.place_batch_on_shards({k: v[mine] for k, v in b.items()}, rows)
        for b in regression_batches(4, ROWS)
    ]
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    with jax.set_mesh(mesh):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
    with checkpoint.CheckpointManager(directory, save_interval_steps=10**9) as manager:
        for i in range(1, STEPS + 1):
            step(model, optimizer, batches[i % len(batches)])
            print(f"STEP {i}", flush=True)
            manager.save(i, model, optimizer)
            if i == 3:
                print("READY", flush=True)
            time.sleep(0.05)
    print("NOT STOPPED", flush=True)


def leave() -> None:
    multihost_utils.sync_global_devices("both started")
    if jax.process_index() == 1:
        print("LEAVING", flush=True)
        return
    multihost_utils.process_allgather(np.ones(3))  # never completes: process 1 has left


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2])
    elif sys.argv[1] == "leave":
        leave()
    else:
        assert sys.argv[1] == "init", sys.argv[1]
