from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from models import Partitioned

from substrax.mesh import create_device_mesh
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards, place_nnx_state_on_shards

P = PartitionSpec


def test_data_parallel_sharding(mesh8: jax.sharding.Mesh) -> None:
    s = create_data_parallel_sharding(mesh8)
    assert isinstance(s, NamedSharding) and s.spec == P("data") and s.mesh == mesh8
    mesh = create_device_mesh({"batch": 4, "model": 2})
    assert create_data_parallel_sharding(mesh, "batch").spec == P("batch")


def test_data_parallel_sharding_unknown_axis(mesh8: jax.sharding.Mesh) -> None:
    with pytest.raises(
        ValueError, match=r"axis 'batch' of .* is not in the mesh, whose axes are \('data',\)"
    ):
        create_data_parallel_sharding(mesh8, "batch")


def test_every_kind_of_leaf(mesh8: jax.sharding.Mesh) -> None:
    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    batch = {"np": x, "jax": jnp.asarray(x) + 1, "name": "run-1", "n": 3}
    placed = place_batch_on_shards(batch, create_data_parallel_sharding(mesh8))
    for key, want in (("np", x), ("jax", x + 1)):
        assert isinstance(placed[key], jax.Array)
        assert placed[key].sharding.spec == P("data")
        np.testing.assert_array_equal(np.asarray(placed[key]), want)
        # each device holds its own two rows
        for shard in placed[key].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
            assert shard.data.shape == (2, 2)
    assert placed["name"] == "run-1" and placed["n"] == 3


def test_prefix_rows_and_replicated_batch_state(mesh8: jax.sharding.Mesh) -> None:
    rows = {"x": np.ones((8, 3), np.float32), "y": np.zeros((8,), np.float32)}
    batch = {"rows": rows, "batch_state": {"lam": np.float32(0.5), "w": np.arange(3.0)}}
    replicated = NamedSharding(mesh8, P())
    placed = place_batch_on_shards(
        batch, {"rows": create_data_parallel_sharding(mesh8), "batch_state": replicated}
    )
    assert placed["rows"]["x"].sharding.spec == P("data")
    assert placed["batch_state"]["lam"].shape == ()
    assert placed["batch_state"]["lam"].sharding.is_fully_replicated
    assert float(placed["batch_state"]["lam"]) == 0.5
    np.testing.assert_array_equal(np.asarray(placed["batch_state"]["w"]), np.arange(3.0))


def test_scalar_under_data_sharding_names_its_path(mesh8: jax.sharding.Mesh) -> None:
    batch = {"rows": np.ones((8, 3)), "batch_state": {"lam": np.float32(0.5)}}
    with pytest.raises(
        ValueError, match=r"batch\['batch_state'\]\['lam'\] has shape \(\) .* splits dimension 0"
    ):
        place_batch_on_shards(batch, create_data_parallel_sharding(mesh8))


def test_indivisible_rows_name_path_size_and_axis(mesh8: jax.sharding.Mesh) -> None:
    batch = {"x": np.ones((12, 3)), "y": [np.ones(16), np.ones(10)]}
    with pytest.raises(
        ValueError,
        match=(
            r"batch\['y'\]\[1\] has size 10 along dimension 0, which does not divide by 8, "
            r"the size of mesh axis 'data' \(8\)"
        ),
    ):
        place_batch_on_shards({"y": batch["y"]}, create_data_parallel_sharding(mesh8))
    with pytest.raises(ValueError, match=r"batch\['x'\] has size 12 .* multiple of 8"):
        place_batch_on_shards(batch, create_data_parallel_sharding(mesh8))


def test_indivisible_over_two_axes() -> None:
    mesh = create_device_mesh({"data": 4, "model": 2})
    sharding = NamedSharding(mesh, P(("data", "model")))
    with pytest.raises(
        ValueError, match=r"does not divide by 8, the size of mesh axis 'data' \(4\) x 'model' \(2\)"
    ):
        place_batch_on_shards(np.ones((12,)), sharding)


