"""Steps compiled for a TPU v5e topology from this CPU (libtpu, no TPU; make test-tpu).

The state is abstract (``nnx.eval_shape``), placed by ``shard_state`` on a ``topology_mesh``;
the compiled program must take and give back the state where it was placed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import MLP, mse, needs_libtpu
from flax import nnx
from models import abstract_batch, abstract_mlp

import substrax
from substrax.census._step import program_platform
from substrax.mesh import topology_mesh

pytestmark = needs_libtpu


def _abstract(din: int = 128, width: int = 512, dout: int = 128) -> tuple[MLP, nnx.Optimizer]:
    return abstract_mlp(din, width, dout)


def _batch(rows: int = 64, din: int = 128, dout: int = 128) -> dict[str, jax.ShapeDtypeStruct]:
    return abstract_batch(rows, din, dout)


@pytest.mark.parametrize("mode", ["explicit", "implicit"])
@pytest.mark.parametrize("layout", ["replicated", "zero1", "fsdp", "hsdp"])
def test_each_layout_compiles_for_v5e_2x4_keeping_the_state_where_placed(layout: str, mode: str) -> None:
    mesh = topology_mesh("v5e:2x4", {"replica": 2, "data": 4} if layout == "hsdp" else {"data": 8})
    model, optimizer = _abstract()
    placed = substrax.shard_state(model, optimizer, mesh=mesh, layout=layout)
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    compiled = step.lower(model, optimizer, _batch(), donate=True).compile()
    assert program_platform(compiled) == "tpu"
    leaves = jax.tree.leaves(nnx.state((model, optimizer)))
    assert [s.spec for s in compiled.input_shardings[0][0]] == [x.sharding.spec for x in leaves]
    assert [s.spec for s in compiled.output_shardings[0]] == [x.sharding.spec for x in leaves]
    memory = compiled.memory_analysis()
    # donated: every state byte is written back in place (the TPU pads small arrays to tiles: at least)
    assert memory.alias_size_in_bytes >= placed.bytes_per_device
    assert memory.argument_size_in_bytes - memory.alias_size_in_bytes >= 2 * 64 * 128 * 4 // 8  # the batch
    assert placed.kind == layout


def test_the_layouts_hold_what_they_split_on_the_tpu() -> None:
    """Donated state bytes per device, as the TPU compiler counts them: FSDP < HSDP < ZeRO-1 < replicated."""
    aliased = {}
    for layout in ("replicated", "zero1", "fsdp", "hsdp"):
        mesh = topology_mesh("v5e:2x4", {"replica": 2, "data": 4} if layout == "hsdp" else {"data": 8})
        model, optimizer = _abstract()
        substrax.shard_state(model, optimizer, mesh=mesh, layout=layout)
        step = substrax.make_train_step(mse, "explicit", mesh=mesh)
        compiled = step.lower(model, optimizer, _batch(), donate=True).compile()
        aliased[layout] = compiled.memory_analysis().alias_size_in_bytes
    assert aliased["fsdp"] < aliased["hsdp"] < aliased["zero1"] < aliased["replicated"]


def test_one_chip_and_two_slices_compile() -> None:
    for mesh in (
        topology_mesh("v5e:1x1", {"data": 1}),
        topology_mesh("v5e:2x4", {"replica": 2, "data": 8}, slices=2),
    ):
        model, optimizer = _abstract(32, 256, 8)
        layout = "hsdp" if "replica" in mesh.axis_names else "fsdp"
        substrax.shard_state(model, optimizer, mesh=mesh, layout=layout)
        step = substrax.make_train_step(mse, "explicit", mesh=mesh)
        compiled = step.lower(model, optimizer, _batch(64, 32, 8), donate=True).compile()
        assert program_platform(compiled) == "tpu"
        assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_a_v5e_16x16_pod_compiles() -> None:
    mesh = topology_mesh("v5e:16x16", {"data": 256})
    model, optimizer = _abstract(32, 256, 8)
    substrax.shard_state(model, optimizer, mesh=mesh)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    compiled = step.lower(model, optimizer, _batch(256, 32, 8), donate=True).compile()
    assert program_platform(compiled) == "tpu" and compiled.input_shardings[0][0][1].num_devices == 256


def test_the_census_of_a_tpu_program_expects_the_policys_dtype_not_the_cpus_widening() -> None:
    """The mixed-precision note about XLA's CPU compiler follows the program's platform, not the host's."""
    policy = substrax.MixedPrecision(jnp.bfloat16)
    expected = {}
    for name, mesh in (
        ("tpu", topology_mesh("v5e:2x4", {"data": 8})),
        ("cpu", substrax.mesh.create_device_mesh({"data": 8})),
    ):
        model, optimizer = _abstract(32, 256, 8)
        substrax.shard_state(model, optimizer, mesh=mesh, min_size=16)
        step = substrax.make_train_step(mse, "explicit", mesh=mesh, precision=policy)
        found = step.check_communication(model, optimizer, _batch(64, 32, 8))
        widened = [n for n in found.notes if "widens such collectives" in n]
        assert bool(widened) == (name == "cpu"), found.notes
        expected[name] = sum(
            i.bytes for i in found.expected.items if i.kind == "all-gather" and i.category == "parameters"
        )
    assert expected["tpu"] * 2 == expected["cpu"] > 0  # bfloat16 gathers on the TPU, float32 on the CPU
