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


def _split(model: nnx.Module, axis: str = "data") -> list[tuple]:
    """The paths of the parameters split over ``axis`` (a gather and a reduce-scatter each, without units)."""
    split = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        spec = variable.get_value().sharding.spec
        if any(axis == e or (isinstance(e, tuple) and axis in e) for e in spec):
            split.append(tuple(path))
    return split


def _matches_as_written(result: Comparison, gathers: int, scatters: int) -> None:
    assert result.matches, str(result)
    assert result.report.count("all-gather") == gathers and result.report.count("reduce-scatter") == scatters
    assert _dtypes(result, "all-gather") == _dtypes(result, "reduce-scatter") == {"f32"}  # as written


@pytest.mark.parametrize("d", [64, 256])
def test_fsdp_units_census_matches_on_v5e_2x4(d: int) -> None:
    """Measured on an older main: 7 gathers, 6 of them bf16; every unit's reduce-scatter in one all-reduce."""
    result = _census(topology_mesh("v5e:2x4", {"data": 8}), d, units=lm.Block)
    # the root unit once; each block's unit once forward, once backward; one reduce-scatter each
    _matches_as_written(result, 1 + 2 + 2, 3)


@pytest.mark.parametrize("d", [64, 256])
def test_fsdp_census_matches_on_v5e_2x4(d: int) -> None:
    """Measured on main: d=64, the position table's gradient (split on its features, a (32, 8)
    block) reduced whole, in an all-reduce; each split gradient's block now goes as tiles."""
    mesh = topology_mesh("v5e:2x4", {"data": 8})
    split = len(_split(_placed(mesh, d)[0]))
    _matches_as_written(_census(mesh, d), split, split)


@pytest.mark.parametrize("d", [64, 256])
def test_hsdp_census_matches_on_v5e_2x4(d: int) -> None:
    """Measured on main: d=64, the up kernels' and the position table's reduce-scatters (blocks
    across a tile's lanes) run as one all-reduce of the whole gradients."""
    mesh = topology_mesh("v5e:2x4", {"replica": 2, "data": 4})
    split = len(_split(_placed(mesh, d, "hsdp")[0]))
    _matches_as_written(_census(mesh, d, layout="hsdp"), split, split)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("units", [False, True])
def test_fsdp_census_matches_on_v5e_16x16(units: bool, d: int) -> None:
    """Measured on main: at 256 chips over one axis every gather and reduce-scatter ran as an
    all-reduce (the TPU compiler's all-gather and reduce-scatter decomposers, now off)."""
    mesh = topology_mesh("v5e:16x16", {"data": 256})
    result = _census(mesh, d, **({"units": lm.Block} if units else {}))
    split = _split(_placed(mesh, d)[0])  # d=64: the 4 MLP kernels; d=256: their biases, tok, head too
    if units:  # each block's unit gathered forward and backward; outside them, the root unit
        root = int(any(path[0] != "blocks" for path in split))
        _matches_as_written(result, 2 + 2 + root, 2 + root)
    else:
        _matches_as_written(result, len(split), len(split))


def test_explicit_train_step_in_your_own_jit_takes_the_steps_compiler_options() -> None:
    """Inside your own jax.jit the step writes its reduce-scatters for the mesh's platform, but the
    compiler options are that jit's: over 256 chips, without them every gather and reduce-scatter
    runs as an all-reduce; with ``substrax.explicit.compiler_options(mesh)`` each is as written."""
    mesh = topology_mesh("v5e:16x16", {"data": 256})
    model, optimizer, batch = _placed(mesh, 64)
    graphdef, state = nnx.split((model, optimizer))

    def step(state: nnx.State, batch: dict) -> tuple:
        model, optimizer = nnx.merge(graphdef, state)
        loss = substrax.explicit.explicit_train_step(model, optimizer, lm.loss_fn, batch)
        return nnx.state((model, optimizer)), loss

    found = []
    for options in (None, substrax.explicit.compiler_options(mesh)):
        with jax.set_mesh(mesh):
            report = substrax.census(jax.jit(step, compiler_options=options).lower(state, batch), mesh=mesh)
        found.append((report.count("all-gather"), report.count("reduce-scatter")))
    assert found == [(0, 0), (len(_split(model)),) * 2]


