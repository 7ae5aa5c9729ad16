"""``substrax.plan`` for a TPU v5e topology from this CPU (libtpu, no TPU; make test-tpu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, mse, needs_libtpu
from flax import nnx
from models import abstract_batch, abstract_mlp

import substrax
from substrax.census import census
from substrax.mesh import topology_mesh

pytestmark = needs_libtpu


def _abstract() -> tuple[MLP, nnx.Optimizer]:
    return abstract_mlp(128, 512, 128)


BATCH = abstract_batch(64, 128, 128)


def test_the_estimate_on_v5e_2x4_gives_each_layout_and_mode_a_row() -> None:
    meshes = [topology_mesh("v5e:2x4", {"data": 8}), topology_mesh("v5e:2x4", {"replica": 2, "data": 4})]
    modes = ("explicit", "implicit")
    found = substrax.plan(mse, *_abstract(), BATCH, mesh=meshes, mode=modes, compiled=False)
    assert {r.compiler for r in found.rows} == {"XLA:CPU rules (estimated)"}
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


def test_the_plan_on_a_tpu_mesh_is_the_compiled_programs_memory() -> None:
    """Each row's peak is the TPU compiler's memory_analysis() of the row's own step, donated."""
    mesh = topology_mesh("v5e:2x4", {"replica": 2, "data": 4})
    found = substrax.plan(mse, *_abstract(), BATCH, mesh=mesh, mode=("explicit", "implicit"))
    assert len(found.rows) == 8
    assert {r.compiler for r in found.rows} == {"tpu (compiled)"}
    assert "peak GiB (compiled)" in str(found)
    for row in found.rows:
        model, optimizer = _abstract()
        row.shard_state(model, optimizer)
        program = row.make_train_step(mse).lower(model, optimizer, BATCH, donate=True).compile()
        stats = program.memory_analysis()
        peak = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
        assert row.peak_bytes == peak - stats.alias_size_in_bytes, row
        report = census(program, mesh=row.step_options["mesh"])
        assert row.total_bytes == report.bytes_per_step() > 0


def test_a_concrete_model_is_planned_on_a_tpu_mesh_by_its_shapes() -> None:
    model = MLP(128, 512, 128)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    batch = {k: np.zeros(v.shape, v.dtype) for k, v in BATCH.items()}
    mesh = topology_mesh("v5e:2x4", {"data": 8})
    got = substrax.plan(mse, model, optimizer, batch, mesh=mesh, layouts=["fsdp"])
    want = substrax.plan(mse, *_abstract(), BATCH, mesh=mesh, layouts=["fsdp"])
    assert got.rows[0].peak_bytes == want.rows[0].peak_bytes and got.rows[0].bytes == want.rows[0].bytes
    assert isinstance(model.hidden.kernel.get_value(), jax.Array)  # the model itself left as it was


def test_a_step_the_tpu_compiler_refuses_is_a_row_that_does_not_fit() -> None:
    """One v5e chip (16,909,336,064 B): 16,384 rows through a 262,144-wide hidden layer, 16 GiB a
    buffer, past its memory. Before: plan raised the compiler's RESOURCE_EXHAUSTED."""
    mesh = topology_mesh("v5e:1x1", {"data": 1})
    model, optimizer = nnx.eval_shape(
        lambda: (m := MLP(128, 1 << 18, 128), nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param))
    )
    wide = {k: jax.ShapeDtypeStruct((16384, 128), jnp.float32) for k in ("x", "y")}
    found = substrax.plan(mse, model, optimizer, wide, mesh=mesh, layouts=["replicated"])
    (row,) = found.rows
    assert row.device_bytes == 16_909_336_064  # a compile-only v5e reports none: the chip's own
    assert row.fits is False and "Ran out of memory on HBM" in row.refused
    assert row.peak_bytes > row.device_bytes and "does not fit: the TPU compiler refused it" in str(found)
    with pytest.raises(ValueError, match="No configuration fits 16,909,336,064 bytes per device"):
        found.best()
    small = substrax.plan(mse, *_abstract(), BATCH, mesh=mesh, layouts=["replicated"])
    assert small.rows[0].fits is True and small.best() is small.rows[0]


def test_a_refused_row_gives_the_rules_bytes() -> None:
    """8 chips, each holding a replicated MLP of 2.16B float32 parameters, its gradients and SGD:
    refused (over 16 GiB). Its bytes are the rule's, every gradient all-reduced whole, as the
    estimate's. Before: ``total_bytes`` 0 (no census without a program)."""
    mesh = topology_mesh("v5e:2x4", {"data": 8})
    model, optimizer = nnx.eval_shape(
        lambda: (m := MLP(128, 1 << 23, 128), nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param))
    )
    batch = {k: jax.ShapeDtypeStruct((64, 128), jnp.float32) for k in ("x", "y")}
    (row,) = substrax.plan(mse, model, optimizer, batch, mesh=mesh, layouts=["replicated"]).rows
    (rule,) = substrax.plan(
        mse, model, optimizer, batch, mesh=mesh, layouts=["replicated"], compiled=False
    ).rows
    parameters = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert row.refused and row.fits is False
    assert row.bytes == rule.bytes and row.total_bytes == parameters + 4  # the gradients and the loss
    assert any("its bytes are the layout's rule's" in n for n in row.notes)
