"""One process of the pipelined own-rows checks (#60.1), started by ``python -m substrax.launch``.

``python pipeline_rows_worker.py [trains] [refusals]`` (both by default).

Trains: on 2 processes x 4 devices, a stack of 4 residual layers pipelined over ``stage``
on the meshes ``(stage 4, data 2)`` (the stage axis spans the processes: each holds both
data shards) and ``(data 2, stage 4)`` (each process one data shard), in both modes and
both schedules, and explicit interleaved 1F1B (a stack of 8, two chunks a stage: the chunks
moved between the processes' stages and home). Each process passes its own 16 of the 32
rows, to the plain call as NumPy
and through ``place_batch_on_shards``; the losses and parameters must be a one-device
run's on the whole 32 rows, and a NaN in process 1's rows must skip the step.

Refusals: rows whose shapes differ between processes, and a leaf split on two dimensions
where the processes hold the same blocks, each named.

Each check prints ``RESULT <name> ok`` or ``RESULT <name> FAIL <why>``; a failed check does
not stop the others (every process runs the same ones, so the collectives stay in step).
"""

from __future__ import annotations

import substrax.launch

substrax.launch.initialize()  # first thing: before anything touches a jax backend

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import substrax  # noqa: E402
from substrax.launch import process_slice  # noqa: E402
from substrax.mesh import create_device_mesh  # noqa: E402
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import (  # noqa: E402  (not conftest: it sets 8 devices)
    Residual,
    Tower,
    make_placed,
    mse,
    one_device_training,
    sine_batches,
)

DEPTH, WIDTH, ROWS, MICROBATCHES, LR = 4, 8, 32, 4, 0.05
RTOL, ATOL = 1e-5, 1e-6  # SGD: float32 round-off
FAILURES: list[str] = []


class Net(Tower):
    def __init__(self, depth: int = DEPTH) -> None:
        super().__init__(Residual, depth, WIDTH, gate=True, scale=0.5)


RUNS = [(mode, schedule) for mode in substrax.MODES for schedule in ("gpipe", "1f1b")]
RUNS.append(("explicit", "interleaved-1f1b"))  # two chunks a stage, on a stack of 2 * DEPTH


