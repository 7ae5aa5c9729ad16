"""A "gather" metric comes back replicated in both modes (readable on every process)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, regression_batches
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import substrax
from substrax.spmd._metrics import reduce_metrics


def _loss(model: MLP, batch: dict) -> tuple[jax.Array, dict]:
    err = (model(batch["x"]) - batch["y"])[:, 0]
    return jnp.mean(err**2), {"per_example": err}


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_gathered_metric_is_replicated(mesh8: jax.sharding.Mesh, mode: str) -> None:
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    batch = regression_batches(1, rows=32)[0]
    want = (np.asarray(model(jnp.asarray(batch["x"]))) - batch["y"])[:, 0]
    step = substrax.make_train_step(_loss, mode, mesh=mesh8, has_aux=True, reduce={"per_example": "gather"})
    _, metrics = step(model, optimizer, batch)
    assert metrics["per_example"].sharding.is_fully_replicated, metrics["per_example"].sharding
    np.testing.assert_allclose(metrics["per_example"], want, rtol=1e-5, atol=1e-6)


def test_reduce_metrics_replicates_over_a_given_mesh(mesh8: jax.sharding.Mesh) -> None:
    split = jax.device_put(np.arange(16.0), NamedSharding(mesh8, PartitionSpec("data")))
    out = jax.jit(lambda m: reduce_metrics(m, {"v": "gather"}, mesh=mesh8))({"v": split})
    assert out["v"].sharding.is_fully_replicated
    # without a mesh (none given, none set) the value stays where it is
    out = jax.jit(lambda m: reduce_metrics(m, {"v": "gather"}))({"v": split})
    assert not out["v"].sharding.is_fully_replicated
