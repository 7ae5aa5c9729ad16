"""A non-finite step is skipped in the graph: no state goes NaN, and the loss says so."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, Normed, mse, params_of, regression_batches
from flax import nnx

import substrax
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards


def _poisoned(batch: dict, leaf: str, value: float) -> dict:
    bad = {k: v.copy() for k, v in batch.items()}
    bad[leaf][3, 0] = value
    return bad


def _state(model: nnx.Module, optimizer: nnx.Optimizer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]


@pytest.mark.parametrize("spelling", ["call", "bind"])
@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
@pytest.mark.parametrize("mode", substrax.MODES)
@pytest.mark.parametrize(("leaf", "value"), [("x", np.nan), ("y", np.inf)])
def test_a_nonfinite_batch_skips_the_update_and_training_goes_on(
    mesh8: jax.sharding.Mesh, mode: str, layout: str, spelling: str, leaf: str, value: float
) -> None:
    good = regression_batches(3, rows=32)
    sharding = create_data_parallel_sharding(mesh8)
    batches = [good[0], _poisoned(good[1], leaf, value), good[2]]

    def train(batches: list[dict]) -> tuple[list[float], dict, list[np.ndarray]]:
        with jax.set_mesh(mesh8):
            model = MLP()
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        if layout == "fsdp":
            substrax.shard_state(model, optimizer, mesh=mesh8, min_size=1)
        step = substrax.make_train_step(mse, mode, mesh=mesh8)
        if spelling == "bind":
            with step.bind(model, optimizer) as fast:
                losses = [float(fast(place_batch_on_shards(b, sharding))) for b in batches]
        else:
            losses = [float(step(model, optimizer, place_batch_on_shards(b, sharding))) for b in batches]
        return losses, params_of(model), _state(model, optimizer)

    losses, params, state = train(batches)
    want_losses, want_params, want_state = train([good[0], good[2]])  # the bad step never happened
    assert not np.isfinite(losses[1])  # the step says so
    np.testing.assert_allclose([losses[0], losses[2]], want_losses, rtol=1e-6)
    for name in want_params:
        np.testing.assert_allclose(params[name], want_params[name], rtol=1e-6, atol=1e-7, err_msg=name)
    for got, want in zip(state, want_state, strict=True):  # the optimizer's count and moments too
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert np.all(np.isfinite(got))


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_skipped_step_keeps_the_batch_statistics(mesh8: jax.sharding.Mesh, mode: str) -> None:
    with jax.set_mesh(mesh8):
        model = Normed(momentum=0.99)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = _state(model, optimizer)
    batch = _poisoned(regression_batches(1, rows=32)[0], "x", np.nan)
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    assert np.isnan(
        float(step(model, optimizer, place_batch_on_shards(batch, create_data_parallel_sharding(mesh8))))
    )
    for got, want in zip(_state(model, optimizer), before, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_skip_nonfinite_false_applies_every_update(mesh8: jax.sharding.Mesh, mode: str) -> None:
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = _poisoned(regression_batches(1, rows=32)[0], "x", np.nan)
    step = substrax.make_train_step(mse, mode, mesh=mesh8, skip_nonfinite=False)
    step(model, optimizer, place_batch_on_shards(batch, create_data_parallel_sharding(mesh8)))
    assert np.isnan(params_of(model)["hidden/kernel"]).any()


class Tower(nnx.Module):  # depth Linear(64) layers and a head: 2 * depth + 2 gradient leaves
    def __init__(self, depth: int) -> None:
        rngs = nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(16 if i == 0 else 64, 64, rngs=rngs) for i in range(depth)])
        self.head = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.head(x)


def _kernels(compiled: Any) -> int:
    """The compiled program's top-level kernels (fusions): what the CPU runs one by one per device."""
    return compiled.as_text().split("ENTRY", 1)[1].count(" fusion(")


@pytest.mark.parametrize("depth", [2, 6])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_the_guard_reads_the_gradients_with_a_few_kernels_per_shape_not_per_leaf(
    mesh8: jax.sharding.Mesh, mode: str, depth: int
) -> None:
    """#26.10: the flag is one variadic reduction per leaf shape, the select fused into the update.

    Measured on jax 0.12 CPU: ``all(isfinite(x))`` per leaf was three kernels a leaf
    (is-finite, reduce-window, reduce), a sum per leaf one to two; the grouped maximum is
    5 more kernels at depth 2 (6 leaves) and 7 at depth 6 (14 leaves), 5 shapes each.
    """
    with jax.set_mesh(mesh8):
        model = Tower(depth)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    batch = regression_batches(1, rows=64, din=16)[0]
    shapes = len({(x.shape, x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))})

    def kernels(guard: bool) -> int:
        step = substrax.make_train_step(mse, mode, mesh=mesh8, skip_nonfinite=guard)
        return _kernels(step.lower(model, optimizer, batch, donate=True).compile())

    extra = kernels(True) - kernels(False)
    assert 0 < extra <= shapes + 3, (extra, shapes)