def test_explicit_train_step_in_nnx_jit_compiled_with_the_steps_options_is_the_steps_program() -> None:
    """``nnx.jit`` takes no compiler options when called; its lowering takes them when compiled:
    over 256 chips the same gathers and tiled reduce-scatters as ``make_train_step``'s step (whose
    census the other test holds: without the options, none). ``substrax.census`` takes ``nnx.jit``'s
    stages (before: a TypeError)."""
    mesh = topology_mesh("v5e:16x16", {"data": 256})
    model, optimizer, batch = _placed(mesh, 64)

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
        return substrax.explicit.explicit_train_step(model, optimizer, lm.loss_fn, batch)

    with jax.set_mesh(mesh):
        lowered = step.lower(model, optimizer, batch)
    report = substrax.census(lowered.compile(substrax.explicit.compiler_options(mesh)), mesh=mesh)
    split = len(_split(model))
    assert report.count("all-gather") == report.count("reduce-scatter") == split
    ours = substrax.make_train_step(lm.loss_fn, "explicit", mesh=mesh).lower(model, optimizer, batch)
    written = substrax.census(ours, mesh=mesh)
    shapes = lambda r: sorted(str(b) for row in r.rows if row.kind == "reduce-scatter" for b in row.operands)  # noqa: E731
    assert shapes(report) == shapes(written)  # the step's tiles: (2048, 128) a kernel's gradient


def test_a_reduce_scatter_the_tpu_cannot_emit_compiles_with_its_decomposer() -> None:
    """A loss function's own psum_scatter of a (4, 32, 128) activation over 8 chips (blocks of 4
    rows): the TPU compiler refuses it with its decomposer off (UNIMPLEMENTED); the step compiles
    again with it on, warning, and runs it as an all-reduce the census names; the step's own
    gathers and reduce-scatters stay as written."""
    mesh = topology_mesh("v5e:2x4", {"data": 8})
    model, optimizer, batch = _placed(mesh, 64)

    def loss_fn(model: nnx.Module, batch: dict) -> jax.Array:
        loss = lm.loss_fn(model, batch)
        activation = jnp.broadcast_to(loss, (4, SEQ, 128))
        spread = jax.lax.psum_scatter(activation, "data", scatter_dimension=1, tiled=True)
        return loss + 0.0 * spread.sum()

    step = substrax.make_train_step(loss_fn, "explicit", mesh=mesh)
    with pytest.warns(UserWarning, match="cannot emit a reduce-scatter of this step as written"):
        result = step.check_communication(model, optimizer, batch)
    split = len(_split(model))
    assert result.report.count("all-gather") == result.report.count("reduce-scatter") == split
    (difference,) = result.differences
    assert "nothing expected accounts for f32[4,32,128] (65,536 B) of all-reduce" in difference
    with pytest.warns(UserWarning, match="cannot emit"):  # the traced step's lowering too (substrax.plan's)
        assert step.traced(model, optimizer, batch).lower().compile().as_text()


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


@pytest.mark.parametrize("d", [64, 256])
def test_implicit_census_on_v5e_16x16_gathers_and_reduces_each_gradient_whole(d: int) -> None:
    """XLA's choice, read truthfully: each split parameter gathered once (without the all-gather
    decomposer off, as all-reduces of the zero-padded whole: 0 gathers, 736,772 B of all-reduces
    at d=64 against 474,628 B), every gradient all-reduced whole, in one all-reduce."""
    mesh = topology_mesh("v5e:16x16", {"data": 256})
    model, optimizer, batch = _placed(mesh, d)
    step = substrax.make_train_step(lm.loss_fn, "implicit", mesh=mesh)
    result = step.check_communication(model, optimizer, batch)
    assert result.matches, str(result)
    assert result.report.count("all-gather") == len(_split(model))
    assert result.report.count("reduce-scatter") == 0
    assert result.report.count("all-reduce") == 1
