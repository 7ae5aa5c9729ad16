"""Scanned stacks (#27.4): layers made by ``nnx.vmap``, applied by ``nnx.scan``, with and
without ``nnx.remat``, or by ``substrax.nn.scan_layers`` with the stack a unit placed with
``prefetch=True``.

Against a one-device reference (SGD: strictly) on ``data=8`` and ``(data=4, model=2)``
with ``substrax.nn`` layers inside; the census of the explicit step (a unit's gathers
and a layer's declared collectives inside the loop, as often as it runs; again under
remat); ``shard_state`` leaving the layer axis whole; temporary memory flat in depth
with the scanned block as the unit.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trains_to
from flax import nnx
from models import Residual, Tower, make_placed, mse, one_device_params, sine_batches, stack

import substrax
from substrax.mesh import create_device_mesh

MESHES = {"data8": {"data": 8}, "data4-model2": {"data": 4, "model": 2}}
VARIANTS = ("scan", "remat", "units", "units-remat", "units-prefetch")


class Scanned(Tower):
    """``depth`` residual layers stacked by ``nnx.vmap`` and applied by ``nnx.scan`` (the Flax NNX idiom)."""

    def __init__(
        self, depth: int, width: int, *, remat: bool = False, prefetch: bool = False, seed: int = 0
    ) -> None:
        super().__init__(Residual, depth, width, seed=seed)
        self.remat, self.prefetch = remat, prefetch

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.prefetch:  # the library's loop (nnx.scan where nothing is prefetched)
            return super().__call__(x)

        def body(h: jax.Array, layer: Residual) -> tuple[jax.Array, None]:
            return layer(h), None

        if self.remat:
            body = nnx.remat(body)
        h, _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(self.embed(x), self.layers)
        return self.head(h)[:, 0]


def _batches(steps: int = 2, rows: int = 32) -> list[dict]:
    return sine_batches(steps, rows)


def one_device_reference() -> dict[str, np.ndarray]:
    """``Scanned(3, 16)`` trained with SGD on ``_batches()`` on one device: the reference."""
    return one_device_params(lambda: Scanned(3, 16), optax.sgd(0.1), _batches())


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return one_device_reference()


def _placed(
    mesh: jax.sharding.Mesh, variant: str, depth: int = 3, width: int = 16
) -> tuple[Scanned, nnx.Optimizer]:
    prefetch = variant == "units-prefetch"
    units = Residual if variant.startswith("units") else None
    return make_placed(
        lambda: Scanned(depth, width, remat="remat" in variant, prefetch=prefetch), optax.sgd(0.1), mesh,
        layout="fsdp", min_size=1, units=units, prefetch=prefetch,
    )  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_scanned_stack_trains_like_one_device(mode: str, shape: str, variant: str, reference: dict) -> None:
    mesh = create_device_mesh(MESHES[shape])
    model, optimizer = _placed(mesh, variant)
    for path, variable in nnx.to_flat_state(nnx.state(model.layers, nnx.Param)):
        spec = variable.get_value().sharding.spec
        assert not spec or spec[0] is None, path  # the layer axis stays whole
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    assert_trains_to(step, model, optimizer, _batches(), reference)
    if mode == "implicit":  # what XLA chose (per-layer gathers in the loop): the layouts guide
        return
    comparison = step.check_communication(model, optimizer, _batches(1)[0])
    assert comparison.matches, str(comparison)
    # prefetched: each pass's first layer outside the loop, the other two inside it
    runs = {1, 2} if variant == "units-prefetch" else {3}
    if variant.startswith("units"):  # the unit's gathers and reduce-scatters, one layer per iteration
        units = [(i, parts) for i, parts in comparison.matched if i.what.startswith("unit ") and parts]
        assert units and all(i.in_loop == all(p.row.in_loop for p in parts) for i, parts in units)
        assert {p.row.executions for _, parts in units for p in parts} == runs
    if "model" in MESHES[shape]:  # each layer's declared collectives run once per layer
        declared = [
            (i, parts) for i, parts in comparison.matched if i.category == "model" and i.per_run and parts
        ]
        assert declared and {p.row.executions for _, parts in declared for p in parts} == runs


def test_a_prefetched_stack_with_whole_biases_trains_like_one_device(reference: dict) -> None:
    """``min_size=100``: the kernels split, the biases (96 and 48 elements) whole, sliced per layer."""
    mesh = create_device_mesh({"data": 8})
    model, optimizer = make_placed(
        lambda: Scanned(3, 16, prefetch=True), optax.sgd(0.1), mesh,
        layout="fsdp", min_size=100, units=Residual, prefetch=True,
    )  # fmt: skip
    assert model.layers.up.bias.get_value().sharding.spec == jax.sharding.PartitionSpec()
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    assert_trains_to(step, model, optimizer, _batches(), reference)
    comparison = step.check_communication(model, optimizer, _batches(1)[0])
    assert comparison.matches, str(comparison)


def test_a_stack_is_split_on_a_feature_dimension_never_the_layer_axis() -> None:
    """16 layers of width 8 on 8 devices: the layer axis is the largest (or ties) and would be taken first."""
    mesh = create_device_mesh({"data": 8})
    model, _ = _placed(mesh, "units", depth=16, width=8)
    specs = {p: v.get_value().sharding.spec for p, v in nnx.to_flat_state(nnx.state(model.layers, nnx.Param))}
    assert specs[("up", "kernel")] == jax.sharding.PartitionSpec(None, None, "data")  # (16, 8, 16)
    assert specs[("down", "bias")] == jax.sharding.PartitionSpec(None, "data")  # (16, 8)
    assert all(not spec or spec[0] is None for spec in specs.values()), specs
    with jax.set_mesh(mesh):  # one layer, unstacked: its kernel's first dimension is still the one split
        one = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
        substrax.shard_state(one, nnx.Optimizer(one, optax.sgd(0.1), wrt=nnx.Param), mesh=mesh, min_size=1)
    assert one.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec("data")


def _temp_bytes(depth: int, variant: str, width: int = 128) -> int:
    mesh = create_device_mesh({"data": 8})
    model, optimizer = _placed(mesh, variant, depth=depth, width=width)
    batch = {"x": np.zeros((64, 4), np.float32), "y": np.zeros(64, np.float32)}
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    return step.lower(model, optimizer, batch).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("variant", ["units", "units-prefetch"])
def test_a_scanned_unit_keeps_temporary_memory_flat_in_depth(variant: str) -> None:
    layer = 2 * 128 * 256 * 4  # one layer's kernels, whole
    slope = (_temp_bytes(8, variant) - _temp_bytes(2, variant)) / 6
    assert slope < 0.5 * layer, f"temp grows {slope / layer:.2f} layers per layer"


def _loop_carries(variant: str) -> list[set[str]]:
    """The types each while loop of the explicit step carries, from the compiled program."""
    mesh = create_device_mesh({"data": 8})
    model, optimizer = _placed(mesh, variant)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    text = step.lower(model, optimizer, _batches(1)[0]).compile().as_text()
    loops = re.findall(r"= \((.*)\) while\(", text)
    return [set(re.findall(r"[a-z0-9]+\[[0-9,]*\]", carried)) for carried in loops]


def test_prefetch_carries_the_next_layer_gathered_through_each_loop() -> None:
    """Forward and backward, each loop carries the next layer's whole kernels (gathered an
    iteration ahead; a bias its gradient does not read is gathered forward only); without
    prefetch no loop carries a whole kernel."""
    kernels = {"f32[16,32]", "f32[32,16]"}  # up, down: one layer's, whole
    prefetched = _loop_carries("units-prefetch")
    assert len(prefetched) == 2 and all(kernels <= carried for carried in prefetched), prefetched
    assert all(not (kernels & carried) for carried in _loop_carries("units"))


def test_a_unit_called_on_neither_its_whole_nor_one_layer_is_refused_by_name() -> None:
    """``nnx.scan`` over another axis fails in jax first; anything else reaching the unit is named."""
    from substrax._layout._owners import ParamSplit
    from substrax.explicit._units import _UnitRun

    run = _UnitRun(("layers",), True, "data", {("layers", "up", "kernel"): ParamSplit(1, 1)},
                   {("layers", "up", "kernel")}, None, None)  # fmt: skip
    run.shapes[("up", "kernel")] = (3, 2, 32)
    assert run.dim_of(("up", "kernel"), (3, 2, 32)) == 1  # whole
    assert run.dim_of(("up", "kernel"), (2, 32)) == 0  # one layer, inside nnx.scan
    with pytest.raises(
        ValueError, match=r"FSDP unit model\['layers'\]: its parameter unit\['up'\]\['kernel'\] .*\(32,\)"
    ):
        run.dim_of(("up", "kernel"), (32,))


def test_prefetch_is_refused_where_it_cannot_run_naming_what_to_do() -> None:
    mesh = create_device_mesh({"data": 8})
    with jax.set_mesh(mesh):
        model = Scanned(3, 16)  # applies its stack with nnx.scan, not scan_layers
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(
        ValueError, match="prefetch=True gathers the next layer .* name the stacked block with units="
    ):
        substrax.shard_state(model, optimizer, mesh=mesh, min_size=1, prefetch=True)
    with pytest.raises(ValueError, match="reshard_after_forward=False would keep every layer"):
        substrax.shard_state(model, optimizer, mesh=mesh, min_size=1, units=Residual, prefetch=True,
                             reshard_after_forward=False)  # fmt: skip
    with pytest.raises(TypeError, match="prefetch must be True or False; got 1"):
        substrax.shard_state(model, optimizer, mesh=mesh, min_size=1, units=Residual, prefetch=1)
    substrax.shard_state(model, optimizer, mesh=mesh, min_size=1, units=Residual, prefetch=True)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"FSDP unit model\['layers'\] was placed with prefetch=True but called directly .*scan_layers",
    ):
        step(model, optimizer, _batches(1)[0])


class Counted(nnx.Module):
    """A layer that keeps a count of its calls: state other than parameters."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(width, width, rngs=rngs)
        self.calls = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls.set_value(self.calls.get_value() + 1)
        return jnp.tanh(self.lin(x))


def test_a_prefetched_stack_with_state_other_than_parameters_is_refused_by_path() -> None:
    mesh = create_device_mesh({"data": 8})

    class Stack(nnx.Module):
        def __init__(self) -> None:
            self.embed = nnx.Linear(4, 16, rngs=nnx.Rngs(1))
            self.layers = stack(lambda rngs: Counted(16, rngs), 2, nnx.Rngs(0))

        def __call__(self, x: jax.Array) -> jax.Array:
            return substrax.nn.scan_layers(self.layers, self.embed(x)).sum(axis=1)

    with jax.set_mesh(mesh):
        model = Stack()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh, min_size=1, units=Counted, prefetch=True)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh)
    with pytest.raises(
        ValueError, match=r"FSDP unit model\['layers'\] \(prefetch=True\) .* unit\['calls'\] is an BatchStat"
    ):
        step(model, optimizer, _batches(1)[0])
