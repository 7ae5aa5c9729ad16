"""``substrax.plan`` for a TPU v5e topology from this CPU (libtpu, no TPU; make test-tpu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from conftest import MLP, mse, needs_libtpu
from flax import nnx

import substrax
from substrax.mesh import topology_mesh

pytestmark = needs_libtpu


def _abstract() -> tuple[MLP, nnx.Optimizer]:
    def build() -> tuple[MLP, nnx.Optimizer]:
        model = MLP(128, 512, 128)
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    return nnx.eval_shape(build)


BATCH = {"x": jax.ShapeDtypeStruct((64, 128), jnp.float32), "y": jax.ShapeDtypeStruct((64, 128), jnp.float32)}


def test_plan_on_v5e_2x4_gives_each_layout_and_mode_a_row() -> None:
    meshes = [topology_mesh("v5e:2x4", {"data": 8}), topology_mesh("v5e:2x4", {"replica": 2, "data": 4})]
    found = substrax.plan(mse, *_abstract(), BATCH, mesh=meshes, mode=("explicit", "implicit"))
    rows = {(r.mode, r.layout, r.mesh): r for r in found.rows}
    assert len(rows) == len(found.rows) == 14  # 3 layouts on data=8, 4 on replica=2,data=4; both modes
    for mode in ("explicit", "implicit"):
        state = [rows[mode, k, "data=8"].state_bytes for k in ("fsdp", "zero1", "replicated")]
        assert state[0] < state[1] < state[2]
    # the state's bytes per device are the layout's, counted from the placed shardings
    model, optimizer = _abstract()
    placed = substrax.shard_state(model, optimizer, mesh=meshes[1], layout="hsdp")
    assert rows["explicit", "hsdp", "replica=2,data=4"].state_bytes == placed.bytes_per_device
    assert found.best().total_bytes == min(r.total_bytes for r in found.rows)
