"""Optimizer state the step must not lose track of: masked state, replaced and re-set variables.

- ``optax.MaskedNode`` state (muon, ``multi_transform``, ``masked``): nnx wraps each in a
  variable with no array, which the split step once counted as an array (#26.1).
- A hyperparameter re-set mid-run (``set_value``) or an array assigned where the
  optimizer held a variable steps with the new value, as ``nnx.jit`` does, and a new
  value does not compile the step again (#26.2).
- An integer loss is refused in both modes (#26.3); a run of skipped steps warns, then
  raises (#26.4).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FLAT_LAYOUTS, MLP, mse, noise_floor, params_of, reference_training, regression_batches
from flax import nnx

import substrax
from substrax import NonFiniteStepsError, SkippedStepWarning
from substrax._shared.skips import LAG
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards


def _by_rank(p: object) -> object:
    return jax.tree.map(lambda x: "matrix" if x.ndim == 2 else "vector", p)


MASKED: dict[str, Callable[[], optax.GradientTransformation]] = {
    "muon": lambda: optax.contrib.muon(1e-2),
    "multi_transform": lambda: optax.multi_transform(
        {"matrix": optax.sgd(0.1, momentum=0.9), "vector": optax.adam(1e-2)}, _by_rank
    ),
    "masked": lambda: optax.chain(
        optax.masked(optax.trace(0.9), lambda p: jax.tree.map(lambda x: x.ndim == 2, p)), optax.sgd(0.1)
    ),
}
SGD_ONLY = {"masked"}


def test_the_masked_optimizers_hold_masked_nodes() -> None:
    for make in MASKED.values():
        nodes = jax.tree.leaves(
            make().init(nnx.state(MLP(), nnx.Param)), is_leaf=lambda x: isinstance(x, optax.MaskedNode)
        )
        assert any(isinstance(x, optax.MaskedNode) for x in nodes)


def _train(
    mesh: jax.sharding.Mesh, mode: str, layout: str, make: Callable, batches: list, spelling: str = "call"
):
    with jax.set_mesh(mesh):
        model = MLP()
        optimizer = nnx.Optimizer(model, make(), wrt=nnx.Param)
    if layout != "replicated":
        substrax.shard_state(model, optimizer, mesh=mesh, layout=layout, min_size=1)
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    placed = [place_batch_on_shards(b, create_data_parallel_sharding(mesh)) for b in batches]
    if spelling == "bind":
        with step.bind(model, optimizer) as fast:
            losses = [float(fast(b)) for b in placed]
    else:
        losses = [float(step(model, optimizer, b)) for b in placed]
    return losses, model, optimizer, step


# muon in every layout; the other two where their state is split (the parity fuzzer draws the rest)
DRAWS = [(n, layout) for n in sorted(MASKED) for layout in FLAT_LAYOUTS if n == "muon" or layout == "fsdp"]


@pytest.mark.parametrize(("name", "layout"), DRAWS)
@pytest.mark.parametrize("mode", substrax.MODES)
def test_masked_optimizer_state_trains_like_one_device(mesh8, mode: str, layout: str, name: str) -> None:
    batches = regression_batches(3, rows=32)
    want_losses, want = reference_training(batches, tx=MASKED[name]())
    losses, model, _, _ = _train(mesh8, mode, layout, MASKED[name], batches)
    if name in SGD_ONLY:  # strictly
        atol = 1e-6
    else:  # Adam-family (muon's Adam on vectors, the adam group): to the measured floor
        atol = 4 * noise_floor(MASKED[name], batches) + 1e-7
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got = params_of(model)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=atol, err_msg=key)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_muon_under_fsdp_binds_and_its_census_matches(mesh8, mode: str) -> None:
    batches = regression_batches(2, rows=32)
    _, want = reference_training(batches, tx=MASKED["muon"]())
    _, model, optimizer, step = _train(mesh8, mode, "fsdp", MASKED["muon"], batches, spelling="bind")
    got = params_of(model)
    for key in want:
        np.testing.assert_allclose(
            got[key], want[key], rtol=1e-5, atol=4 * noise_floor(MASKED["muon"], batches) + 1e-7
        )
    comparison = step.check_communication(
        model, optimizer, place_batch_on_shards(batches[0], create_data_parallel_sharding(mesh8))
    )
    assert comparison.matches, str(comparison)


def _hyper(lr: float) -> nnx.Optimizer:
    return optax.inject_hyperparams(optax.sgd)(learning_rate=lr)


@pytest.mark.parametrize("how", ["set_value", "assign"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_learning_rate_changed_mid_run_trains_like_nnx_jit(mesh8, mode: str, how: str) -> None:
    batches = regression_batches(4, rows=32)

    def change(optimizer: nnx.Optimizer) -> None:
        if how == "set_value":
            optimizer.opt_state.hyperparams["learning_rate"].set_value(0.02)
        else:  # what works under plain nnx.jit
            optimizer.opt_state.hyperparams["learning_rate"] = jnp.asarray(0.02)

    with jax.default_device(jax.devices()[0]):  # the reference: plain nnx.jit on one device
        ref = MLP()
        ref_opt = nnx.Optimizer(ref, _hyper(0.1), wrt=nnx.Param)
        ref_step = nnx.jit(lambda m, o, b: o.update(m, nnx.grad(mse)(m, b)))
        for i, b in enumerate(batches):
            if i == 2:
                change(ref_opt)
            ref_step(ref, ref_opt, b)
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, _hyper(0.1), wrt=nnx.Param)
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    for i, b in enumerate(batches):
        if i == 2:
            change(optimizer)
        step(model, optimizer, b)
    want, got = params_of(ref), params_of(model)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert "learning_rate" in str(substrax.layout_of(model, optimizer))  # the adopted variable is listed
    if how == "set_value":  # a new value of the same type does not compile the step again
        assert sum(jitted._cache_size() for jitted in step._pure_steps.values()) == 1


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_set_value_after_sync_inside_bind_is_used(mesh8, mode: str) -> None:
    batch = regression_batches(1, rows=32)[0]
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, _hyper(0.1), wrt=nnx.Param)
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    with step.bind(model, optimizer) as fast:
        fast(batch)
        fast.sync()
        before = params_of(model)
        optimizer.opt_state.hyperparams["learning_rate"].set_value(0.0)
        fast(batch)
    after = params_of(model)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_a_structural_change_inside_bind_is_refused(mesh8) -> None:
    batch = regression_batches(1, rows=32)[0]
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, _hyper(0.1), wrt=nnx.Param)
    fast = substrax.make_train_step(mse, mesh=mesh8).bind(model, optimizer)
    fast(batch)
    fast.sync()
    model.out = nnx.Linear(16, 1, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="changed structure inside a bind block"):
        fast(batch)


@pytest.mark.parametrize(
    ("dtype", "what_to_do"), [("int32", r"drop the \.astype"), ("complex64", r"jnp\.real, jnp\.abs")]
)
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_an_integer_or_complex_loss_is_refused_naming_its_dtype(
    mesh8, mode: str, microbatches: int, dtype: str, what_to_do: str
) -> None:
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = substrax.make_train_step(
        lambda m, b: mse(m, b).astype(dtype), mode, mesh=mesh8, microbatches=microbatches
    )
    with pytest.raises(TypeError, match=rf"dtype {dtype}\. .*{what_to_do}"):
        step(model, optimizer, regression_batches(1, rows=32)[0])
    assert int(optimizer.step[...]) == 0


@pytest.mark.parametrize("spelling", ["call", "bind"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_run_of_skipped_steps_warns_then_raises(mesh8, mode: str, spelling: str) -> None:
    good = regression_batches(1, rows=32)[0]
    bad = {"x": np.full_like(good["x"], np.nan), "y": good["y"]}
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = substrax.make_train_step(mse, mode, mesh=mesh8, max_skips_in_a_row=4)
    run = step.bind(model, optimizer) if spelling == "bind" else lambda b: step(model, optimizer, b)
    with pytest.warns(SkippedStepWarning) as seen:
        for batch in [good, bad, bad, good, bad, bad, bad]:  # a good step ends the first run
            run(batch)
        if spelling == "bind":
            run.sync()
        else:
            for _ in range(2 * LAG):  # the flags are read LAG at a time, LAG steps late
                run(good)
    counts = [str(w.message).split("(")[1].split(")")[0] for w in seen]
    assert counts == [
        "1 in a row, 1 in all",
        "2 in a row, 2 in all",
        "1 in a row, 3 in all",
        "2 in a row, 4 in all",
    ]
    with pytest.raises(NonFiniteStepsError, match="4 steps in a row were skipped"):
        for _ in range(4 + 3 * LAG):  # read by then, whatever goods are pending
            run(bad)
        if spelling == "bind":
            run.sync()


def test_max_skips_in_a_row_is_checked() -> None:
    with pytest.raises(ValueError, match="max_skips_in_a_row must be an int >= 1 or None; got 0"):
        substrax.make_train_step(mse, max_skips_in_a_row=0)


@pytest.mark.parametrize("name", ["muon", "multi_transform"])
@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_masked_optimizer_state_checkpoints_and_resumes_exactly(
    mesh8, tmp_path, layout: str, name: str
) -> None:
    batches = regression_batches(3, rows=32)
    _, model, optimizer, step = _train(mesh8, "explicit", layout, MASKED[name], batches[:2])
    substrax.checkpoint.save(tmp_path / "ckpt", 2, model, optimizer)
    step(model, optimizer, batches[2])
    with jax.set_mesh(mesh8):
        again = MLP(seed=5)
        again_opt = nnx.Optimizer(again, MASKED[name](), wrt=nnx.Param)
    if layout != "replicated":
        substrax.shard_state(again, again_opt, mesh=mesh8, layout=layout, min_size=1)
    assert substrax.checkpoint.restore(tmp_path / "ckpt", again, again_opt) == 2
    substrax.make_train_step(mse, "explicit", mesh=mesh8)(again, again_opt, batches[2])
    for a, b in zip(
        jax.tree.leaves(nnx.state((model, optimizer))), jax.tree.leaves(nnx.state((again, again_opt)))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layout_of_reads_an_assigned_array_as_the_variable_it_replaced() -> None:
    model = MLP()
    optimizer = nnx.Optimizer(model, _hyper(0.1), wrt=nnx.Param)
    optimizer.opt_state.hyperparams["learning_rate"] = jnp.asarray(0.5)
    assert "learning_rate" in str(substrax.layout_of(model, optimizer))
    assert isinstance(optimizer.opt_state.hyperparams["learning_rate"], nnx.OptArray)
    assert float(optimizer.opt_state.hyperparams["learning_rate"][...]) == 0.5
