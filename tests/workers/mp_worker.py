"""One process of a multi-process test run, started by ``python -m substrax.launch``.

``python mp_worker.py checks``: every multi-process check, each printed as
``RESULT <name> ok`` or ``RESULT <name> FAIL <why>``; a failed check does not stop the
others (every process runs the same checks, so the collectives stay in step).
``python mp_worker.py fail``: each process starts a ``sleep`` grandchild and prints
``GRANDCHILD <pid>``; process 1 then raises, while process 0 ignores SIGTERM (as JAX's
preemption handler would) and sleeps, so only SIGKILL ends it.
``python mp_worker.py exit``: process 1 calls ``sys.exit(3)`` while process 0 waits for
it in a collective.
``python mp_worker.py wait``: the same grandchildren, then ``READY``; process 0 waits
in a collective that never completes, for the launcher to be interrupted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import substrax.launch

substrax.launch.initialize()  # first thing: before anything touches a jax backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import substrax  # noqa: E402
import substrax.mesh  # noqa: E402
from substrax.launch import process_slice  # noqa: E402
from substrax.mesh import create_device_mesh  # noqa: E402
from substrax.spmd import (  # noqa: E402
    check_replicated_equal,
    create_data_parallel_sharding,
    place_batch_on_shards,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import MLP, make_placed, one_device_training  # noqa: E402  (not conftest: it sets 8 devices)

ROWS, DIN, STEPS, LR = 32, 4, 12, 1e-2
FAILURES: list[str] = []


def check(name: str):
    def run(fn):
        try:
            fn()
            print(f"RESULT {name} ok")
        except Exception as e:  # noqa: BLE001 (report every check, then fail at the end)
            FAILURES.append(name)
            print(f"RESULT {name} FAIL {type(e).__name__}: {e}".replace("\n", " | "))
        return fn

    return run


def local_value(arr: jax.Array) -> np.ndarray:
    """A global array's value, assembled from this process's shards (a replicated one's first
    device holds it all; under hybrid sharding the process's devices hold one replica)."""
    out = np.full(arr.shape, np.nan, dtype=arr.dtype)
    for shard in arr.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    assert not np.isnan(out).any(), "this process's shards do not cover the array"
    return out


def weighted_mse(model: MLP, batch: dict) -> jax.Array:
    rows = batch["rows"]
    return batch["batch_state"]["scale"] * jnp.mean((model(rows["x"]) - rows["y"]) ** 2)


def global_batches() -> list[dict]:
    """The whole batches, the same on every process (same seed): the reference's input."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(DIN, 1))
    out = []
    for i in range(STEPS):
        x = rng.normal(size=(ROWS, DIN)).astype(np.float32)
        out.append(
            {
                "rows": {"x": x, "y": np.sin(x @ w).astype(np.float32)},
                "batch_state": {"scale": np.float32(1.0 + 0.1 * i)},
            }
        )
    return out


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): local_value(var.get_value()) for path, var in flat}


def batch_shardings(mesh: jax.sharding.Mesh) -> dict[str, NamedSharding]:
    """The batch's shardings: its rows over every device, the batch-level value replicated."""
    return {"rows": create_data_parallel_sharding(mesh), "batch_state": NamedSharding(mesh, P())}


def own_rows(b: dict) -> dict:
    """What this process loads of batch ``b``, as NumPy: its rows, and the batch-level value."""
    mine = jax.tree.map(lambda a: a[process_slice(ROWS)], b["rows"])
    return {"rows": mine, "batch_state": b["batch_state"]}


def reference(batches: list[dict], make_tx, steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """``steps`` of ``batches`` on one device (this process's first), the whole batch, with ``make_tx()``."""
    tx = make_tx()
    device = jax.local_devices()[0]
    losses, model = one_device_training(batches[:steps], tx, loss_fn=weighted_mse, device=device)
    return losses, params(model)


def assert_trained_like(model: MLP, losses: list[float], want: tuple[list[float], dict]) -> None:
    np.testing.assert_allclose(losses, want[0], rtol=1e-5)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))  # split over both processes: gathered
    got = {"/".join(map(str, k)): multihost_utils.process_allgather(v.get_value(), tiled=True)
           for k, v in flat}  # fmt: skip
    assert got.keys() == want[1].keys()
    for name in want[1]:
        np.testing.assert_allclose(got[name], want[1][name], rtol=1e-5, atol=1e-5, err_msg=name)


def assert_params_equal_reference(model: MLP, ref_params: dict[str, np.ndarray]) -> None:
    got = params(model)
    assert got.keys() == ref_params.keys()
    for name in ref_params:
        np.testing.assert_allclose(got[name], ref_params[name], rtol=1e-5, atol=1e-5, err_msg=name)