@pytest.mark.parametrize(
    "leaf",
    [
        np.array([1.0, np.nan], np.float32),
        np.array([np.nan, 1.0], np.float32),  # NaN wins a maximum from either side
        np.array([1.0, np.inf], np.float32),
        np.array([-np.inf, 0.0], np.float32),
        np.full(4, 60_000.0, np.float16),  # finite, near float16's largest
        np.full(2, 3e38, np.float32),  # finite, their sum past float32's range (read off a sum, it was not)
        -np.full(3, 5.0, np.float32),
        np.array([np.nan], jnp.bfloat16),
        np.array([1 + 1j, complex(0, np.inf)], np.complex64),
        np.array([1 + 1j, complex(np.nan, 0)], np.complex64),
        np.array([1 + 1j], np.complex64),
        np.arange(3),  # integers hold no NaN
    ],
)
@pytest.mark.parametrize("by_max", [True, False], ids=["replicated", "split"])
def test_the_guards_flag_reads_each_leaf(leaf: np.ndarray, by_max: bool) -> None:
    """Replicated state: the leaves read off their largest magnitudes; split state: element by
    element. Both say what NumPy says, inside a program too."""
    from substrax._shared.update import all_finite

    tree = {"ok": jnp.ones(3), "same shape": jnp.full(leaf.shape, 2, leaf.dtype), "leaf": jnp.asarray(leaf)}
    expected = bool(np.isfinite(np.asarray(leaf, np.complex128)).all())
    assert bool(all_finite(tree, by_max=by_max)) is expected
    assert bool(jax.jit(lambda t: all_finite(t, by_max=by_max))(tree)) is expected


def test_skip_nonfinite_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"skip_nonfinite must be True or False; got 'yes'"):
        substrax.make_train_step(mse, skip_nonfinite="yes")  # type: ignore[arg-type]


class Deep(nnx.Module):  # notebook 05's model: 16 -> 64 -> 64 -> 1
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.hidden = nnx.Linear(16, 64, rngs=rngs)
        self.mid = nnx.Linear(64, 64, rngs=rngs)
        self.out = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.mid(jnp.tanh(self.hidden(x)))))


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_the_guard_costs_no_copy_of_the_state(mesh8: jax.sharding.Mesh, mode: str, layout: str) -> None:
    """#26.10: the guard's select fuses into the update; the donated step copies no state.

    Measured on jax 0.12 CPU: under ``lax.cond`` the replicated explicit step's temporaries
    grew from 184 B to 43,152 B (the 64 KB state's copy); one update call whose new state
    is chosen against the old made XLA copy every donated optimizer-state buffer (7 copies
    for Adam on two parameters). Undonated, the guarded step stays within a quarter of the
    state of the unguarded one.
    """
    with jax.set_mesh(mesh8):
        model = Deep()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    if layout == "fsdp":
        substrax.shard_state(model, optimizer, mesh=mesh8, min_size=1)
    batch = regression_batches(1, rows=64, din=16)[0]
    state = sum(x.nbytes for x in jax.tree.leaves(nnx.state((model, optimizer))))

    def compiled(guard: bool, donate: bool) -> Any:
        step = substrax.make_train_step(mse, mode, mesh=mesh8, skip_nonfinite=guard)
        return step.lower(model, optimizer, batch, donate=donate).compile()

    def temp(guard: bool, donate: bool) -> int:
        return compiled(guard, donate).memory_analysis().temp_size_in_bytes

    guarded = compiled(True, True)
    entry = guarded.as_text().split("ENTRY", 1)[1]
    assert not re.findall(r"= \S+ copy\(", entry), [line for line in entry.splitlines() if " copy(" in line]
    assert guarded.memory_analysis().temp_size_in_bytes - temp(False, True) < state / 16
    assert temp(True, False) - temp(False, False) < state / 4, (temp(True, False), temp(False, False), state)
