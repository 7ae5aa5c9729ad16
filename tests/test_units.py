"""FSDP units (#27): a unit's split parameters gathered together just in time, one collective per unit.

Against a one-device reference (SGD: strictly); the compiled program read at two depths
(``memory_analysis()``: temporary memory flat in depth with units, a whole layer per layer
without); the census expecting one gather per unit and pass and one reduce-scatter per unit.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trains_to
from flax import nnx
from models import make_placed, mse, one_device_params, params_of

import substrax
from substrax._layout import unit_paths
from substrax.mesh import create_device_mesh

MESH = create_device_mesh({"data": 8})


class Stack(nnx.Module):
    def __init__(self, depth: int, width: int, *, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Linear(width, width, rngs=rngs)  # with the head: the root unit
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.embed(x)
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.head(x)[:, 0]


def _batch(width: int, rows: int = 64, seed: int = 0) -> dict:
    x = np.random.default_rng(seed).normal(size=(rows, width)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(axis=1))}


def _placed(depth: int, width: int, units, reshard: bool = True) -> tuple[Stack, nnx.Optimizer]:
    return make_placed(
        lambda: Stack(depth, width), optax.sgd(0.1), MESH,
        layout="fsdp", min_size=1, units=units, reshard_after_forward=reshard,
    )  # fmt: skip


def _one_device(batches: list[dict]) -> dict[str, np.ndarray]:
    return one_device_params(lambda: Stack(3, 16), optax.sgd(0.1), batches)


def _in_layers(path: tuple, module: nnx.Module) -> bool:
    return path[:1] == ("layers",) and len(path) == 2


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_units_train_like_one_device_and_the_census_counts_them(
    mode: str, reshard: bool, microbatches: int
) -> None:
    batches = [_batch(16, seed=i) for i in range(2)]
    want = _one_device(batches)
    model, optimizer = _placed(3, 16, _in_layers, reshard)
    assert unit_paths(model) == {("layers", i): reshard for i in range(3)}
    step = substrax.make_train_step(mse, mode, mesh=MESH, microbatches=microbatches)
    assert_trains_to(step, model, optimizer, batches, want)
    if mode == "implicit":  # units change nothing XLA compiles (the layouts guide, "Units")
        return
    comparison = step.check_communication(model, optimizer, batches[0])
    assert comparison.matches, str(comparison)
    if mode == "explicit":  # one buffer per unit and pass, named by the unit
        units = [i for i, _ in comparison.matched if i.what.startswith("unit ")]
        scatters = [i for i in units if i.kind == "reduce-scatter"]
        gathers = [i for i in units if i.kind == "all-gather"]
        assert sorted(i.what for i in scatters) == [f"unit model['layers'][{i}]" for i in range(3)]
        assert len(gathers) == 3 * (2 if reshard else 1)
        assert all(i.in_loop == (microbatches > 1) for i in units)
        compiled = {id(p) for i, parts in comparison.matched if i in scatters for p in parts}
        assert len(compiled) == 3  # one reduce-scatter per unit, not per parameter
        # the root unit (embed's kernel and bias, the head's kernel): one buffer each way, once
        root = [(i, parts) for i, parts in comparison.matched if i.what == "root unit"]
        assert sorted((i.kind, len(parts), i.in_loop) for i, parts in root) == [
            ("all-gather", 1, False),
            ("reduce-scatter", 1, False),
        ]


def test_a_units_reduce_scatter_is_written_for_its_platform() -> None:
    """The TPU compiler reduces a one-row-per-device (or flat) reduce-scatter whole (census guide,
    "On a TPU"): there each device's row goes as whole (8, 128) tiles, padded to them. A CPU step
    keeps one row per device, the program the plan's XLA:CPU estimate models."""
    model, optimizer = _placed(3, 16, _in_layers)
    step = substrax.make_train_step(mse, "explicit", mesh=MESH)
    comparison = step.check_communication(model, optimizer, _batch(16))
    assert comparison.matches, str(comparison)
    scatters = [
        (i, ps) for i, ps in comparison.matched if i.what.startswith("unit ") and i.kind == "reduce-scatter"
    ]
    # a layer: a 16x16 kernel and 16 biases over 8 devices, 34 elements each
    assert len(scatters) == 3 and all(
        [str(p.buffer) for p in parts] == ["f32[8,34]"] and i.bytes == 8 * 34 * 4 for i, parts in scatters
    )
    # the TPU's form sums the same rows: each device's block, padded to a tile and cut back to 34
    from substrax._shared.scatter import rows_for, scatter_rows

    buffer = jnp.arange(8 * 8 * 34, dtype=jnp.float32).reshape(8, 8, 34)  # a (8, 34) block a device

    def scattered(platform: str) -> jax.Array:
        def per_device(b: jax.Array) -> jax.Array:
            with rows_for(platform):
                return scatter_rows([b[0]], "data", "test")[0][None]

        return jax.jit(jax.shard_map(per_device, mesh=MESH, in_specs=jax.P("data"), out_specs=jax.P("data")))(
            buffer
        )

    np.testing.assert_array_equal(scattered("tpu"), np.asarray(buffer).sum(axis=0))
    np.testing.assert_array_equal(scattered("cpu"), np.asarray(buffer).sum(axis=0))
    with rows_for("tpu"):
        lowered = jax.jit(jax.shard_map(
            lambda b: scatter_rows([b[0]], "data", "test")[0][None], mesh=MESH, in_specs=jax.P("data"),
            out_specs=jax.P("data"),
        )).lower(buffer).as_text()  # fmt: skip
    assert "tensor<8x8x128xf32>" in lowered  # a (8, 128) tile a device: 34 padded to 1,024


