"""The examples of the SPMD reference (shared/spec/spmd-reference.txt), as written there.

Each runs in both modes: ``spmd_train_step`` and its explicit twin
``substrax.explicit.explicit_train_step``, called the same way inside the user's own
``nnx.jit``. The reference leaves the model, the loss and the batch to the reader; they
are filled in here, and every result is checked against plain nnx on one device, on the
whole batch, with no mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, assert_params_close, mse, one_device_training, params_of, regression_batches
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import substrax
from substrax.explicit import explicit_train_step
from substrax.mesh import DeviceMeshManager
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards, spmd_train_step

LR = 1e-2
STEPS = 3
STEP_FUNCTIONS: dict[str, Callable[..., Any]] = {"implicit": spmd_train_step, "explicit": explicit_train_step}


def penalized_loss(model: MLP, batch: dict) -> jax.Array:
    """Rows on the data axis, and a batch-level weight ``lam`` that has no batch axis."""
    rows = batch["rows"]
    penalty = jnp.sum(model.hidden.kernel.get_value() ** 2)
    return jnp.mean((model(rows["x"]) - rows["y"]) ** 2) + batch["batch_state"]["lam"] * penalty


def with_lam(batch: dict[str, np.ndarray], lam: Any) -> dict:
    return {"rows": {"x": batch["x"], "y": batch["y"]}, "batch_state": {"lam": lam}}


def one_device(loss_fn: Callable[..., jax.Array], batches: list[Any]) -> tuple[list[float], dict]:
    """Plain nnx on one device, no mesh, no sharding: what every example must match."""
    losses, model = one_device_training(batches, optax.adam(LR), loss_fn=loss_fn)
    return losses, params_of(model)


def check(losses: list, model: MLP, want: tuple[list[float], dict]) -> None:
    np.testing.assert_allclose([float(x) for x in losses], want[0], rtol=1e-5)
    assert_params_close(params_of(model), want[1])


@pytest.mark.parametrize("mode", substrax.MODES)
def test_first_example_data_parallel_step(mode: str) -> None:
    step_fn = STEP_FUNCTIONS[mode]
    loss_fn = mse
    batches = regression_batches(STEPS, rows=32)
    want = one_device(loss_fn, batches)
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    # --- the reference, verbatim but for spmd_train_step's explicit twin in explicit mode
    mesh = DeviceMeshManager.create_device_mesh({"data": jax.device_count()})
    sharding = create_data_parallel_sharding(mesh)

    @nnx.jit
    def train_step(model, optimizer, batch):
        return step_fn(model, optimizer, loss_fn, batch)

    losses = []
    for batch in batches:
        with jax.set_mesh(mesh):
            loss = train_step(model, optimizer, place_batch_on_shards(batch, sharding))
        losses.append(loss)
    # ---
    check(losses, model, want)


@pytest.mark.parametrize("lam_kind", ["numpy_scalar", "0d_array", "python_float"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_rows_on_the_data_axis_and_a_replicated_batch_level_value(mode: str, lam_kind: str) -> None:
    # The regression: a 0-d lam placed replicated was split over 'data' inside the user's jit.
    step_fn = STEP_FUNCTIONS[mode]
    lam = {"numpy_scalar": np.float32(0.05), "0d_array": np.asarray(0.05, np.float32), "python_float": 0.05}[
        lam_kind
    ]
    batches = regression_batches(STEPS, rows=32)
    want = one_device(penalized_loss, [with_lam(b, lam) for b in batches])
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    loss_fn = penalized_loss

    mesh = DeviceMeshManager.create_device_mesh({"data": jax.device_count()})
    sharding = create_data_parallel_sharding(mesh)

    @nnx.jit
    def train_step(model, optimizer, batch):
        return step_fn(model, optimizer, loss_fn, batch)

    losses = []
    for b in batches:
        x, y = b["x"], b["y"]
        # --- the reference, verbatim
        replicated = NamedSharding(mesh, PartitionSpec())
        batch = {"rows": {"x": x, "y": y}, "batch_state": {"lam": lam}}
        placed = place_batch_on_shards(batch, {"rows": sharding, "batch_state": replicated})
        # ---
        with jax.set_mesh(mesh):
            losses.append(train_step(model, optimizer, placed))
    check(losses, model, want)
    if lam_kind != "python_float":  # a Python float is not an array leaf: returned as it is
        assert placed["batch_state"]["lam"].sharding.is_fully_replicated


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_batch_level_scalar_needs_no_placement_inside_the_users_jit(mode: str) -> None:
    # Unplaced, inside nnx.jit: the step cannot see a placement, and a 0-d leaf has no rows.
    step_fn = STEP_FUNCTIONS[mode]
    batches = [with_lam(b, np.float32(0.05)) for b in regression_batches(STEPS, rows=32)]
    want = one_device(penalized_loss, batches)
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    mesh = DeviceMeshManager.create_device_mesh({"data": jax.device_count()})

    @nnx.jit
    def train_step(model, optimizer, batch):
        return step_fn(model, optimizer, penalized_loss, batch)

    with jax.set_mesh(mesh):
        losses = [train_step(model, optimizer, b) for b in batches]
    check(losses, model, want)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_make_train_step_takes_the_prefix_placed_batch(mode: str) -> None:
    batches = regression_batches(STEPS, rows=32)
    want = one_device(penalized_loss, [with_lam(b, np.float32(0.05)) for b in batches])
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    mesh = DeviceMeshManager.create_device_mesh({"data": jax.device_count()})
    sharding = create_data_parallel_sharding(mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    step = substrax.make_train_step(penalized_loss, mode, mesh=mesh)
    losses = [
        step(
            model,
            optimizer,
            place_batch_on_shards(
                with_lam(b, np.float32(0.05)), {"rows": sharding, "batch_state": replicated}
            ),
        )
        for b in batches
    ]
    check(losses, model, want)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_docstring_example_on_four_of_the_devices(mode: str) -> None:
    # spmd_train_step's docstring: a {"data": 4} mesh and a host batch passed as it is.
    step_fn = STEP_FUNCTIONS[mode]
    my_loss_fn = mse
    batches = regression_batches(STEPS, rows=32)
    want = one_device(my_loss_fn, batches)
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    # --- the reference, verbatim but for the undefined data_parallel_rules() it also calls
    mesh = DeviceMeshManager.create_device_mesh({"data": 4})

    @nnx.jit
    def train_step(model, optimizer, batch):
        return step_fn(model, optimizer, my_loss_fn, batch)

    losses = []
    for batch in batches:
        with jax.set_mesh(mesh):
            loss = train_step(model, optimizer, batch)
        losses.append(loss)
    # ---
    check(losses, model, want)


def test_a_scalar_under_the_data_axis_sharding_is_refused_with_its_path() -> None:
    # "A leaf with fewer dimensions than its sharding splits ... is refused with its path."
    mesh = DeviceMeshManager.create_device_mesh({"data": jax.device_count()})
    sharding = create_data_parallel_sharding(mesh)
    batch = {"rows": {"x": np.ones((8, 4), np.float32)}, "batch_state": {"lam": np.float32(0.5)}}
    with pytest.raises(ValueError, match=r"batch\['batch_state'\]\['lam'\] has shape \(\) \(0 dimensions\)"):
        place_batch_on_shards(batch, sharding)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_batch_spec_that_splits_a_scalar_is_still_refused(mode: str) -> None:
    # Only the default replicates a 0-d leaf; a spec that says to split it is an error.
    mesh = DeviceMeshManager.create_device_mesh({"data": jax.device_count()})
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    batch = with_lam(regression_batches(1, rows=32)[0], np.float32(0.05))
    spec = {"rows": PartitionSpec("data"), "batch_state": PartitionSpec("data")}

    @nnx.jit
    def train_step(model, optimizer, batch):
        return STEP_FUNCTIONS[mode](model, optimizer, penalized_loss, batch, batch_spec=spec)

    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"batch\['batch_state'\]\['lam'\] has shape \(\) \(0 dimensions\)"),
    ):
        train_step(model, optimizer, batch)
