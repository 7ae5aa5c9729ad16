"""Issue 61, items 2 and 3, on the TPU compiler (libtpu, no TPU; make test-tpu): HSDP across two
slices and ZeRO-1 with small parameters, each census matching, the plan's bytes its census's (item 4,
a 1.03B model's units: tests/test_tpu_scanned.py). See the census guide, "On a TPU" and "Across slices".
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import llama
import optax
import pytest
from conftest import needs_libtpu
from flax import nnx

import substrax
from substrax.census import Comparison, compare
from substrax.mesh import topology_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import transformer_lm as lm  # noqa: E402

pytestmark = needs_libtpu

SEQ = 32


def _planned(mesh: jax.sharding.Mesh, d: int, layout: str, **placement: object) -> tuple:
    """The plan's row of ``layout`` (compiled for ``mesh``) and its own step's check."""
    build = lambda: lm.make_model(d=d, blocks=2, seq=SEQ)  # noqa: E731
    batch = {k: jax.ShapeDtypeStruct((2 * mesh.size, SEQ), jnp.int32) for k in ("tokens", "targets")}
    (row,) = substrax.plan(
        lm.loss_fn,
        *nnx.eval_shape(build),
        batch,
        mesh=mesh,
        layouts=[layout],
        units=(None,),
        placement=placement,
    ).rows
    model, optimizer = nnx.eval_shape(build)
    row.shard_state(model, optimizer)
    return row, row.make_train_step(lm.loss_fn).check_communication(model, optimizer, batch)


def _without(found: Comparison, what: str) -> Comparison:
    """``found``'s census against its expectation less the buffer ``what``."""
    items = tuple(i for i in found.expected.items if i.what != what)
    return compare(found.report, dataclasses.replace(found.expected, items=items), attribute_model=True)


def _doubled(found: Comparison, what: str) -> Comparison:
    """``found``'s census against its expectation with the buffer ``what`` twice."""
    (item,) = [i for i in found.expected.items if i.what == what]
    items = (*found.expected.items, dataclasses.replace(item, what=f"{what}, again"))
    return compare(found.report, dataclasses.replace(found.expected, items=items), attribute_model=True)


@pytest.mark.parametrize(("d", "sent"), [(64, 86_016), (256, 856_064)])
def test_hsdp_across_two_slices_matches_and_the_plan_is_its_census(d: int, sent: int) -> None:
    """Two v5e 2x4 slices, ``replica`` across them. Measured before: the slices' sum across
    ``replica`` compiled to send/recv pairs of 143,360 B (d=64: each slice in the compiler's own
    padded layout) that the census left unexpected, the whole gradients' all-reduce missing, the
    loss matched to an update's flag. Now each slice crosses as its block of whole tiles, and the
    census packs the expected all-reduces into the pairs that carry them, byte for byte."""
    mesh = topology_mesh("v5e:2x4", {"replica": 2, "data": 8}, slices=2)
    row, found = _planned(mesh, d, "hsdp")
    assert found.matches, str(found)
    assert row.total_bytes == found.report.bytes_per_step()
    sends = [r for r in found.report.rows if r.kind == "send"]
    assert sends and {(r.crosses, r.axes) for r in sends} == {("all-reduce", ("replica",))}
    across = [(i, ps) for i, ps in found.matched if i.what.startswith("across 'replica'")]
    carried = {p.row.name: p.bytes for _, ps in across for p in ps if p.kind == "send"}
    assert sum(carried.values()) == sum(i.bytes for i, _ in across)  # the slices' blocks, exactly
    assert sum(r.bytes for r in sends) == sent  # d=64: 143,360 B before (d=256: 861,184 B)
    # a slice's sum dropped from the program, or written twice, is a difference
    assert not _without(found, across[0][0].what).matches
    assert not _doubled(found, across[0][0].what).matches


def test_zero1_with_small_parameters_matches_on_v5e_2x4_and_the_plan_is_its_census() -> None:
    """ZeRO-1 with min_size=1: each updated parameter gathered. Measured before: the update compiled
    alone (for its expected buffers) without the step's compiler options, its small parameters'
    gathers as all-reduces of f32[64] and f32[256] (7,680 B), which the step compiles as all-gathers
    of f32[8,1,8] (and f32[8,1,32]): a mismatch for a correct program."""
    mesh = topology_mesh("v5e:2x4", {"data": 8})
    row, found = _planned(mesh, 64, "zero1", min_size=1)
    assert found.matches, str(found)
    assert row.total_bytes == found.report.bytes_per_step()
    gathers = [i for i, ps in found.matched if i.category == "update" and i.kind == "all-gather"]
    assert len(gathers) == found.report.count("all-gather") == 38  # every parameter's, none reduced
    assert not _without(found, gathers[-1].what).matches


def test_a_scanned_llamas_hsdp_across_two_slices_matches_without_a_refusal() -> None:
    """``tests/llama.py`` (2 blocks by ``nnx.vmap``, d=256: every matrix split, its norms' stacked
    ``[2, 256]`` scales whole) over two v5e 2x4 slices. Measured before: the compiler split the norms'
    sum over ``replica`` and ``data`` into a reduce-scatter of its own it then refused ("2nd-minor
    compaction"), the step compiled again with the decomposer (warning), and the census did not
    match (the norms' all-reduce unexpected, their sends too). Now the step sums each whole gradient
    flat across slices: one padded all-reduce, one pair, matched byte for byte with the loss."""
    mesh = topology_mesh("v5e:2x4", {"replica": 2, "data": 8}, slices=2)

    def build() -> tuple:
        model = llama.Llama(vocab=1024, d=256, depth=2, heads=4, kv_heads=2, hidden=512)
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(build)
    batch = {k: jax.ShapeDtypeStruct((32, 64), jnp.int32) for k in ("tokens", "targets")}
    substrax.shard_state(model, optimizer, mesh=mesh, layout="hsdp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the refusal's warning would fail this
        # not jax's own about a topology's program in the persistent cache (make test with libtpu)
        warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
        found = substrax.make_train_step(llama.loss_fn, "explicit", mesh=mesh).check_communication(
            model, optimizer, batch
        )
    assert found.matches, str(found)
    norms = [i for i, _ in found.matched if "norm" in i.what]
    assert len(norms) == 3 and all(i.axes == ("replica", "data") for i in norms)
