"""Checkpoints: a run saved in one layout and resumed in another continues with the same losses.

Every resumed run is checked against the uninterrupted run it was saved from, computed in
the same test module: the losses after the restore must equal the uninterrupted run's
next losses to float32 round-off. Layouts: FSDP and ZeRO-1 (``shard_state``), the model
replicated over the mesh, and a fresh model never placed at all.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest
from conftest import MLP, mse, regression_batches
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from workers.launching import WORKERS, Run, launch

import substrax
from substrax import checkpoint

LR, MIN_SIZE, SAVED, STEPS, ROWS = 1e-2, 8, 4, 8, 32
BATCHES = regression_batches(STEPS, ROWS)
RTOL, ATOL = 1e-6, 0.0  # float32 round-off: layouts and modes may reduce in different orders

Build = tuple[MLP, nnx.Optimizer]


def build(layout: str, mesh: jax.sharding.Mesh | None = None, *, seed: int = 0, **mlp: Any) -> Build:
    """A model and its Adam optimizer, laid out as ``layout`` says."""
    model = MLP(seed=seed, **mlp)
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    if layout in ("fsdp", "zero1"):
        substrax.shard_state(model, optimizer, mesh=mesh, params=layout == "fsdp", min_size=MIN_SIZE)
    elif layout == "replicated":
        assert mesh is not None
        for _, variable in nnx.to_flat_state(nnx.state((model, optimizer))):
            variable.set_raw_value(jax.device_put(variable.get_raw_value(), NamedSharding(mesh, P())))
    else:
        assert layout == "unplaced"
    return model, optimizer


def shardings(model: MLP, optimizer: nnx.Optimizer) -> dict[str, Any]:
    flat = nnx.to_flat_state(nnx.state((model, optimizer)))
    return {"/".join(map(str, path)): variable.get_raw_value().sharding for path, variable in flat}


def values(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, np.ndarray]:
    """Every array of the state by path; a typed key array as its raw data."""

    def raw(value: jax.Array) -> np.ndarray:
        is_key = jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
        return np.asarray(jax.random.key_data(value) if is_key else value)

    flat = nnx.to_flat_state(nnx.state((model, optimizer)))
    return {"/".join(map(str, path)): raw(variable.get_raw_value()) for path, variable in flat}


_STEPS: dict[tuple[str, Any], substrax.TrainStep] = {}


def train(mode: Any, model: MLP, optimizer: nnx.Optimizer, batches: list[dict], mesh: Any) -> list[float]:
    """Step through ``batches``; one ``TrainStep`` per mode and mesh, so its compilations are shared."""
    step = _STEPS.setdefault((mode, mesh), substrax.make_train_step(mse, mode, mesh=mesh))
    return [float(step(model, optimizer, batch)) for batch in batches]


@pytest.fixture(scope="module")
def uninterrupted(
    tmp_path_factory: pytest.TempPathFactory, mesh8: jax.sharding.Mesh
) -> Callable[[str, str], tuple[list[float], Path]]:
    """``(mode, layout) -> (losses, directory)``: STEPS steps, saved after SAVED of them."""
    done: dict[tuple[str, str], tuple[list[float], Path]] = {}

    def run(mode: str, layout: str) -> tuple[list[float], Path]:
        if (mode, layout) not in done:
            directory = tmp_path_factory.mktemp(f"{mode}-{layout}")
            model, optimizer = build(layout, mesh8)
            losses = train(mode, model, optimizer, BATCHES[:SAVED], mesh8)
            checkpoint.save(directory, SAVED, model, optimizer)
            losses += train(mode, model, optimizer, BATCHES[SAVED:], mesh8)
            done[mode, layout] = losses, directory
        return done[mode, layout]

    return run


@pytest.mark.parametrize("mode", substrax.MODES)
@pytest.mark.parametrize(
    "saved, resumed",
    [("fsdp", "fsdp"), ("fsdp", "replicated"), ("replicated", "fsdp"), ("zero1", "unplaced")],
)
def test_a_resumed_run_continues_the_uninterrupted_one(
    uninterrupted: Callable[[str, str], tuple[list[float], Path]],
    mesh8: jax.sharding.Mesh,
    mode: str,
    saved: str,
    resumed: str,
) -> None:
    losses, directory = uninterrupted(mode, saved)
    model, optimizer = build(resumed, mesh8, seed=1)  # other values, all to be replaced
    layout = shardings(model, optimizer)
    assert checkpoint.restore(directory, model, optimizer) == SAVED
    assert shardings(model, optimizer) == layout  # restored in the layout it had
    resumed_losses = train(mode, model, optimizer, BATCHES[SAVED:], mesh8)
    np.testing.assert_allclose(resumed_losses, losses[SAVED:], rtol=RTOL, atol=ATOL)


def test_a_bound_step_is_saved_in_the_background_while_it_trains(
    tmp_path: Path, mesh8: jax.sharding.Mesh
) -> None:
    model, optimizer = build("fsdp", mesh8)
    step = substrax.make_train_step(mse, "implicit", mesh=mesh8)
    losses = []
    with checkpoint.CheckpointManager(tmp_path, async_save=True) as ckpt, step.bind(model, optimizer) as fast:
        for i, batch in enumerate(BATCHES, start=1):
            losses.append(float(fast(batch)))
            if i == SAVED:
                assert ckpt.save(i, fast)  # syncs; the next call donates the arrays it saves
    model, optimizer = build("fsdp", mesh8, seed=1)
    assert checkpoint.restore(tmp_path, model, optimizer) == SAVED
    with step.bind(model, optimizer) as fast:
        resumed = [float(fast(batch)) for batch in BATCHES[SAVED:]]
    np.testing.assert_allclose(resumed, losses[SAVED:], rtol=RTOL, atol=ATOL)


def tick(optimizer: nnx.Optimizer) -> nnx.Optimizer:
    """The optimizer one step on (its ``step`` count alone): a state the manager has not saved."""
    optimizer.step.set_value(optimizer.step.get_value() + 1)
    return optimizer


def test_the_manager_keeps_the_last_steps_at_its_interval(tmp_path: Path) -> None:
    model, optimizer = build("unplaced")
    with checkpoint.CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
        started = [ckpt.save(i, model, tick(optimizer)) for i in range(1, 8)]
        ckpt.wait()
        assert started == [True, True, False, True, False, True, False]  # the first, then every 2nd
        assert ckpt.all_steps() == [4, 6] and ckpt.latest_step() == 6
        assert ckpt.restore(model, optimizer, step=4) == 4
        with pytest.raises(ValueError, match=r"no checkpoint of step 2 in .*; it holds steps \[4, 6\]"):
            ckpt.restore(model, optimizer, step=2)


def test_import_substrax_gives_substrax_checkpoint_without_loading_orbax() -> None:
    probe = (
        "import sys, substrax\n"
        "assert 'orbax' not in sys.modules and 'substrax.checkpoint' not in sys.modules\n"
        "assert 'checkpoint' in dir(substrax) and 'checkpoint' in substrax.__all__\n"
        "assert substrax.checkpoint.CheckpointManager.__module__ == 'substrax.checkpoint._manager'\n"
        "try:\n    substrax.no_such_name\nexcept AttributeError as e:\n    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "module 'substrax' has no attribute 'no_such_name'\n"


class Noisy(nnx.Module):
    """Batch statistics and a dropout stream: state beyond parameters, a typed key among it."""

    def __init__(self, seed: int) -> None:
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.drop(self.norm(self.linear(x)))


def test_batch_statistics_and_random_streams_are_restored(tmp_path: Path) -> None:
    x = jax.numpy.ones((8, 4))
    model = Noisy(0)
    model(x)  # moves the batch statistics and the dropout stream's count
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    checkpoint.save(tmp_path, 1, model, optimizer)
    restored = Noisy(7)
    restored_optimizer = nnx.Optimizer(restored, optax.adam(LR), wrt=nnx.Param)
    checkpoint.restore(tmp_path, restored, restored_optimizer)
    want, got = values(model, optimizer), values(restored, restored_optimizer)
    assert want.keys() == got.keys() and {"0/norm/mean", "0/drop/rngs/key"} <= want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    key = dict(nnx.to_flat_state(nnx.state(restored)))["drop", "rngs", "key"].get_raw_value()
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(np.asarray(restored(x)), np.asarray(model(x)))  # the same dropout mask


# --- errors ------------------------------------------------------------------------


class Wider(MLP):
    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.extra = nnx.Linear(1, 1, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("small")
    checkpoint.save(directory, 3, *build("unplaced"))
    return directory


def test_no_checkpoint_is_an_error(tmp_path: Path) -> None:
    model, optimizer = build("unplaced")
    with pytest.raises(ValueError, match=rf"no checkpoint in {tmp_path}: it holds no committed step"):
        checkpoint.restore(tmp_path, model, optimizer)
    with pytest.raises(ValueError, match=r"no checkpoint in .*nowhere: no such directory"):
        checkpoint.restore(tmp_path / "nowhere", model, optimizer)
    assert not (tmp_path / "nowhere").exists()


def test_a_missing_parameter_is_named(small_checkpoint: Path) -> None:
    model = Wider()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    with pytest.raises(
        ValueError,
        match=r"model\['extra'\]\['bias'\] is in the model or optimizer but not in "
        r"the checkpoint at step 3",
    ):
        checkpoint.restore(small_checkpoint, model, optimizer)


def test_an_extra_parameter_is_named(tmp_path: Path) -> None:
    model = Wider()
    checkpoint.save(tmp_path, 1, model, nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param))
    with pytest.raises(
        ValueError,
        match=r"model\['extra'\]\['bias'\] is in the checkpoint at step 1 .* but "
        r"not in the model or optimizer",
    ):
        checkpoint.restore(tmp_path, *build("unplaced"))


def test_a_different_shape_is_named(small_checkpoint: Path) -> None:
    model, optimizer = build("unplaced", width=8)
    with pytest.raises(
        ValueError,
        match=r"model\['hidden'\]\['bias'\] has shape \(8,\), but the checkpoint "
        r"at step 3 .* holds it with shape \(16,\)",
    ):
        checkpoint.restore(small_checkpoint, model, optimizer)


def test_another_optimizer_is_named(small_checkpoint: Path) -> None:
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.sgd(LR, momentum=0.9), wrt=nnx.Param)
    with pytest.raises(
        ValueError,
        match=r"optimizer\['opt_state'\]\[0\]\['trace'\]\['hidden'\]\['bias'\] "
        r"is in the model or optimizer but not in the checkpoint",
    ):
        checkpoint.restore(small_checkpoint, model, optimizer)


def test_saving_a_step_twice_is_an_error(small_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"step 3 is already saved in "):
        checkpoint.save(small_checkpoint, 3, *build("unplaced"))


def test_a_bound_model_must_be_synced_or_given_as_the_bound_step(
    tmp_path: Path, mesh8: jax.sharding.Mesh
) -> None:
    model, optimizer = build("fsdp", mesh8)
    fast = substrax.make_train_step(mse, "implicit", mesh=mesh8).bind(model, optimizer)
    fast(BATCHES[0])
    with pytest.raises(
        ValueError, match=r"model\['hidden'\]\['bias'\] has been deleted .* call fast.sync\(\)"
    ):
        checkpoint.save(tmp_path, 1, model, optimizer)
    with pytest.raises(TypeError, match="pass a bound step alone"):
        checkpoint.save(tmp_path, 1, fast, optimizer)
    fast(BATCHES[1])
    checkpoint.save(tmp_path, 2, fast)  # synced, then saved
    with pytest.raises(
        ValueError, match=r"model\['hidden'\]\['bias'\] has been deleted .* Restore before binding"
    ):
        fast(BATCHES[2])  # the model's arrays are donated again
        checkpoint.restore(tmp_path, model, optimizer)
    fast.sync()
    assert checkpoint.restore(tmp_path, model, optimizer) == 2


# --- several processes, and a fault --------------------------------------------------


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    directory = tmp_path_factory.mktemp("two-processes")
    return launch(2, 4, "ckpt_worker.py", "train", str(directory), timeout=240), directory


def reported(run: Run, what: str) -> list[float]:
    """The losses both processes printed as ``what``, which must agree."""
    assert run.returncode == 0, run.output
    found = dict(re.findall(rf"^\[(p\d)\] {what} (.*)$", run.stdout, flags=re.M))
    assert found.keys() == {"p0", "p1"} and found["p0"] == found["p1"], run.output
    return json.loads(found["p0"])


def test_two_processes_save_and_resume(two_process_run: tuple[Run, Path]) -> None:
    run, directory = two_process_run
    losses = reported(run, "LOSSES")
    np.testing.assert_allclose(reported(run, "RESUMED"), losses[SAVED:], rtol=RTOL, atol=ATOL)
    # each process wrote the shards it holds, into a database of its own
    written = {p.name for p in (directory / str(SAVED) / "default").glob("ocdbt.process_*")}
    assert written == {"ocdbt.process_0", "ocdbt.process_1"}, written


@pytest.mark.parametrize("mode", substrax.MODES)
@pytest.mark.parametrize("resumed", ["fsdp", "replicated"])
def test_two_processes_save_and_one_resumes(
    two_process_run: tuple[Run, Path], mesh8: jax.sharding.Mesh, mode: str, resumed: str
) -> None:
    """The run saved by 2 processes x 4 devices (explicit mode, FSDP), resumed here on 8 devices."""
    run, directory = two_process_run
    losses = reported(run, "LOSSES")
    model, optimizer = build(resumed, mesh8, seed=1)
    assert checkpoint.restore(directory, model, optimizer) == SAVED
    resumed_losses = train(mode, model, optimizer, BATCHES[SAVED:], mesh8)
    np.testing.assert_allclose(resumed_losses, losses[SAVED:], rtol=RTOL, atol=ATOL)


def test_a_save_killed_before_its_commit_leaves_the_previous_step(
    tmp_path: Path, mesh8: jax.sharding.Mesh
) -> None:
    directory, out = tmp_path / "ckpt", tmp_path / "stdout"
    with out.open("w") as o:
        proc = subprocess.Popen(
            [sys.executable, str(WORKERS / "ckpt_worker.py"), "crash", str(directory)],
            stdout=o,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while "COMMITTING" not in out.read_text():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # every array of step 2 written, the commit not done
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the killed run's claim is left behind
    assert sorted(os.listdir(directory)) == ["1", "2.orbax-checkpoint-tmp", "substrax.lock"]
    claim = json.loads((directory / "substrax.lock").read_text())
    assert claim["pid"] == proc.pid

    model, optimizer = build("fsdp", mesh8, seed=1)
    assert checkpoint.restore(directory, model, optimizer) == 1  # reading takes no claim
    want = values(*build("fsdp", mesh8, seed=0))
    got = values(model, optimizer)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # the run goes on past the broken save, taking over the dead process's claim
    with pytest.warns(UserWarning, match=rf"took over .* from a run that is gone: pid {proc.pid} on "):
        checkpoint.save(directory, 2, model, optimizer)
    assert checkpoint.restore(directory, model, optimizer) == 2
    assert not (directory / "substrax.lock").exists()  # released