def placement_checks(mesh: jax.sharding.Mesh) -> None:
    """Placement over both processes: the topology, rows stitched, replicated values checked."""
    rows_sharding, shardings = create_data_parallel_sharding(mesh), batch_shardings(mesh)
    me = jax.process_index()

    @check("topology")
    def _() -> None:
        assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
        assert process_slice(ROWS) == slice(me * ROWS // 2, (me + 1) * ROWS // 2)

    @check("stitch")
    def _() -> None:
        x = np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3)
        placed = place_batch_on_shards({"x": x[process_slice(ROWS)]}, rows_sharding)["x"]
        assert placed.shape == x.shape, placed.shape
        for shard in placed.addressable_shards:  # this process's rows, where they belong
            np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])
        np.testing.assert_array_equal(multihost_utils.process_allgather(placed, tiled=True), x)

    @check("replicated")
    def _() -> None:
        batch = {
            "rows": {"x": np.full((ROWS // 2, 2), me, np.float32)},
            "batch_state": {"lam": np.float32(0.25)},
        }
        placed = place_batch_on_shards(batch, shardings, check_replicated=True)
        lam = placed["batch_state"]["lam"]
        assert lam.shape == () and lam.sharding.is_fully_replicated
        assert [float(s.data) for s in lam.addressable_shards] == [0.25] * 4
        # the rows differ between processes, as rows should: no complaint about them
        check_replicated_equal(batch, shardings)

    @check("mismatch")
    def _() -> None:
        batch = {
            "rows": {"x": np.zeros((ROWS // 2, 2), np.float32)},
            "batch_state": {"same": np.arange(3), "lam": np.float32(0.25 + me), "z": np.float32(1)},
        }
        for call in (
            lambda: place_batch_on_shards(batch, shardings, check_replicated=True),
            lambda: check_replicated_equal(batch, shardings),
        ):
            try:
                call()
            except ValueError as e:
                msg = str(e)
                assert "batch['batch_state']['lam']" in msg and "process(es) 1 " in msg, msg
            else:
                raise AssertionError("a replicated leaf that differs between processes passed")

    @check("hybrid_mesh")
    def _() -> None:
        hybrid = substrax.mesh.create_hybrid_mesh(4, 2)  # data spans both processes, model within one
        assert hybrid.axis_names == ("data", "model") and hybrid.devices.shape == (4, 2)
        hosts = np.vectorize(lambda d: d.process_index)(hybrid.devices)
        assert (hosts == hosts[:, :1]).all(), hosts  # each model group on one process
        assert sorted(set(hosts[:, 0])) == [0, 1], hosts
        assert substrax.mesh.get_mesh_info(hybrid) == {"total_devices": 8, "axes": {"data": 4, "model": 2}}


def train(mesh: jax.sharding.Mesh, batches: list[dict], mode: str, steps: int, *, hold: bool = False):
    """Train ``steps`` of ``batches`` in ``mode``; ``hold``: process 1 alone holds the
    state's arrays across each step, as a save in flight does on some processes."""
    model, optimizer = make_placed(MLP, optax.adam(LR), mesh)
    step = substrax.make_train_step(
        weighted_mse, mode, mesh=mesh, batch_spec={"rows": P("data"), "batch_state": P()}
    )
    losses, held = [], []
    for b in batches[:steps]:  # each process loads its rows, and the same batch-level value
        if hold and jax.process_index() == 1:
            held.append(jax.tree.leaves(nnx.state((model, optimizer))))
        rows = jax.tree.map(lambda a: a[process_slice(ROWS)], b["rows"])
        placed = place_batch_on_shards({"rows": rows, "batch_state": b["batch_state"]}, batch_shardings(mesh))
        losses.append(float(local_value(step(model, optimizer, placed))))
    return model, step, held, losses


def step_checks(mesh: jax.sharding.Mesh, batches: list[dict], want: tuple[list[float], dict]) -> None:
    """Both steps train as one device does, with arrays held on one process too."""
    ref_losses, ref_params = want
    for mode in substrax.MODES:

        @check(f"steps_{mode}")
        def _(mode: str = mode) -> None:
            model, _, _, losses = train(mesh, batches, mode, STEPS)
            np.testing.assert_allclose(losses, ref_losses[:STEPS], rtol=1e-5)
            assert_params_equal_reference(model, ref_params)

        @check(f"held_{mode}")
        def _(mode: str = mode) -> None:
            # every process must still run one and the same program (else a hang, jax 0.12.1)
            _, step, held, losses = train(mesh, batches, mode, 3, hold=True)
            np.testing.assert_allclose(losses, ref_losses[:3], rtol=1e-5)
            assert not any(a.is_deleted() for arrays in held for a in arrays)
            ran = {donate for (*_, donate), f in step._pure_steps.items() if f._cache_size()}
            assert ran == {True}, ran  # the donated program, whoever holds what


def hsdp_checks(hybrid: jax.sharding.Mesh, batches: list[dict], want: tuple[list[float], dict]) -> None:
    """Hybrid sharding: one replica per process, the state split over the process's 4 devices."""
    ref_losses, ref_params = want
    hybrid_rows = create_data_parallel_sharding(hybrid)  # rows over (replica, data)
    for mode in substrax.MODES:

        @check(f"hsdp_{mode}")
        def _(mode: str = mode) -> None:
            hosts = np.vectorize(lambda d: d.process_index)(hybrid.devices)
            assert (hosts == hosts[:, :1]).all() and list(hosts[:, 0]) == [0, 1], (
                hosts
            )  # a replica per process
            model, optimizer = make_placed(MLP, optax.adam(LR), hybrid, layout="hsdp", min_size=1)
            step = substrax.make_train_step(
                weighted_mse,
                mode,
                mesh=hybrid,
                batch_spec={"rows": P(("replica", "data")), "batch_state": P()},
            )
            losses = []
            for b in batches:
                rows = jax.tree.map(lambda a: a[process_slice(ROWS)], b["rows"])
                placed = place_batch_on_shards(
                    {"rows": rows, "batch_state": b["batch_state"]},
                    {"rows": hybrid_rows, "batch_state": NamedSharding(hybrid, P())},
                )
                losses.append(float(local_value(step(model, optimizer, placed))))
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
            got = params(model)
            for name in ref_params:
                np.testing.assert_allclose(got[name], ref_params[name], rtol=1e-5, atol=1e-5, err_msg=name)


def own_rows_checks(
    mesh: jax.sharding.Mesh, hybrid: jax.sharding.Mesh, batches: list[dict], adam_4: tuple[list[float], dict]
) -> None:
    """Each process passes its own rows as NumPy, to the plain call and to .bind (#51.1)."""
    for mode in substrax.MODES:

        @check(f"own_rows_{mode}")
        def _(mode: str = mode) -> None:
            model, optimizer = make_placed(MLP, optax.adam(LR), mesh, layout="fsdp", min_size=1)
            step = substrax.make_train_step(
                weighted_mse, mode, mesh=mesh, batch_spec={"rows": P("data"), "batch_state": P()}
            )
            # lowered (the census, the plan) as the call runs: the global rows, not this process's
            lowered = step.lower(model, optimizer, own_rows(batches[0]))
            shapes = jax.tree.map(lambda a: a.shape, lowered.args_info[0][1]["rows"])
            assert shapes == jax.tree.map(np.shape, batches[0]["rows"]), shapes
            losses = [float(local_value(step(model, optimizer, own_rows(b)))) for b in batches[:2]]
            with step.bind(model, optimizer) as fast:
                losses += [float(local_value(fast(own_rows(b)))) for b in batches[2:4]]
            assert_trained_like(model, losses, adam_4)

        @check(f"own_rows_hsdp_{mode}")
        def _(mode: str = mode) -> None:
            model, optimizer = make_placed(MLP, optax.adam(LR), hybrid, layout="hsdp", min_size=1)
            # the default specs: rows over (replica, data), the 0-d scale replicated
            step = substrax.make_train_step(weighted_mse, mode, mesh=hybrid)
            with step.bind(model, optimizer) as fast:
                losses = [float(local_value(fast(own_rows(b)))) for b in batches[:2]]
            losses += [float(local_value(step(model, optimizer, own_rows(b)))) for b in batches[2:4]]
            assert_trained_like(model, losses, adam_4)

    @check("own_rows_differ")
    def _() -> None:
        model, optimizer = make_placed(MLP, optax.adam(LR), mesh)
        before = params(model)
        b = own_rows(batches[0])
        if jax.process_index() == 1:  # process 1 loaded half the targets
            b["rows"]["y"] = b["rows"]["y"][: ROWS // 4]
        for mode in substrax.MODES:
            step = substrax.make_train_step(weighted_mse, mode, mesh=mesh)
            for call in (lambda: step(model, optimizer, b), lambda: step.bind(model, optimizer)(b)):
                try:
                    call()
                except ValueError as e:
                    msg = str(e)
                    assert "batch['rows']['y']: (16, 1) on process 0, (8, 1) on process 1" in msg, msg
                else:
                    raise AssertionError("rows that differ between processes passed")
        for name, value in params(model).items():  # nothing ran
            np.testing.assert_array_equal(value, before[name], err_msg=name)


def _by_kind(p: object) -> object:
    return jax.tree.map_with_path(lambda path, _: "kernel" if "kernel" in str(path) else "bias", p)


MASKED = {
    "muon": lambda: optax.contrib.muon(LR),
    "partition": lambda: optax.partition({"kernel": optax.adam(LR), "bias": optax.sgd(LR)}, _by_kind),
}


def masked_checks(mesh: jax.sharding.Mesh, batches: list[dict]) -> None:
    """Masked optimizer state (optax.MaskedNode) after shard_state, on two processes (#51.2)."""
    # each optimizer in both modes and both layouts, in two runs (the launch has a timeout)
    runs = [("muon", "fsdp", "implicit"), ("muon", "replicated", "explicit"),
            ("partition", "fsdp", "explicit"), ("partition", "replicated", "implicit")]  # fmt: skip
    wants = {name: reference(batches, make_tx, 3) for name, make_tx in MASKED.items()}
    for name, layout, mode in runs:

        @check(f"masked_{name}_{layout}_{mode}")
        def _(name: str = name, layout: str = layout, mode: str = mode) -> None:
            model, optimizer = make_placed(MLP, MASKED[name](), mesh, layout=layout, min_size=1)
            step = substrax.make_train_step(
                weighted_mse, mode, mesh=mesh, batch_spec={"rows": P("data"), "batch_state": P()}
            )
            losses = []
            for b in batches[:3]:
                placed = place_batch_on_shards(own_rows(b), batch_shardings(mesh))
                losses.append(float(local_value(step(model, optimizer, placed))))
            assert_trained_like(model, losses, wants[name])


def gather_checks(mesh: jax.sharding.Mesh, batches: list[dict]) -> None:
    """A gathered metric is replicated: every process reads every row."""
    for mode in substrax.MODES:

        @check(f"gather_{mode}")
        def _(mode: str = mode) -> None:
            def per_example(model: MLP, batch: dict) -> tuple[jax.Array, dict]:
                err = (model(batch["rows"]["x"]) - batch["rows"]["y"])[:, 0]
                return jnp.mean(err**2), {"err": err}

            model, optimizer = make_placed(MLP, optax.sgd(0.0), mesh)
            step = substrax.make_train_step(
                per_example,
                mode,
                mesh=mesh,
                has_aux=True,
                reduce={"err": "gather"},
                batch_spec={"rows": P("data"), "batch_state": P()},
            )
            b = batches[0]
            rows = jax.tree.map(lambda a: a[process_slice(ROWS)], b["rows"])
            placed = place_batch_on_shards(
                {"rows": rows, "batch_state": b["batch_state"]}, batch_shardings(mesh)
            )
            _, metrics = step(model, optimizer, placed)
            with jax.default_device(jax.local_devices()[0]):
                want = np.asarray(MLP()(b["rows"]["x"]))[:, 0] - b["rows"]["y"][:, 0]
            # every process reads every row
            np.testing.assert_allclose(np.asarray(metrics["err"]), want, rtol=1e-5, atol=1e-6)


def checks() -> None:
    """Every check, in one order on every process (their collectives stay in step)."""
    mesh = create_device_mesh({"data": jax.device_count()})
    placement_checks(mesh)
    batches = global_batches()
    want = reference(batches, lambda: optax.adam(LR), len(batches))
    step_checks(mesh, batches, want)
    hybrid = create_device_mesh({"replica": 2, "data": 4})
    hsdp_checks(hybrid, batches, want)
    own_rows_checks(mesh, hybrid, batches, reference(batches, lambda: optax.adam(LR), 4))
    masked_checks(mesh, batches)
    gather_checks(mesh, batches)
    print("stderr is passed on too", file=sys.stderr)
    if FAILURES:
        raise SystemExit(f"failed checks: {FAILURES}")
    print("ALL DONE")


def fail() -> None:
    sleeper = subprocess.Popen(["sleep", "300"])
    print(f"GRANDCHILD {sleeper.pid}")
    multihost_utils.sync_global_devices("both started")
    if jax.process_index() == 1:
        raise RuntimeError("deliberate failure in process 1")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(300)


def exit_code() -> None:
    multihost_utils.sync_global_devices("both started")
    if jax.process_index() == 1:
        print(f"EXITING {time.time()}")
        sys.exit(3)
    multihost_utils.process_allgather(np.ones(3))  # never completes: process 1 is gone


def wait() -> None:
    sleeper = subprocess.Popen(["sleep", "300"])
    print(f"GRANDCHILD {sleeper.pid}")
    multihost_utils.sync_global_devices("both started")
    print("READY")
    if jax.process_index() == 0:
        multihost_utils.process_allgather(np.ones(3))  # never completes: process 1 sleeps
    else:
        sleeper.wait()


if __name__ == "__main__":
    {"checks": checks, "fail": fail, "wait": wait, "exit": exit_code}[sys.argv[1]]()
