"""The update sees whole tensors in every mode and layout; per-device state is refused, not averaged.

Regression tests for "correct by construction": an optimizer that reads a whole tensor
(``clip_by_global_norm``, ``lamb``, ``adafactor``) gives the one-device result under
ZeRO-1 and FSDP in both modes; replicated state other than ``nnx.BatchStat`` that comes
out different per device is an error naming it; BatchNorm trains with microbatches.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, Normed, mse, noise_floor, params_of, reference_training, regression_batches
from flax import nnx

import substrax
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

CLIP = 1e-3  # far below the test MLP's gradient norm (asserted), so every step clips

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "clip+momentum": lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(0.5, momentum=0.9)),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(1e-2, weight_decay=0.1)),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
}
ADAM_FAMILY = {"clip+adamw", "lamb", "adafactor"}


def test_the_clip_threshold_is_below_the_gradient_norm() -> None:
    batch = regression_batches(1, rows=32)[0]
    grads = nnx.grad(mse)(MLP(), batch)
    assert float(optax.tree.norm(grads)) > 20 * CLIP


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_whole_tensor_optimizers_match_one_device_under_split_state(
    mesh8: jax.sharding.Mesh, mode: str, layout: str, optimizer_name: str
) -> None:
    batches = regression_batches(4, rows=32)
    want_losses, want = reference_training(batches, tx=OPTIMIZERS[optimizer_name]())
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, OPTIMIZERS[optimizer_name](), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh8, params=layout == "fsdp", min_size=1)
    before = substrax.layout_of(model, optimizer)
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    sharding = create_data_parallel_sharding(mesh8)
    losses = [float(step(model, optimizer, place_batch_on_shards(b, sharding))) for b in batches]
    got = params_of(model)
    if optimizer_name in ADAM_FAMILY:  # Adam-family: to the measured floor of two valid one-device runs
        atol, rtol = 4 * noise_floor(OPTIMIZERS[optimizer_name], batches) + 1e-7, 0.0
    else:  # SGD: strictly
        atol, rtol = 1e-6, 1e-5
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)
    assert substrax.layout_of(model, optimizer) == before


class Tally(nnx.Variable):
    """A float state that is not a BatchStat: the step must not average it."""


class Tallying(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.seen = Tally(jnp.zeros(()))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.seen.set_value(self.seen.get_value() + jnp.mean(x[:, 0]))
        return super().__call__(x)


def test_replicated_state_that_varies_per_device_is_refused_not_averaged(mesh8: jax.sharding.Mesh) -> None:
    with jax.set_mesh(mesh8):
        model = Tallying()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = place_batch_on_shards(regression_batches(1, rows=32)[0], create_data_parallel_sharding(mesh8))
    step = substrax.make_train_step(mse, "explicit", mesh=mesh8)
    with pytest.raises(
        ValueError, match=r"model\['seen'\] \(Tally, float32\) came out of the step different on each device"
    ):
        step(model, optimizer, batch)


def _per_slice_reference(batch: dict, devices: int, microbatches: int, lr: float) -> tuple[float, Normed]:
    """One SGD step on one device where each (device, microbatch) slice normalizes with its own
    statistics: the gradient is the mean of the slices' gradients, each device's running
    statistics take its microbatches in order, and the devices' statistics are averaged."""
    model = Normed()
    rows = len(batch["x"]) // (devices * microbatches)
    grads, losses, means, variances = [], [], [], []
    for d in range(devices):
        copy = nnx.clone(model)
        for j in range(microbatches):
            start = (d * microbatches + j) * rows
            piece = {k: v[start : start + rows] for k, v in batch.items()}
            loss, g = nnx.value_and_grad(mse)(copy, piece)
            grads.append(g)
            losses.append(float(loss))
        means.append(np.asarray(copy.norm.mean.get_value()))
        variances.append(np.asarray(copy.norm.var.get_value()))
    mean_grad = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param).update(model, mean_grad)
    model.norm.mean.set_value(jnp.asarray(np.mean(means, axis=0)))
    model.norm.var.set_value(jnp.asarray(np.mean(variances, axis=0)))
    return float(np.mean(losses)), model


@pytest.mark.parametrize("microbatches", [2, 4])
def test_batchnorm_without_axis_name_trains_with_microbatches_in_explicit_mode(
    mesh8: jax.sharding.Mesh, microbatches: int
) -> None:
    batch = regression_batches(1, rows=256)[0]  # 8 rows per slice: a well-posed variance
    want_loss, want = _per_slice_reference(batch, 8, microbatches, lr=0.1)
    with jax.set_mesh(mesh8):
        model = Normed()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh8, microbatches=microbatches)
    loss = step(model, optimizer, place_batch_on_shards(batch, create_data_parallel_sharding(mesh8)))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    got, ref = params_of(model), params_of(want)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for stat in ("mean", "var"):
        np.testing.assert_allclose(
            getattr(model.norm, stat).get_value(), getattr(want.norm, stat).get_value(), rtol=1e-5, atol=1e-6
        )
        assert getattr(model.norm, stat).get_value().sharding.is_fully_replicated


def test_batchnorm_with_axis_name_and_microbatches_matches_the_implicit_step(
    mesh8: jax.sharding.Mesh,
) -> None:
    # Each microbatch normalizes with its global statistics: implicit mode by seeing the
    # global microbatch, explicit mode by the layer's own pmean over axis_name.
    batches = regression_batches(3, rows=64)
    results = {}
    for m, axis_name in (("implicit", None), ("explicit", "data")):
        with jax.set_mesh(mesh8):
            model = Normed(axis_name)
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = substrax.make_train_step(mse, m, mesh=mesh8, microbatches=2)
        sharding = create_data_parallel_sharding(mesh8)
        losses = [float(step(model, optimizer, place_batch_on_shards(b, sharding))) for b in batches]
        results[m, axis_name] = (losses, params_of(model), np.asarray(model.norm.var.get_value()))
    (l1, p1, v1), (l2, p2, v2) = results.values()
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-6)
    for name in p1:
        np.testing.assert_allclose(p1[name], p2[name], rtol=1e-5, atol=1e-6, err_msg=name)
