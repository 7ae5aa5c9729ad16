"""Steps compiled for NVIDIA H100 topologies from this CPU, and their census (CUDA plugin; make test-gpu).

The GPU compiler concatenates the all-reduces it combines into one flat buffer; the census
reads that buffer's pieces (tests/test_gpu_mesh.py: the meshes themselves).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
import test_pipeline_census as pipeline_census
import test_units as units
from conftest import MLP, mse, needs_cuda_plugin
from flax import nnx
from models import Residual, abstract_batch, abstract_mlp

import substrax
from substrax.census import census
from substrax.census._step import program_platform
from substrax.mesh import topology_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import transformer_lm as lm  # noqa: E402

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


def _temp_bytes(depth: int, combine: int | None = None) -> int:
    """test_units's stack of 256-wide layers, each an FSDP unit, compiled for H100 1x1x8: its temporary
    bytes; ``combine``: the reduce-scatter combiner's threshold instead of the step's (none)."""
    mesh = topology_mesh("h100:1x1x8", {"data": 8})
    model, optimizer = nnx.eval_shape(
        lambda: (m := units.Stack(depth, 256), nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param))
    )
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=1, units=units._in_layers)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    batch = {"x": jax.ShapeDtypeStruct((64, 256), jnp.float32), "y": jax.ShapeDtypeStruct((64,), jnp.float32)}
    lowered = step.lower(model, optimizer, batch)
    options = None if combine is None else {"xla_gpu_reduce_scatter_combine_threshold_bytes": combine}
    compiled = lowered.compile(options)
    assert census(compiled).count("reduce-scatter") == (depth + 1 if combine is None else 1)
    return compiled.memory_analysis().temp_size_in_bytes


def test_units_keep_temporary_memory_flat_in_depth_on_the_gpu() -> None:
    """Measured before: the GPU compiler combined every unit's reduce-scatter into one after the
    backward pass, temporary memory growing 1.03 layers per layer; now 0.13 (tests/test_units.py's
    rule, on the CPU: under half a layer per layer)."""
    layer = 256 * 256 * 4
    assert (_temp_bytes(8) - _temp_bytes(2)) / 6 < 0.5 * layer
    assert (_temp_bytes(8, 1 << 30) - _temp_bytes(2, 1 << 30)) / 6 > 0.9 * layer  # combined: it grows


def test_each_unit_reduce_scatters_its_gradient_on_the_gpu() -> None:
    """The example transformer's 4 blocks and the root as units on H100 1x1x8: one reduce-scatter per
    unit, each as the step writes it (measured before: one of 860,160 B, the five combined)."""
    mesh = topology_mesh("h100:1x1x8", {"data": 8})
    model, optimizer = nnx.eval_shape(lambda: lm.make_model(d=64, blocks=4, seq=32))
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", units=lm.Block)
    batch = {k: jax.ShapeDtypeStruct((16, 32), jnp.int32) for k in ("tokens", "targets")}
    found = substrax.make_train_step(lm.loss_fn, "explicit", mesh=mesh).check_communication(
        model, optimizer, batch
    )
    assert found.matches, found
    scatters = [r for r in found.report.rows if r.kind == "reduce-scatter"]
    assert len(scatters) == 5 and len({r.bytes for r in scatters}) == 2  # four blocks alike, the root
    assert sum(r.bytes for r in scatters) == 860_160


_UNITS = [c for c in pipeline_census.EXPLICIT + pipeline_census.INTERLEAVED if c.layout == "units"]


@pytest.mark.parametrize("case", _UNITS, ids=str)
def test_a_pipelines_census_matches_on_the_gpu(case: pipeline_census.Case) -> None:
    """test_pipeline_census's cases with units (data 2 x stage 4: GPipe, 1F1B, ZB-H1, interleaved 1F1B)
    compiled for H100 1x1x8."""
    mesh = topology_mesh("h100:1x1x8", dict(case.mesh))
    model, optimizer = nnx.eval_shape(
        lambda: (
            m := pipeline_census.Net(pipeline_census.DEPTH * case.chunks),
            nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param),
        )
    )
    substrax.shard_state(
        model, optimizer, mesh=mesh, layout="fsdp", units=Residual, stages=Residual, min_size=1,
        virtual_stages=case.chunks,
    )  # fmt: skip
    step = substrax.make_train_step(
        mse, "explicit", mesh=mesh, microbatches=case.microbatches, schedule=case.schedule
    )
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in pipeline_census.batch().items()}
    found = step.check_communication(model, optimizer, batch)
    assert found.matches, found
    permutes = [r for r in found.report.rows if r.kind == "collective-permute"]
    shifts = {None} if case.chunks > 1 else {1, -1}  # interleaved: around the ring, and the chunks' moves
    assert permutes and {r.axes for r in permutes} == {("stage",)} and {r.shift for r in permutes} == shifts
