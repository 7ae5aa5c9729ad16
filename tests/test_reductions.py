"""The global reductions (implicit path) and the collectives (inside shard_map), against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from substrax.spmd import (
    all_gather,
    collect_from_devices,
    reduce_custom,
    reduce_max,
    reduce_max_collective,
    reduce_mean,
    reduce_mean_collective,
    reduce_min,
    reduce_min_collective,
    reduce_sum,
    reduce_sum_collective,
)

GLOBAL = {
    "mean": (reduce_mean, np.mean),
    "sum": (reduce_sum, np.sum),
    "max": (reduce_max, np.max),
    "min": (reduce_min, np.min),
}

# Nested trees of dicts / lists / tuples whose leaves are arrays (>= 1 dim), 0-d arrays,
# strings and Python numbers.
_arrays = st.integers(1, 3).flatmap(
    lambda ndim: st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim).flatmap(
        lambda shape: st.lists(
            st.floats(-100, 100, allow_nan=False, width=32),
            min_size=int(np.prod(shape)),
            max_size=int(np.prod(shape)),
        ).map(lambda v: np.asarray(v, np.float32).reshape(shape))
    )
)
_leaves = st.one_of(
    _arrays, st.floats(-5, 5, width=32).map(np.float32), st.text(max_size=3), st.integers(-3, 3)
)
_trees = st.recursive(
    _leaves,
    lambda kids: st.one_of(
        st.dictionaries(st.text("abc", min_size=1, max_size=2), kids, max_size=3),
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
    ),
    max_leaves=8,
)


def _expected(tree: object, fn: object) -> object:
    return jax.tree.map(lambda x: fn(x) if isinstance(x, np.ndarray) and x.ndim else x, tree)


@pytest.mark.parametrize("op", list(GLOBAL))
@settings(max_examples=25, deadline=None)
@given(tree=_trees)
def test_global_reductions_match_numpy_on_any_tree(op: str, tree: object) -> None:
    reduce, np_fn = GLOBAL[op]
    got = reduce(tree)
    want = _expected(tree, np_fn)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if isinstance(w, (str, int)) and not isinstance(w, np.generic):
            assert g is w or g == w
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-3)


def test_global_reduction_of_gradient_tree_beside_scalars() -> None:
    tree = {
        "grads": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)},
        "loss": jnp.float32(2.0),
        "tag": "x",
    }
    out = reduce_sum(tree)
    assert float(out["grads"]["w"]) == 15.0 and float(out["grads"]["b"]) == 3.0
    assert float(out["loss"]) == 2.0 and out["tag"] == "x"


def test_global_reduction_of_sharded_arrays_under_jit(mesh8: jax.sharding.Mesh) -> None:
    from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    placed = place_batch_on_shards({"x": x}, create_data_parallel_sharding(mesh8))
    with jax.set_mesh(mesh8):
        out = jax.jit(lambda t: (reduce_max(t), reduce_mean(t)))(placed)
    assert float(out[0]["x"]) == 31.0 and float(out[1]["x"]) == 15.5


def test_reduce_custom() -> None:
    m = {
        "a": np.arange(4.0),
        "b": np.arange(4.0),
        "c": np.arange(4.0),
        "d": np.arange(4.0),
        "e": np.arange(4.0),
        "s": "txt",
    }
    out = reduce_custom(m, {"b": "sum", "c": "max", "d": "min", "e": None})
    assert float(out["a"]) == 1.5  # not named: mean
    assert float(out["b"]) == 6.0 and float(out["c"]) == 3.0 and float(out["d"]) == 0.0
    np.testing.assert_array_equal(out["e"], np.arange(4.0))  # None: as it is
    assert out["s"] == "txt"
    assert {k: float(v) for k, v in reduce_custom({"x": np.array([1.0, 3.0])}).items()} == {"x": 2.0}


def test_reduce_custom_rejects_unknown_operation() -> None:
    with pytest.raises(
        ValueError,
        match=r"Metric 'acc' asks for reduction 'avg'; use one of 'mean', 'sum', 'max', 'min' or None",
    ):
        reduce_custom({"acc": np.ones(3)}, {"acc": "avg"})


COLLECTIVE = {
    "mean": (reduce_mean_collective, np.mean),
    "sum": (reduce_sum_collective, np.sum),
    "max": (reduce_max_collective, np.max),
    "min": (reduce_min_collective, np.min),
}


@pytest.mark.parametrize("op", list(COLLECTIVE))
def test_collectives_reduce_every_leaf_across_devices(mesh8: jax.sharding.Mesh, op: str) -> None:
    collective, np_fn = COLLECTIVE[op]
    rng = np.random.default_rng(1)
    per_device = {
        "loss": rng.normal(size=(8,)).astype(np.float32),
        "grads": {"w": rng.normal(size=(8, 2, 3)).astype(np.float32)},
    }

    def body(tree: dict) -> dict:
        local = {"loss": tree["loss"][0], "grads": {"w": tree["grads"]["w"][0]}, "name": "metrics"}
        out = collective(local, axis_name="data")
        assert out["name"] == "metrics"  # non-array leaves pass through
        return {"loss": out["loss"], "grads": out["grads"]}

    out = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("data"), out_specs=P()))(per_device)
    np.testing.assert_allclose(out["loss"], np_fn(per_device["loss"], axis=0), rtol=1e-5)
    np.testing.assert_allclose(
        out["grads"]["w"], np_fn(per_device["grads"]["w"], axis=0), rtol=1e-5, atol=1e-6
    )


def test_all_gather_stacked_and_tiled(mesh8: jax.sharding.Mesh) -> None:
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)

    def body(shard: jax.Array) -> tuple:
        stacked = all_gather({"rows": shard, "n": jnp.sum(shard)}, axis_name="data")
        tiled = all_gather({"rows": shard}, axis_name="data", tiled=True)
        return stacked, tiled

    stacked, tiled = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("data"), out_specs=P()))(x)
    np.testing.assert_array_equal(stacked["rows"], x.reshape(8, 2, 3))
    np.testing.assert_array_equal(stacked["n"], x.reshape(8, 6).sum(1))  # a scalar per device
    np.testing.assert_array_equal(tiled["rows"], x)


def test_collect_from_devices() -> None:
    out = collect_from_devices({"loss": np.arange(4.0), "step": 3, "scalar": np.float32(1.0)})
    assert [float(v) for v in out["loss"]] == [0.0, 1.0, 2.0, 3.0]
    assert out["step"] == 3 and out["scalar"] == 1.0
