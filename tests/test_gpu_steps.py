"""Steps compiled for NVIDIA H100 topologies from this CPU, and their census (CUDA plugin; make test-gpu).

The GPU compiler concatenates the all-reduces it combines into one flat buffer; the census
reads that buffer's pieces (tests/test_gpu_mesh.py: the meshes themselves).
"""

from __future__ import annotations

import jax
import pytest
from conftest import MLP, mse, needs_cuda_plugin
from flax import nnx
from models import abstract_batch, abstract_mlp

import substrax
from substrax.census._step import program_platform
from substrax.mesh import topology_mesh

pytestmark = needs_cuda_plugin

LAYOUTS = ["replicated", "zero1", "fsdp", "fsdp+units", "hsdp"]


def _abstract(din: int = 64, width: int = 256, dout: int = 64) -> tuple[MLP, nnx.Optimizer]:
    return abstract_mlp(din, width, dout)


def _batch(rows: int = 64, din: int = 64, dout: int = 64) -> dict[str, jax.ShapeDtypeStruct]:
    return abstract_batch(rows, din, dout)


def _mesh(topology: str, layout: str) -> jax.sharding.Mesh:
    per_host, hosts = 8, int(topology.split("x")[1])
    if layout == "hsdp":
        return topology_mesh(
            f"h100:{topology}", {"replica": max(hosts, 2), "data": per_host * hosts // max(hosts, 2)}
        )
    return topology_mesh(f"h100:{topology}", {"data": per_host * hosts})


def _placed(mesh: jax.sharding.Mesh, layout: str) -> tuple[MLP, nnx.Optimizer, substrax.Layout]:
    model, optimizer = _abstract()
    kind, _, units = layout.partition("+")
    placed = substrax.shard_state(
        model, optimizer, mesh=mesh, layout=kind, min_size=1, units=nnx.Linear if units else None
    )
    return model, optimizer, placed


@pytest.mark.parametrize("topology", ["1x1x8", "1x2x8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_explicit_steps_written_collectives_hold_on_the_gpu(layout: str, topology: str) -> None:
    mesh = _mesh(topology, layout)
    model, optimizer, _ = _placed(mesh, layout)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    found = step.check_communication(model, optimizer, _batch())
    assert found.matches, found
    counts = {k: sum(1 for r in found.report.rows if r.kind == k) for k in ("all-gather", "reduce-scatter")}
    if layout.startswith("fsdp"):
        assert counts["reduce-scatter"] >= 1 and counts["all-gather"] >= 1


@pytest.mark.parametrize("topology", ["1x1x8", "1x2x8"])
@pytest.mark.parametrize("layout", ["replicated", "zero1", "fsdp", "hsdp"])
def test_implicit_steps_compile_for_the_gpu_keeping_the_state_where_placed(
    layout: str, topology: str
) -> None:
    mesh = _mesh(topology, layout)
    model, optimizer, placed = _placed(mesh, layout)
    step = substrax.make_train_step(mse, "implicit", mesh=mesh)
    compiled = step.lower(model, optimizer, _batch(), donate=True).compile()
    assert program_platform(compiled) == "gpu"
    leaves = jax.tree.leaves(nnx.state((model, optimizer)))
    assert [s.spec for s in compiled.output_shardings[0]] == [x.sharding.spec for x in leaves]
    assert compiled.memory_analysis().alias_size_in_bytes >= placed.bytes_per_device
