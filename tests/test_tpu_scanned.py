"""Scanned stacks and pipelines compiled for a TPU v5e topology (libtpu, no TPU; make test-tpu).

The TPU compiler states no trip count on its ``while`` loops: each collective inside the stack's
scan or a schedule's loop read "loop x?" and counted once, so the census did not match and the
plan's bytes were a fraction of the step's (issue 61, item 1: at 1.10B on a v5e 2x4 the units
row said 1.76 GB per step, the H100 row of the same layout 16.6 GB). The census reads the count
from the loop itself (``substrax.census._hlo.trip_count``). Each test plans the configuration,
then checks the row's own step: one compile (``substrax._shared.compiled``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import llama
import optax
import pytest
from conftest import needs_libtpu
from flax import nnx
from models import Residual, Tower, mse
from test_pipeline_census import loops

import substrax
from substrax.mesh import topology_mesh

pytestmark = needs_libtpu

DEPTH = 4


def _planned(loss_fn, build, batch, mesh, **kwargs):  # noqa: ANN001, ANN202
    """The plan's one row compiled for ``mesh``, the rule's estimate of it, and its step's check."""
    model, optimizer = nnx.eval_shape(build)
    found = substrax.plan(loss_fn, model, optimizer, batch, mesh=mesh, layouts=["fsdp"], **kwargs)
    estimate = substrax.plan(
        loss_fn, model, optimizer, batch, mesh=mesh, layouts=["fsdp"], compiled=False, **kwargs
    )
    checked = []
    for row in found.rows:
        model, optimizer = nnx.eval_shape(build)
        row.shard_state(model, optimizer)
        checked.append(row.make_train_step(loss_fn).check_communication(model, optimizer, batch))
    return found.rows, estimate.rows, checked


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "remat-scan"])
@pytest.mark.parametrize(("topology", "d"), [("v5e:2x4", 64), ("v5e:16x16", 256)])
def test_a_scanned_stack_with_units_matches_and_the_plan_is_its_census(
    topology: str, d: int, remat: bool
) -> None:
    """``nnx.scan`` (under ``nnx.remat`` or not) over 4 stacked blocks, FSDP with each block a
    unit: every loop runs 4 times, the census matches, the plan's bytes are the census's and the
    rule's. Before: "loop x?" on each unit's gathers and reduce-scatter, counted once."""
    n = 256 if "16x16" in topology else 8
    mesh = topology_mesh(topology, {"data": n})

    def build() -> tuple[llama.Llama, nnx.Optimizer]:
        model = llama.Llama(d=d, depth=DEPTH, hidden=2 * d, remat=remat)
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    batch = {k: jax.ShapeDtypeStruct((2 * n, 16), jnp.int32) for k in ("tokens", "targets")}
    (row,), (rule,), (found,) = _planned(llama.loss_fn, build, batch, mesh, units=(llama.Block,))
    assert found.matches, str(found)
    looped = found.report.in_loop()
    assert looped and {r.trip_counts for r in looped} == {(DEPTH,)}  # the scan's length, read
    assert {r.kind for r in looped} == {"all-gather", "reduce-scatter"}
    assert row.total_bytes == found.report.bytes_per_step() and row.bytes == rule.bytes


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_schedule_matches_and_the_plan_is_its_census(schedule: str) -> None:
    """8 residual layers in 4 stages on (data 2, stage 4), each layer an FSDP unit, 4 microbatches:
    each schedule's loops run their ticks (a unit's loop inside them its layers), the census
    matches, the plan's bytes are the census's. Before: every permute and every unit's gather
    inside them counted once."""
    mesh = topology_mesh("v5e:2x4", {"data": 2, "stage": 4})

    def build() -> tuple[Tower, nnx.Optimizer]:
        model = Tower(Residual, 8, 8, gate=True)
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    batch = {"x": jax.ShapeDtypeStruct((32, 4), jnp.float32), "y": jax.ShapeDtypeStruct((32,), jnp.float32)}
    (row,), _, (found,) = _planned(
        mse, build, batch, mesh, units=(Residual,), placement={"stages": Residual, "min_size": 1},
        microbatches=4, schedule=schedule,
    )  # fmt: skip
    assert found.matches, str(found)
    assert not found.report.uncounted()
    ticks = {n for n, _ in loops(substrax.PipelineSchedule(schedule, 4, 4))}
    permutes = [r for r in found.report.rows if r.kind == "collective-permute"]
    assert permutes and {r.trip_count for r in permutes} <= ticks, [r.trip_counts for r in permutes]
    assert row.total_bytes == found.report.bytes_per_step()