def test_prefix_that_does_not_fit_names_the_subtree(mesh8: jax.sharding.Mesh) -> None:
    s = create_data_parallel_sharding(mesh8)
    batch = {"rows": {"x": np.ones((8, 2)), "y": np.ones(8)}, "extra": np.ones(8)}
    with pytest.raises(
        ValueError,
        match=r"does not fit the batch at batch \(the root\).*keys \['rows'\].*keys \['extra', 'rows'\]",
    ):
        place_batch_on_shards(batch, {"rows": s})
    with pytest.raises(
        ValueError, match=r"at batch\['rows'\]: the sharding tree has a dict with keys \['x', 'z'\]"
    ):
        place_batch_on_shards(batch, {"rows": {"x": s, "z": s}, "extra": s})
    with pytest.raises(ValueError, match=r"holds 'data' at batch\['extra'\], which is not a sharding"):
        place_batch_on_shards(batch, {"rows": s, "extra": "data"})
    with pytest.raises(
        ValueError, match=r"which is not a sharding. Wrap a PartitionSpec as NamedSharding\(mesh, spec\)"
    ):
        place_batch_on_shards(batch, {"rows": s, "extra": P("data")})


def test_sharding_on_an_axis_the_mesh_lacks(mesh8: jax.sharding.Mesh) -> None:
    # jax refuses the sharding itself, naming the axis and the mesh's axes
    with pytest.raises(ValueError, match=r"model.*not found in mesh: \('data',\)"):
        place_batch_on_shards(np.ones(8), NamedSharding(mesh8, P("model")))


def test_traced_leaf_is_refused(mesh8: jax.sharding.Mesh) -> None:
    s = create_data_parallel_sharding(mesh8)
    with pytest.raises(TypeError, match=r"batch\['x'\] is a traced value.*outside jax.jit"):
        jax.jit(lambda x: place_batch_on_shards({"x": x}, s))(np.ones(8))


def test_nnx_state_declared_filters_and_one_spec() -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    with jax.set_mesh(mesh):
        state = nnx.state(Partitioned())
    declared = place_nnx_state_on_shards(state, mesh, None)
    assert declared["wide"]["kernel"].get_value().sharding.spec == P(None, "model")
    assert declared["head"]["kernel"].get_value().sharding.is_fully_replicated
    np.testing.assert_array_equal(
        np.asarray(declared["wide"]["kernel"].get_value()), np.asarray(state["wide"]["kernel"].get_value())
    )

    by_filter = place_nnx_state_on_shards(
        state, mesh, {nnx.PathContains("kernel"): P("model"), nnx.BatchStat: P()}
    )
    assert by_filter["head"]["kernel"].get_value().sharding.spec == P("model")
    assert by_filter["head"]["bias"].get_value().sharding.is_fully_replicated
    assert by_filter["count"].get_value().sharding.is_fully_replicated

    everything = place_nnx_state_on_shards(nnx.state(state, nnx.Param), mesh, P())
    assert all(v.sharding.is_fully_replicated for v in jax.tree.leaves(everything))


def test_nnx_state_errors() -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    with jax.set_mesh(mesh):
        state = nnx.state(Partitioned())
    with pytest.raises(
        ValueError, match=r"axis 'rows' of .* not in the mesh, whose axes are \('data', 'model'\)"
    ):
        place_nnx_state_on_shards(state, mesh, {nnx.PathContains("kernel"): P("rows")})
    with pytest.raises(
        ValueError,
        match=(
            r"state\['head'\]\['bias'\] has size 2 along dimension 0, which does not divide by 4.* "
            r"Make that size a multiple of 4\.$"
        ),
    ):
        place_nnx_state_on_shards(state, mesh, {nnx.PathContains("bias"): P("model")})
    with pytest.raises(
        ValueError,
        match=(
            r"state\['head'\]\['bias'\] has shape \(2,\) .* "
            r"give it a spec with no more dimensions than it has"
        ),
    ):
        place_nnx_state_on_shards(state, mesh, {nnx.PathContains("bias"): P(None, "model")})
    with pytest.raises(
        TypeError, match=r"takes a state, not the module Partitioned: pass nnx.state\(model\)"
    ):
        place_nnx_state_on_shards(Partitioned.__new__(Partitioned), mesh, P())