def _temp_bytes(depth: int, units, width: int = 256) -> int:
    model, optimizer = _placed(depth, width, units)
    step = substrax.make_train_step(mse, "explicit", mesh=MESH)
    batch = {"x": np.zeros((64, width), np.float32), "y": np.zeros(64, np.float32)}
    return step.lower(model, optimizer, batch).compile().memory_analysis().temp_size_in_bytes


def test_units_keep_temporary_memory_flat_in_depth() -> None:
    layer = 256 * 256 * 4  # one kernel's bytes
    plain = (_temp_bytes(8, None) - _temp_bytes(2, None)) / 6
    units = (_temp_bytes(8, _in_layers) - _temp_bytes(2, _in_layers)) / 6
    assert plain > 0.9 * layer  # without units every layer is gathered whole at once (the test can fail)
    assert units < 0.5 * layer, f"temp grows {units / layer:.2f} layers per layer with units"


def test_units_are_refused_where_they_mean_nothing() -> None:
    with jax.set_mesh(MESH):
        model = Stack(2, 16)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="layout='zero1' gathers no parameter"):
        substrax.shard_state(model, optimizer, mesh=MESH, layout="zero1", units=nnx.Linear)
    with pytest.raises(ValueError, match=r"matched model\['layers'\]\[0\] inside model\['layers'\]"):
        substrax.shard_state(model, optimizer, mesh=MESH, units=lambda p, m: p[:1] == ("layers",))
    with pytest.raises(ValueError, match="matched the model itself"):
        substrax.shard_state(model, optimizer, mesh=MESH, units=Stack)
    with pytest.raises(TypeError, match="units must be a module type"):
        substrax.shard_state(model, optimizer, mesh=MESH, units="layers")
    with pytest.raises(TypeError, match="reshard_after_forward must be True or False"):
        substrax.shard_state(model, optimizer, mesh=MESH, units=nnx.Linear, reshard_after_forward=1)


@pytest.mark.parametrize(
    ("units", "asked"),
    [(nnx.Conv, "Conv"), ((), r"\(\)"), ((nnx.Conv, nnx.Dropout), r"\(Conv, Dropout\)"),
     (lambda path, module: False, "<lambda>")],
    ids=["type", "empty", "types", "predicate"],
)  # fmt: skip
def test_units_that_match_nothing_are_refused_naming_the_models_module_types(units, asked: str) -> None:
    # regression (#51): each placed plain FSDP without a word, the units asked for lost
    with jax.set_mesh(MESH):
        model = Stack(2, 16)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(
        ValueError,
        match=rf"units={asked} matched no submodule of the Stack, .* Its submodules are of the types "
        rf"Linear, List: name one \(units=Linear\)",
    ):
        substrax.shard_state(model, optimizer, mesh=MESH, min_size=1, units=units)
    assert unit_paths(model) == {}


