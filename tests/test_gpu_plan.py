"""``substrax.plan`` on NVIDIA H100 topologies from this CPU (jax's CUDA plugin; make test-gpu)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import MLP, mse, needs_cuda_plugin
from flax import nnx
from models import abstract_batch, abstract_mlp

import substrax
from substrax.mesh import topology_mesh

pytestmark = needs_cuda_plugin

BATCH = abstract_batch(64, 64, 64)


def _abstract(width: int = 256) -> tuple[MLP, nnx.Optimizer]:
    return abstract_mlp(64, width, 64)


@pytest.mark.parametrize("topology", ["1x1x8", "1x2x8"])
def test_the_plans_peak_and_bytes_are_the_gpu_compilers(topology: str) -> None:
    devices = 8 * int(topology.split("x")[1])
    mesh = topology_mesh(f"h100:{topology}", {"data": devices})
    found = substrax.plan(
        mse, *_abstract(), BATCH, mesh=mesh, mode="explicit", layouts=["replicated", "fsdp"]
    )
    for row in found.rows:
        model, optimizer = _abstract()
        row.shard_state(model, optimizer)
        step = row.make_train_step(mse)
        compiled = step.lower(model, optimizer, BATCH, donate=True).compile()
        stats = compiled.memory_analysis()
        peak = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
        peak -= stats.alias_size_in_bytes
        assert abs(row.peak_bytes / peak - 1) < 0.10, (row.layout, row.peak_bytes, peak)
        census = step.check_communication(model, optimizer, BATCH)
        assert census.matches, census
        assert row.total_bytes == sum(r.bytes_per_step for r in census.report.rows)
        assert row.device_bytes == 84_942_979_072 and row.fits


def test_best_holds_the_plan_against_the_gpus_memory() -> None:
    """The GPU compiler compiles what does not fit; the plan's rows know each H100's 84,942,979,072 B."""
    mesh = topology_mesh("h100:1x1x8", {"data": 8})
    found = substrax.plan(mse, *_abstract(), BATCH, mesh=mesh, layouts=["replicated", "fsdp"])
    fastest = found.best()  # the least predicted step, and it fits
    assert fastest.fits and fastest.step_seconds == min(r.step_seconds for r in found.rows)
    (other,) = [r.layout for r in found.rows if r is not fastest]
    big = [dataclasses.replace(r, temp_bytes=90 * 2**30) if r is fastest else r for r in found.rows]
    assert substrax.Plan(tuple(big)).best().layout == other  # the fastest no longer fits
    assert not next(r for r in big if r.layout == fastest.layout).fits
    with pytest.raises(ValueError, match=r"No configuration fits 84,942,979,072 bytes per device"):
        substrax.Plan(tuple(dataclasses.replace(r, temp_bytes=90 * 2**30) for r in found.rows)).best()
