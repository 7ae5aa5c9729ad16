"""A plan's compiled rows predict their step on NVIDIA H100 topologies (jax's CUDA plugin; make
test-gpu): every row's seconds hold together, grow with the batch, and a gradient all-reduced across
two hosts (over the network) costs more than within one (over NVLink)."""

from __future__ import annotations

import pytest
from conftest import assert_consistent, mse, needs_cuda_plugin
from models import abstract_batch, abstract_mlp

import substrax
from substrax.mesh import topology_mesh

pytestmark = needs_cuda_plugin


@pytest.mark.parametrize("width", [256, 1024])
def test_every_compiled_row_predicts_a_consistent_step_and_best_takes_the_fastest(width: int) -> None:
    mesh = topology_mesh("h100:1x1x8", {"data": 8})
    found = substrax.plan(mse, *abstract_mlp(64, width, 64), abstract_batch(256, 64, 64), mesh=mesh)
    assert {r.layout for r in found.rows} == {"replicated", "zero1", "fsdp"}
    for row in found.rows:
        assert_consistent(row, "h100")
    assert found.best().step_seconds == min(r.step_seconds for r in found.rows if r.fits)


def test_compute_and_flops_grow_about_fourfold_with_a_fourfold_batch() -> None:
    """test_tpu_timeline's model, from four times its batch: the GPU splits each weight gradient's
    product over the batch into 32 partial sums at either batch (``f32[32,512,128]``, 8 MiB written,
    then reduced), a cost that does not grow with it (3.47x compute at the TPU test's batches)."""
    mesh = topology_mesh("h100:1x1x8", {"data": 8})
    rows = [
        substrax.plan(mse, *abstract_mlp(128, 512, 128), abstract_batch(n, 128, 128), mesh=mesh,
                      layouts=["fsdp"]).rows[0]
        for n in (4 * 8 * 8192, 16 * 8 * 8192)
    ]  # fmt: skip
    for row in rows:
        assert_consistent(row, "h100")
    small, large = rows  # the optimizer's update and the partial sums, the same in both, keep them under 4
    assert 3.7 < large.flops / small.flops <= 4.0
    assert 3.7 < large.compute_seconds / small.compute_seconds <= 4.1


def test_a_gradient_all_reduced_across_two_hosts_costs_more_than_within_one() -> None:
    model, batch = abstract_mlp(64, 1024, 64), abstract_batch(256, 64, 64)
    rows = {}
    for hosts in (1, 2):
        mesh = topology_mesh(f"h100:1x{hosts}x8", {"data": 8 * hosts})
        (rows[hosts],) = substrax.plan(mse, *model, batch, mesh=mesh, layouts=["replicated"]).rows
        assert_consistent(rows[hosts], "h100")
    assert rows[1].total_bytes == rows[2].total_bytes  # the same gradient, all-reduced
    assert {e.lane for e in rows[1].timeline.collectives()} == {"nvlink"}
    assert {e.lane for e in rows[2].timeline.collectives()} == {"network"}
    assert rows[2].communication_seconds > 1.5 * rows[1].communication_seconds