def test_units_change_how_parameters_move_not_where_they_live(tmp_path: Path) -> None:
    model, optimizer = _placed(2, 16, nnx.Linear)
    placed = {k: v.sharding for k, v in _params_arrays(model).items()}
    substrax.checkpoint.save(tmp_path / "ckpt", 1, model, optimizer)
    other, other_opt = _placed(2, 16, None)  # the same layout without units
    assert {k: v.sharding for k, v in _params_arrays(other).items()} == placed
    substrax.checkpoint.restore(tmp_path / "ckpt", other, other_opt)
    for key, value in params_of(model).items():
        np.testing.assert_array_equal(params_of(other)[key], value)
    substrax.shard_state(other, other_opt, mesh=MESH, min_size=1)  # and units cleared
    assert unit_paths(other) == {}


def _params_arrays(model: nnx.Module) -> dict[str, jax.Array]:
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _example() -> object:
    path = Path(__file__).resolve().parents[1] / "examples" / "transformer_lm.py"
    spec = importlib.util.spec_from_file_location("transformer_lm_units", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_the_example_transformer_with_its_blocks_as_units_trains_like_one_device(
    mode: str, scan: bool
) -> None:
    _trains_like_one_device(mode, scan, prefetch=False)


def test_the_example_transformer_with_its_stack_prefetched_trains_like_one_device() -> None:
    """Its scanned blocks through ``substrax.nn.scan_layers``, the stacked unit prefetched (#27.4)."""
    _trains_like_one_device("explicit", True, prefetch=True)


def _trains_like_one_device(mode: str, scan: bool, prefetch: bool) -> None:
    lm = _example()
    sizes = {"seq": 8, "d": 16, "blocks": 2, "scan": scan}
    tokens = np.random.default_rng(0).integers(0, 128, size=(16, 9))
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    with jax.default_device(jax.devices()[0]):
        ref, ref_opt = lm.make_model(**sizes)
        nnx.jit(lambda m, o, b: o.update(m, nnx.grad(lm.loss_fn)(m, b)))(ref, ref_opt, batch)
    with jax.set_mesh(MESH):
        model, optimizer = lm.make_model(**sizes)
    substrax.shard_state(model, optimizer, mesh=MESH, min_size=1, units=lm.Block, prefetch=prefetch)
    assert len(unit_paths(model)) == (1 if scan else 2)  # scanned: one stacked unit, gathered per layer
    train = substrax.make_train_step(lm.loss_fn, mode, mesh=MESH)
    train(model, optimizer, batch)
    with jax.default_device(jax.devices()[0]):  # the loss after one step, on one device, for both
        moved = nnx.state(model)
        twin, _ = lm.make_model(**sizes)
        nnx.update(twin, jax.device_put(moved, jax.devices()[0]))
        loss = nnx.jit(lm.loss_fn)  # one compile, not one per operation
        np.testing.assert_allclose(float(loss(twin, batch)), float(loss(ref, batch)), rtol=2e-5)


@pytest.mark.parametrize("reshard", [True, False])
def test_units_gather_in_the_policys_dtype_and_keep_the_state_float32(reshard: bool) -> None:
    """#27.5: a unit gathers in ``param_dtype`` and reduces in ``reduce_dtype``; the census expects it."""
    model, optimizer = _placed(3, 16, _in_layers, reshard)
    policy = substrax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    step = substrax.make_train_step(mse, "explicit", mesh=MESH, precision=policy)
    batch = _batch(16)
    loss = step(model, optimizer, batch)
    assert loss.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    lowered = step.lower(model, optimizer, batch).as_text()
    gathers = [line for line in lowered.splitlines() if "stablehlo.all_gather" in line]  # parameters only
    assert len(gathers) >= 3 * (2 if reshard else 1) and all("bf16" in line for line in gathers)
    comparison = step.check_communication(model, optimizer, batch)
    assert comparison.matches, str(comparison)
