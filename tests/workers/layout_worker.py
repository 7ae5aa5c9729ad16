"""One process of the several-process layout tests, started by ``python -m substrax.launch``.

Both parts below run in one launch (``tests/test_layouts.py`` reads each part's lines);
``python layout_worker.py layouts`` or ``rngs`` runs one of them.

The layouts part: trains the test MLP as FSDP and as ZeRO-1 in both modes on
the global mesh, each process placing its own rows of the same batches, and prints
``LOSSES <mode> <layout> <comma-separated losses>`` and ``SPLIT <mode> <layout> <bool>``
(whether a split parameter is still split over every device of every process).

The rngs part: a model holding random streams (``nnx.Dropout`` with
``nnx.Rngs``), built outside any mesh, placed by ``shard_state`` as FSDP and ZeRO-1 and
trained in both modes. Prints ``RESULT rngs_placed ok`` when every random key ends up
replicated on all devices of all processes, ``RESULT rngs_implicit ok`` when implicit
mode's losses and parameters match a one-device run of plain nnx on the whole batch
(the same dropout masks: jax draws them independently of the sharding), and
``RNGS explicit <layout> <losses>`` (explicit mode draws a mask per device; the test
checks both processes agree).
"""

from __future__ import annotations

import substrax.launch

substrax.launch.initialize()  # first thing: before anything touches a jax backend

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import (  # noqa: E402  (not conftest: it sets 8 devices)
    MLP,
    Dropped,
    mse,
    one_device_training,
    regression_batches,
)

import substrax  # noqa: E402
from substrax.launch import process_slice  # noqa: E402
from substrax.mesh import create_data_parallel_mesh  # noqa: E402
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards  # noqa: E402

STEPS, ROWS, LR, MIN_SIZE = 6, 32, 1e-2, 16


def one_device_dropout_run(batches: list[dict]) -> tuple[list[float], list[np.ndarray]]:
    """Plain nnx on this process's first device, on the whole batches: the reference."""
    losses, model = one_device_training(
        batches, optax.adam(LR), model=lambda: Dropped(0.25), device=jax.local_devices()[0]
    )
    return losses, [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]


def rngs_checks() -> None:
    batches = regression_batches(STEPS, rows=ROWS)
    want_losses, want_params = one_device_dropout_run(batches)
    placed_ok = implicit_ok = True
    why = []
    for layout in ("fsdp", "zero1"):
        for mode in substrax.MODES:
            model = Dropped(0.25)  # built outside any mesh: its arrays sit on one local device
            optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
            substrax.shard_state(model, optimizer, mesh=mesh, params=layout == "fsdp", min_size=MIN_SIZE)
            for path, variable in nnx.to_flat_state(nnx.state(model, nnx.RngKey)):
                key = variable.get_value()
                if len(key.sharding.device_set) != jax.device_count() or not key.sharding.is_fully_replicated:
                    placed_ok = False
                    why.append(f"{layout} {path} on {key.sharding}")
            step = substrax.make_train_step(mse, mode, mesh=mesh)
            losses = []
            for batch in batches:
                placed = place_batch_on_shards({k: v[mine] for k, v in batch.items()}, sharding)
                losses.append(float(step(model, optimizer, placed)))
            if mode == "implicit":
                got = [
                    np.asarray(multihost_utils.process_allgather(v, tiled=True))
                    for v in jax.tree.leaves(nnx.state(model, nnx.Param))
                ]
                close = np.allclose(losses, want_losses, rtol=1e-5) and all(
                    np.allclose(g, w, rtol=2e-5, atol=2e-6) for g, w in zip(got, want_params, strict=True)
                )
                if not close:
                    implicit_ok = False
                    why.append(f"{layout} implicit losses {losses} != {want_losses}")
            else:
                print(f"RNGS explicit {layout} {','.join(f'{x:.9g}' for x in losses)}", flush=True)
    print(f"RESULT rngs_placed {'ok' if placed_ok else 'FAIL ' + '; '.join(why)}", flush=True)
    print(f"RESULT rngs_implicit {'ok' if implicit_ok else 'FAIL ' + '; '.join(why)}", flush=True)


print(f"DEVICES {jax.process_count()} x {jax.local_device_count()}", flush=True)
mesh = create_data_parallel_mesh()
sharding = create_data_parallel_sharding(mesh)
mine = process_slice(ROWS)


def layout_runs() -> None:
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
                len(kernel.sharding.device_set) == jax.device_count()
                and not kernel.sharding.is_fully_replicated
            )
            print(f"SPLIT {mode} {layout} {split}", flush=True)


PARTS = {"layouts": layout_runs, "rngs": rngs_checks}
for part in sys.argv[1:] or PARTS:
    PARTS[part]()
