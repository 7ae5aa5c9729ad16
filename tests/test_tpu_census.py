"""The explicit step's census on the TPU compiler (libtpu, no TPU; make test-tpu).

What the step writes is what runs: one gather per parameter (or unit, per pass) in the dtype
written, one reduce-scatter per split gradient (or unit); what the compiler still rewrites
the census names, with its cost. See the census guide, "On a TPU".
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import needs_libtpu
from flax import nnx

import substrax
from substrax.census import Comparison
from substrax.mesh import topology_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import transformer_lm as lm  # noqa: E402

pytestmark = needs_libtpu

SEQ = 32


def _placed(mesh: jax.sharding.Mesh, d: int, layout: str = "fsdp", **kwargs: object) -> tuple:
    model, optimizer = nnx.eval_shape(lambda: lm.make_model(d=d, blocks=2, seq=SEQ))
    substrax.shard_state(model, optimizer, mesh=mesh, layout=layout, **kwargs)
    rows = 2 * mesh.size
    batch = {k: jax.ShapeDtypeStruct((rows, SEQ), jnp.int32) for k in ("tokens", "targets")}
    return model, optimizer, batch


def _census(mesh: jax.sharding.Mesh, d: int, layout: str = "fsdp", **kwargs: object) -> Comparison:
    model, optimizer, batch = _placed(mesh, d, layout, **kwargs)
    step = substrax.make_train_step(lm.loss_fn, "explicit", mesh=mesh)
    return step.check_communication(model, optimizer, batch)


def _dtypes(result: Comparison, kind: str) -> set[str]:
    return {str(o).split("[")[0] for row in result.report.rows if row.kind == kind for o in row.operands}


def test_fsdp_units_census_matches_on_v5e_2x4() -> None:
    """Measured on main: 7 gathers, 6 of them bf16; every unit's reduce-scatter in one all-reduce."""
    result = _census(topology_mesh("v5e:2x4", {"data": 8}), 64, units=lm.Block)
    assert result.matches, str(result)
    # the root unit once; each block's unit once forward, once backward; one reduce-scatter
    # each; all float32, as written
    assert result.report.count("all-gather") == 1 + 2 + 2
    assert result.report.count("reduce-scatter") == 3
    assert _dtypes(result, "all-gather") == _dtypes(result, "reduce-scatter") == {"f32"}


def test_fsdp_census_gathers_each_parameter_once_on_v5e_2x4() -> None:
    """Measured on main: 43 gathers of 15 split parameters (41 bf16), 6 reduce-scatters."""
    result = _census(topology_mesh("v5e:2x4", {"data": 8}), 64)
    assert result.report.count("all-gather") == 15 and _dtypes(result, "all-gather") == {"f32"}
    assert result.report.count("reduce-scatter") == 14
    # the position table's gradient (split on its features, a (32, 8) block) the TPU compiler
    # still reduces whole: the census names that rewrite and its cost, and nothing else
    (difference,) = result.differences
    assert difference.startswith("reduce-scatter compiled as an all-reduce: model['pos']['embedding']")
    assert "7,168 B more memory per device" in difference


def test_hsdp_census_names_what_the_tpu_compiler_reduces_whole() -> None:
    result = _census(topology_mesh("v5e:2x4", {"replica": 2, "data": 4}), 64, layout="hsdp")
    assert result.report.count("all-gather") == 15 and _dtypes(result, "all-gather") == {"f32"}
    assert result.differences and all(
        d.startswith("reduce-scatter compiled as an all-reduce: ") for d in result.differences
    ), str(result)


@pytest.mark.parametrize("units", [False, True])
def test_v5e_16x16_census_names_gathers_and_reductions_run_as_all_reduces(units: bool) -> None:
    """At 256 chips over one axis the TPU compiler runs every gather and reduce-scatter as an
    all-reduce (its all-gather and reduce-scatter decomposers): the census names each one."""
    kwargs = {"units": lm.Block} if units else {}
    result = _census(topology_mesh("v5e:16x16", {"data": 256}), 256, **kwargs)
    assert result.report.count("all-gather") == result.report.count("reduce-scatter") == 0
    assert not result.matches
    rewrites = [d for d in result.differences if " compiled as an all-reduce: " in d]
    assert rewrites and len(rewrites) == len(result.differences), str(result)
    assert any(d.startswith("all-gather compiled") for d in rewrites)
    assert any(d.startswith("reduce-scatter compiled") for d in rewrites)


def test_two_slices_census_names_the_in_slice_and_the_cross_slice_axes() -> None:
    """The TPU compiler compiles one slice's program: groups over its 8 chips are ``data`` (ICI); its
    send/recv pairs carry the cross-slice sum, over ``replica`` (DCN). Before: "1x8 groups", "?"."""
    mesh = topology_mesh("v5e:2x4", {"replica": 2, "data": 8}, slices=2)
    result = _census(mesh, 64, layout="hsdp")
    rows = result.report.rows
    sends = [r for r in rows if r.kind in ("send", "recv")]
    assert sends and all(r.axes == ("replica",) for r in sends)
    assert all(r.axes == ("data",) for r in rows if r.kind not in ("send", "recv"))


@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_implicit_census_matches_on_v5e_2x4(layout: str) -> None:
    """Measured before: each of the 15 parameters gathered for each use, 43 all-gathers (1.35 MB)."""
    shape = {"replica": 2, "data": 4} if layout == "hsdp" else {"data": 8}
    mesh = topology_mesh("v5e:2x4", shape)
    model, optimizer, batch = _placed(mesh, 64, layout)
    step = substrax.make_train_step(lm.loss_fn, "implicit", mesh=mesh)
    result = step.check_communication(model, optimizer, batch)
    assert result.matches, str(result)
    assert result.report.count("all-gather") == 15 and result.report.count("all-to-all") == 0
