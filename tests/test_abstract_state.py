"""Abstract state (``nnx.eval_shape``'s ``jax.ShapeDtypeStruct`` leaves) placed, lowered and planned.

Each is held against the same model built concretely: the placement, the layout's bytes, the
lowered program and the plan must be the same; running abstract state is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, mse
from flax import nnx

import substrax
from substrax._plan._rows import _per_device


def _concrete() -> tuple[MLP, nnx.Optimizer]:
    model = MLP(16, 64, 4)
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def _abstract() -> tuple[MLP, nnx.Optimizer]:
    return nnx.eval_shape(_concrete)


def _leaves(model: MLP, optimizer: nnx.Optimizer) -> list:
    return jax.tree.leaves(nnx.state((model, optimizer)))


BATCH = {"x": jax.ShapeDtypeStruct((32, 16), jnp.float32), "y": jax.ShapeDtypeStruct((32, 4), jnp.float32)}


def _mesh(layout: str) -> jax.sharding.Mesh:
    shape = {"replica": 2, "data": 4} if layout == "hsdp" else {"data": 8}
    return substrax.mesh.create_device_mesh(shape)


@pytest.mark.parametrize("layout", ["replicated", "zero1", "fsdp", "hsdp"])
def test_shard_state_leaves_abstract_state_abstract_with_the_concrete_placement(layout: str) -> None:
    mesh = _mesh(layout)
    model, optimizer = _abstract()
    placed = substrax.shard_state(model, optimizer, mesh=mesh, layout=layout, min_size=16)
    reference = substrax.shard_state(*(c := _concrete()), mesh=mesh, layout=layout, min_size=16)
    leaves, arrays = _leaves(model, optimizer), _leaves(*c)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert [(x.shape, x.dtype) for x in leaves] == [(a.shape, a.dtype) for a in arrays]
    assert [x.sharding for x in leaves] == [a.sharding for a in arrays]
    assert placed.bytes_per_device == reference.bytes_per_device
    # each leaf's bytes on one device, by its sharding, as the arrays hold them
    assert [_per_device(x, 1) for x in leaves] == [a.addressable_shards[0].data.nbytes for a in arrays]
    assert str(placed) == str(reference)


@pytest.mark.parametrize("mode", ["explicit", "implicit"])
@pytest.mark.parametrize("sharded_batch", [False, True])
def test_an_abstract_step_lowers_to_the_concrete_program(mode: str, sharded_batch: bool) -> None:
    mesh = _mesh("fsdp")
    model, optimizer = _abstract()
    substrax.shard_state(model, optimizer, mesh=mesh, min_size=16)
    concrete = _concrete()
    substrax.shard_state(*concrete, mesh=mesh, min_size=16)
    batch = BATCH
    if sharded_batch:
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows) for k, v in BATCH.items()}
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    lowered = step.lower(model, optimizer, batch, donate=True)
    assert lowered.as_text() == step.lower(*concrete, batch, donate=True).as_text()
    census = step.check_communication(model, optimizer, batch)
    reference = step.check_communication(*concrete, batch)
    assert census.matches and str(census) == str(reference)
    assert len(step.traced(model, optimizer, batch).jaxpr.in_avals) == len(_leaves(model, optimizer)) + 2


def test_plan_of_abstract_state_is_the_plan_of_the_arrays() -> None:
    meshes = [_mesh("fsdp"), _mesh("hsdp")]
    got = substrax.plan(mse, *_abstract(), BATCH, mesh=meshes, placement={"min_size": 16})
    batch = {k: np.zeros(v.shape, v.dtype) for k, v in BATCH.items()}
    want = substrax.plan(mse, *_concrete(), batch, mesh=meshes, placement={"min_size": 16})
    assert len(got.rows) == len(want.rows) == 7
    for g, w in zip(got.rows, want.rows, strict=True):
        assert g.bytes == w.bytes
        assert (g.state_bytes, g.batch_bytes, g.peak_bytes) == (w.state_bytes, w.batch_bytes, w.peak_bytes)


def test_running_abstract_state_is_refused_naming_the_leaf() -> None:
    mesh = _mesh("fsdp")
    model, optimizer = _abstract()
    substrax.shard_state(model, optimizer, mesh=mesh, min_size=16)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    with pytest.raises(TypeError, match=r"model\['hidden'\]\['bias'\] is abstract .*runs on arrays"):
        step(model, optimizer, BATCH)
    with pytest.raises(TypeError, match=r"model\['hidden'\]\['bias'\] is abstract"):
        step.bind(model, optimizer)
