"""One process of the several-process layout test, started by ``python -m substrax.launch``.

``python layout_worker.py``: trains the test MLP as FSDP and as ZeRO-1 in both modes on
the global mesh, each process placing its own rows of the same batches, and prints
``LOSSES <mode> <layout> <comma-separated losses>`` and ``SPLIT <mode> <layout> <bool>``
(whether a split parameter is still split over every device of every process).
"""

from __future__ import annotations

import substrax.launch

substrax.launch.initialize()  # first thing: before anything touches a jax backend

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import MLP, mse, regression_batches  # noqa: E402  (not conftest: it sets 8 devices)

import substrax  # noqa: E402
from substrax.launch import process_slice  # noqa: E402
from substrax.mesh import create_data_parallel_mesh  # noqa: E402
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards  # noqa: E402

STEPS, ROWS, LR, MIN_SIZE = 6, 32, 1e-2, 16

print(f"DEVICES {jax.process_count()} x {jax.local_device_count()}", flush=True)
mesh = create_data_parallel_mesh()
sharding = create_data_parallel_sharding(mesh)
mine = process_slice(ROWS)
for mode in substrax.MODES:
    for layout in ("fsdp", "zero1"):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
        substrax.shard_state(model, optimizer, mesh=mesh, params=layout == "fsdp", min_size=MIN_SIZE)
        step = substrax.make_train_step(mse, mode, mesh=mesh)
        losses = []
        for batch in regression_batches(STEPS, rows=ROWS):
            placed = place_batch_on_shards({k: v[mine] for k, v in batch.items()}, sharding)
            losses.append(float(step(model, optimizer, placed)))
        print(f"LOSSES {mode} {layout} {','.join(f'{x:.9g}' for x in losses)}", flush=True)
        kernel = optimizer.opt_state[0].mu["hidden"]["kernel"].get_value()
        split = (
            len(kernel.sharding.device_set) == jax.device_count() and not kernel.sharding.is_fully_replicated
        )
        print(f"SPLIT {mode} {layout} {split}", flush=True)