def check(name: str):
    def run(fn):
        start = time.monotonic()
        try:
            fn()
            print(f"RESULT {name} ok", flush=True)
        except Exception as e:  # noqa: BLE001 (report every check, then fail at the end)
            FAILURES.append(name)
            print(f"RESULT {name} FAIL {type(e).__name__}: {e}".replace("\n", " | "), flush=True)
        print(f"TIME {name} {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        return fn

    return run


def scalar(x: jax.Array) -> float:
    """A replicated scalar's value, read off this process's first shard."""
    return float(x.addressable_shards[0].data)


def gathered(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every parameter's whole value (the stack is split over stages on both processes)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {
        "/".join(map(str, k)): np.asarray(multihost_utils.process_allgather(v.get_value(), tiled=True))
        for k, v in flat
    }


def main(parts: list[str]) -> None:
    if "trains" in parts:
        trains()
    if "refusals" in parts:
        refusals()
    if FAILURES:
        raise SystemExit(f"failed checks: {FAILURES}")
    print("ALL DONE", flush=True)


def own(b: dict) -> dict:
    """This process's rows of batch ``b``, as NumPy (``process_slice``)."""
    return {k: v[process_slice(ROWS)] for k, v in b.items()}


def trains() -> None:
    batches = sine_batches(3, ROWS)
    poisoned = {k: v.copy() for k, v in sine_batches(1, ROWS, seed=1)[0].items()}
    poisoned["y"][ROWS - 1] = np.nan  # in process 1's rows

    wants = {}  # chunks a stage: the one-device run of its stack (DEPTH * chunks layers)
    for chunks in (1, 2):
        losses, trained = one_device_training(
            batches, optax.sgd(LR), model=lambda c=chunks: Net(DEPTH * c), loss_fn=mse,
            device=jax.local_devices()[0],
        )  # fmt: skip
        params = nnx.to_flat_state(nnx.state(trained, nnx.Param))
        wants[chunks] = losses, {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in params}

    for shape in ({"stage": 4, "data": 2}, {"data": 2, "stage": 4}):
        mesh = create_device_mesh(shape)
        axes = "-".join(f"{a}{n}" for a, n in shape.items())
        sharding = create_data_parallel_sharding(mesh)

        @check(f"placed_{axes}")
        def _(sharding=sharding) -> None:
            # this process's rows, placed: the whole 32 rows, each shard where the concatenation puts it
            x = batches[0]["x"]
            placed = place_batch_on_shards(own(batches[0]), sharding)["x"]
            assert placed.shape == x.shape, placed.shape
            for s in placed.addressable_shards:
                np.testing.assert_array_equal(np.asarray(s.data), x[s.index], err_msg=str(s.device))

        for mode, schedule in RUNS:
            chunks = 2 if schedule == "interleaved-1f1b" else 1

            @check(f"trains_{axes}_{mode}_{schedule}")
            def _(mesh=mesh, sharding=sharding, mode=mode, schedule=schedule, chunks=chunks) -> None:
                want_losses, want = wants[chunks]
                net = lambda: Net(DEPTH * chunks)  # noqa: E731
                model, opt = make_placed(net, optax.sgd(LR), mesh, stages=Residual, virtual_stages=chunks)
                step = substrax.make_train_step(
                    mse, mode, mesh=mesh, microbatches=MICROBATCHES, schedule=schedule
                )
                losses = [scalar(step(model, opt, own(batches[0])))]  # NumPy rows, to the call
                before = gathered(model)
                skipped = scalar(step(model, opt, own(poisoned)))  # NaN in process 1's rows
                after = gathered(model)
                for b in batches[1:]:  # placed by place_batch_on_shards
                    losses.append(scalar(step(model, opt, place_batch_on_shards(own(b), sharding))))
                got = gathered(model)  # every collective first: a failed check stops none
                assert np.isnan(skipped), f"a NaN in process 1's rows gave the loss {skipped}"
                for name, value in before.items():
                    np.testing.assert_array_equal(after[name], value, err_msg=f"skipped step: {name}")
                np.testing.assert_allclose(losses, want_losses, rtol=RTOL, err_msg="losses")
                for name, value in want.items():
                    np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def refusals() -> None:
    """Rows that cannot be placed as each process's own are refused by name (no compile)."""
    b = own(sine_batches(1, ROWS)[0])

    @check("refused_differ")
    def _() -> None:  # where the rows are gathered, their shapes must agree
        mesh = create_device_mesh({"stage": 4, "data": 2})
        short = {"x": b["x"], "y": b["y"][: ROWS // 4] if jax.process_index() == 1 else b["y"]}
        expect(
            lambda: place_batch_on_shards(short, create_data_parallel_sharding(mesh)),
            "batch['y']: (16,) on process 0, (8,) on process 1",
        )

    @check("refused_two_dims")
    def _() -> None:  # split on two dimensions, with 'stage' across the processes: no rows of its own
        mesh = create_device_mesh({"stage": 2, "data": 2, "model": 2})
        wide = {"x": np.tile(b["x"], (1, 2))}  # (16, 8)
        expect(
            lambda: place_batch_on_shards(wide, NamedSharding(mesh, P("data", "model"))),
            "batch['x'] is split over dimensions [0, 1] (P('data', 'model')), and processes 0 and 1 hold "
            "the same blocks of it: the mesh's 'stage' spans the processes and does not split it",
        )


def expect(call, message: str) -> None:
    try:
        call()
    except ValueError as e:
        assert message in str(e), str(e)
    else:
        raise AssertionError(f"no ValueError: {message}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["trains", "refusals"])
