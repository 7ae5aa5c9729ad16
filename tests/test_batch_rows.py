"""Leaves split over the data axis must have the same number of rows, in both modes."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from conftest import MLP, mse
from flax import nnx
from jax.sharding import PartitionSpec

import substrax
from substrax.explicit import batch_partition_specs

MESSAGE = (
    r"The batch's leaves split over 'data' do not have the same number of rows "
    r"\(batch\['x'\] has 32, batch\['y'\] has 8\)"
)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_leaf_with_fewer_rows_is_refused_before_the_split(mesh8: jax.sharding.Mesh, mode: str) -> None:
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    batch = {"x": np.ones((32, 4), np.float32), "y": np.ones((8, 1), np.float32)}  # one label per device
    with pytest.raises(ValueError, match=MESSAGE):
        step(model, optimizer, batch)


def test_replicated_and_non_data_leaves_are_not_counted(mesh8: jax.sharding.Mesh) -> None:
    batch = {"x": np.ones((32, 4)), "y": np.ones((32, 1)), "lam": np.ones((3,))}
    spec = {"x": PartitionSpec("data"), "y": PartitionSpec("data"), "lam": PartitionSpec()}
    assert batch_partition_specs(batch, spec, mesh8, "data") == spec
    with pytest.raises(ValueError, match=r"batch\['x'\] has 32, batch\['y'\] has 16"):
        batch_partition_specs({"x": np.ones((32, 4)), "y": np.ones((16,))}, None, mesh8, "data")
