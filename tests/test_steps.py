"""Both training steps against a one-device reference, on meshes of 1, 2, 4 and 8 devices."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    FLAT_LAYOUTS,
    MLP,
    assert_params_close,
    mse,
    params_of,
    reference_training,
    regression_batches,
)
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from models import Dropped

import substrax
from substrax.explicit import explicit_train_step
from substrax.mesh import create_device_mesh
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards, spmd_train_step

P = PartitionSpec
STEPS = 20
LR = 1e-2


def _train(mode: str, mesh: jax.sharding.Mesh, batches: list[dict]) -> tuple[list[float], dict]:
    with jax.set_mesh(mesh):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    sharding = create_data_parallel_sharding(mesh)
    losses = [float(step(model, optimizer, place_batch_on_shards(b, sharding))) for b in batches]
    return losses, params_of(model)


@pytest.fixture(scope="module")
def batches() -> list[dict]:
    return regression_batches(STEPS, rows=32)


@pytest.fixture(scope="module")
def reference(batches: list[dict]) -> tuple[list[float], dict]:
    return reference_training(batches, lr=LR)


def _as_the_reference_writes_it(
    step_fn: Any, mesh: jax.sharding.Mesh, batches: list
) -> tuple[MLP, list[float]]:
    """The test MLP trained by ``step_fn`` called as the reference calls it: in the user's
    ``nnx.jit``, the mesh set, the batch placed; its losses."""
    with jax.set_mesh(mesh):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    @nnx.jit
    def train_step(model: MLP, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
        return step_fn(model, optimizer, mse, batch)

    sharding = create_data_parallel_sharding(mesh)
    with jax.set_mesh(mesh):
        losses = [float(train_step(model, optimizer, place_batch_on_shards(b, sharding))) for b in batches]
    return model, losses


def test_spmd_train_step_as_the_reference_writes_it(
    mesh8: jax.sharding.Mesh, batches: list, reference: tuple
) -> None:
    model, losses = _as_the_reference_writes_it(spmd_train_step, mesh8, batches)
    assert model.hidden.kernel.get_value().sharding.is_fully_replicated
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_params_close(params_of(model), reference[1])


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_both_modes_match_the_one_device_reference(devices: int, batches: list, reference: tuple) -> None:
    mesh = create_device_mesh({"data": devices})
    ref_losses, ref_params = reference
    for mode in substrax.MODES:
        losses, params = _train(mode, mesh, batches)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=mode)
        assert_params_close(params, ref_params)
    assert ref_losses[-1] < 0.5 * ref_losses[0]  # it trains


def test_explicit_on_a_2d_mesh_reduces_over_data_only(batches: list, reference: tuple) -> None:
    mesh = create_device_mesh({"data": 4, "model": 2})
    losses, params = _train("explicit", mesh, batches)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_params_close(params, reference[1])


def test_explicit_step_called_directly_with_the_context_mesh(
    mesh8: jax.sharding.Mesh, batches: list, reference: tuple
) -> None:
    _, losses = _as_the_reference_writes_it(explicit_train_step, mesh8, batches[:10])
    np.testing.assert_allclose(losses, reference[0][:10], rtol=1e-5)


def _weighted_loss(model: MLP, batch: dict) -> jax.Array:
    rows = batch["rows"]
    return batch["batch_state"]["scale"] * jnp.mean((model(rows["x"]) - rows["y"]) ** 2)


def test_prefix_batch_rows_and_a_replicated_value(mesh8: jax.sharding.Mesh, batches: list) -> None:
    scale = np.float32(0.5)
    prefix_batches = [{"rows": b, "batch_state": {"scale": scale}} for b in batches[:10]]
    shardings = {"rows": create_data_parallel_sharding(mesh8), "batch_state": NamedSharding(mesh8, P())}
    specs = {"rows": P("data"), "batch_state": P()}

    device = jax.devices()[0]
    with jax.default_device(device):
        ref_model = MLP()
        ref_opt = nnx.Optimizer(ref_model, optax.adam(LR), wrt=nnx.Param)
        ref_step = nnx.jit(lambda m, o, b: spmd_train_step(m, o, _weighted_loss, b))
        ref_losses = [float(ref_step(ref_model, ref_opt, jax.device_put(b, device))) for b in prefix_batches]

    for mode in substrax.MODES:
        with jax.set_mesh(mesh8):
            model = MLP()
            optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
        step = substrax.make_train_step(_weighted_loss, mode, mesh=mesh8, batch_spec=specs)
        losses = [float(step(model, optimizer, place_batch_on_shards(b, shardings))) for b in prefix_batches]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=mode)
        assert_params_close(params_of(model), params_of(ref_model))


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("mode", ["implicit", "explicit"])
def test_bound_step_matches_the_reference(
    mesh8: jax.sharding.Mesh, batches: list, reference: tuple, mode: str, donate: bool
) -> None:
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    sharding = create_data_parallel_sharding(mesh8)
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    with step.bind(model, optimizer, donate=donate) as fast:
        losses = [float(fast(place_batch_on_shards(b, sharding))) for b in batches[:10]]
        # the model's arrays were consumed by the step: reading them is an error, not a stale value
        with pytest.raises(RuntimeError, match="deleted"):
            np.asarray(model.hidden.kernel.get_value())
        fast.sync()
        mid = params_of(model)
        losses += [float(fast(place_batch_on_shards(b, sharding))) for b in batches[10:]]
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_params_close(params_of(model), reference[1])
    assert int(optimizer.step.get_value()) == STEPS
    assert not np.allclose(mid["hidden/kernel"], reference[1]["hidden/kernel"])  # sync showed step 10's state


@pytest.mark.parametrize("donate", [True, False])
def test_a_bound_step_lowers_the_program_it_runs(
    mesh8: jax.sharding.Mesh, batches: list, donate: bool
) -> None:
    # regression: .bind(...).lower(batch) lowered the undonated program while the step donated
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    batch = place_batch_on_shards(batches[0], create_data_parallel_sharding(mesh8))
    step = substrax.make_train_step(mse, "explicit", mesh=mesh8)
    want = step.lower(model, optimizer, batch, donate=donate).as_text()
    with step.bind(model, optimizer, donate=donate) as fast:
        fast(batch)
        got = fast.lower(batch)
    assert got.as_text() == want
    aliased = got.compile().memory_analysis().alias_size_in_bytes
    state = sum(x.nbytes for x in jax.tree.leaves(nnx.state((model, optimizer))))  # replicated: each device's
    # donated: every state buffer updated in place
    assert aliased == (state if donate else 0), (aliased, state)


def _memory(lowered) -> tuple[int, int, int, int]:
    m = lowered.compile().memory_analysis()
    return m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes, m.alias_size_in_bytes


@pytest.mark.parametrize("mode", substrax.MODES)
def test_lower_by_default_lowers_the_program_the_plain_call_runs(mesh8: jax.sharding.Mesh, mode: str) -> None:
    # regression (#51): lower() donated nothing while the call donates: memory_analysis() read an
    # undonated peak (no alias, the state written to new buffers)
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh8, layout="fsdp", min_size=16)
    batch = place_batch_on_shards(regression_batches(1, rows=32)[0], create_data_parallel_sharding(mesh8))
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    lowered = step.lower(model, optimizer, batch)
    traced = step.traced(model, optimizer, batch)
    step(model, optimizer, batch)
    split = step._cached  # the program the call ran: its jitted step, lowered for the same arguments
    with step.mesh_context():
        ran = split.jitted.lower(split.arrays(), batch, placed=step.placed_specs(batch))
    assert lowered.as_text() == ran.as_text()
    memory = _memory(lowered)
    assert memory == _memory(ran)
    with step.mesh_context():
        assert _memory(traced.lower()) == memory
    state = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(nnx.state((model, optimizer))))
    assert memory[3] == state > 0, (memory, state)  # every state buffer updated in place
    undonated = _memory(step.lower(model, optimizer, batch, donate=False))  # .bind(donate=False)'s
    assert undonated[3] == 0 and undonated[:2] == memory[:2]


@pytest.mark.parametrize("layout", FLAT_LAYOUTS)
@pytest.mark.parametrize("mode", substrax.MODES)
def test_census_of_each_step_matches_its_layout(mesh8: jax.sharding.Mesh, mode: str, layout: str) -> None:
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    if layout != "replicated":
        substrax.shard_state(model, optimizer, mesh=mesh8, params=layout == "fsdp", min_size=16)
    batch = place_batch_on_shards(regression_batches(1, rows=32)[0], create_data_parallel_sharding(mesh8))
    found = substrax.make_train_step(mse, mode, mesh=mesh8).census(model, optimizer, batch)
    assert found.matches, str(found)
    grads = sum(int(np.prod(v.shape)) * 4 for v in params_of(model).values())  # float32 gradients
    report = found.report
    if layout == "replicated":  # one all-reduce, combined by XLA over the 4 gradients and the loss
        assert report.count("all-reduce") == 1 and report.bytes("all-reduce") == grads + 4
        assert report.kinds == ("all-reduce",)
    elif mode == "explicit":  # 3 split parameters: gathered (FSDP: before use; ZeRO-1: after the update)
        split = grads - 4  # all but the 1-element out bias
        assert report.bytes("reduce-scatter") == report.bytes("all-gather") == split
        # the loss, the unsplit out bias, and the non-finite guard's flag per split gradient
        assert report.bytes("all-reduce") == 4 + 4 + 3


@pytest.mark.parametrize("layout", FLAT_LAYOUTS)
@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_data_axis_of_size_one_runs_no_collective(mode: str, layout: str) -> None:
    mesh = create_device_mesh({"data": 1})
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    if layout != "replicated":
        substrax.shard_state(model, optimizer, mesh=mesh, params=layout == "fsdp", min_size=16)
    for k in (1, 2):
        found = substrax.make_train_step(mse, mode, mesh=mesh, microbatches=k).census(
            model, optimizer, regression_batches(1, rows=8)[0]
        )
        assert found.report.count() == 0 and found.matches, str(found)


def test_census_attributes_a_collective_the_loss_issues_to_the_model(mesh8: jax.sharding.Mesh) -> None:
    def with_extra_psum(model: MLP, batch: dict) -> jax.Array:
        # the loss's own collective (as BatchNorm's pmean is): counted and shown, not the step's
        return mse(model, batch) + 0.0 * jax.lax.psum(batch["x"][:, :3].sum(0), "data").sum()

    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    batch = place_batch_on_shards(regression_batches(1, rows=32)[0], create_data_parallel_sharding(mesh8))
    found = substrax.make_train_step(with_extra_psum, "explicit", mesh=mesh8).census(model, optimizer, batch)
    assert found.matches, str(found)
    assert [str(p.buffer) for p in found.model] == ["f32[3]"], str(found)
    assert "model:" in str(found) and "f32[3]" in str(found)


@pytest.mark.parametrize("mode", ["implicit", "explicit"])
def test_a_prefix_placed_batch_needs_no_batch_spec(
    mesh8: jax.sharding.Mesh, batches: list, mode: str
) -> None:
    shardings = {"rows": create_data_parallel_sharding(mesh8), "batch_state": NamedSharding(mesh8, P())}
    placed = [
        place_batch_on_shards({"rows": b, "batch_state": {"scale": np.float32(0.5)}}, shardings)
        for b in batches[:5]
    ]
    results = []
    for spec in (None, {"rows": P("data"), "batch_state": P()}):
        with jax.set_mesh(mesh8):
            model = MLP()
            optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
        step = substrax.make_train_step(_weighted_loss, mode, mesh=mesh8, batch_spec=spec)
        losses = [float(step(model, optimizer, b)) for b in placed[:3]]
        with step.bind(model, optimizer) as fast:
            losses += [float(fast(b)) for b in placed[3:]]
        results.append((losses, params_of(model)))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    assert_params_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-7)
    # a host batch has no placement to read: its 0-d scale is replicated, never split
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    host = {"rows": batches[0], "batch_state": {"scale": np.float32(0.5)}}
    loss = substrax.make_train_step(_weighted_loss, mode, mesh=mesh8)(model, optimizer, host)
    np.testing.assert_allclose(float(loss), results[0][0][0], rtol=1e-6)


def test_a_split_written_from_another_trace_raises_as_flax_does() -> None:
    """The plain call sets its results with one trace check for all variables (not two per
    variable): from inside a jit, where flax refuses to set a variable made outside, it still does."""
    from flax.errors import TraceContextError

    from substrax._train.split import SplitState

    model = MLP()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    split = SplitState(model, optimizer, lambda *graph: None)
    assert split._probe is not None  # the one check stands for all
    arrays = [a + 1 for a in split.arrays()]
    with pytest.raises(TraceContextError, match="Cannot mutate"):
        jax.jit(split.write)(arrays)
    split.write(arrays)
    assert all(v.get_raw_value() is a for v, a in zip(split.variables, arrays, strict=True))


def _rename_out(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    out = model.out
    del model.out
    model.last = out  # the same object under another name: a new graph


def _move_between_layers(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    bias = model.layers[0].bias
    del model.layers[0].bias
    model.layers[1].spare = bias  # the same variable in the next node: each node's keys differ


def _replace_in_list(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    model.layers[1] = nnx.Linear(4, 4, rngs=nnx.Rngs(1))


_CHANGES = {
    "a variable replaced": lambda m, o: setattr(m.hidden, "bias", nnx.Param(jnp.ones(16))),
    "a layer replaced": lambda m, o: setattr(m, "out", nnx.Linear(16, 1, rngs=nnx.Rngs(3))),
    "an attribute renamed": _rename_out,
    "a variable moved to another layer": _move_between_layers,
    "an attribute added": lambda m, o: setattr(m, "extra", nnx.Param(jnp.zeros(2))),
    "a static setting changed": lambda m, o: setattr(m.hidden, "use_bias", False),
    "a hyperparameter replaced": lambda m, o: o.opt_state.hyperparams.__setitem__(
        "learning_rate", jnp.asarray(0.0)
    ),
    "a list item replaced": _replace_in_list,
    "a list appended to": lambda m, o: m.layers.append(nnx.Linear(4, 4, rngs=nnx.Rngs(2))),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_split_sees_every_change_to_the_graph(change: str) -> None:
    """What the plain call checks each call (``SplitState.valid_for``) is the graph, not a sample of it."""
    from substrax._train.split import SplitState

    model = MLP()
    model.layers = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(0)) for _ in range(2)])
    optimizer = nnx.Optimizer(model, optax.inject_hyperparams(optax.adam)(learning_rate=LR), wrt=nnx.Param)
    split = SplitState(model, optimizer, lambda *graph: None)
    assert split.valid_for(model, optimizer)
    model.hidden.kernel.set_value(model.hidden.kernel.get_value() + 1)  # a new value: the same graph
    assert split.valid_for(model, optimizer)
    _CHANGES[change](model, optimizer)
    assert not split.valid_for(model, optimizer), change


@pytest.mark.parametrize("mode", substrax.MODES)
def test_the_plain_call_follows_changes_to_the_model(mesh8: jax.sharding.Mesh, mode: str) -> None:
    """The split is kept between calls, but a changed graph, setting or layout is seen."""
    batch = regression_batches(1, rows=32)[0]
    model = Dropped()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    step(model, optimizer, batch)
    model.eval()  # a setting: dropout off
    want = float(mse(model, batch))  # the step returns the loss before its update
    assert float(step(model, optimizer, batch)) == pytest.approx(want, rel=1e-5)
    model.out = nnx.Linear(16, 1, rngs=nnx.Rngs(7))  # a new layer (its optimizer state is stale: not used)
    model.out.kernel.set_value(model.out.kernel.get_value() * 0)
    model.out.bias.set_value(model.out.bias.get_value() + 2.0)
    assert float(step(model, nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param), batch)) == pytest.approx(
        float(jnp.mean((2.0 - batch["y"]) ** 2)), rel=1e-5
    )
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    step(model, optimizer, batch)
    substrax.shard_state(model, optimizer, mesh=mesh8, min_size=16)  # a layout placed after a call
    step(model, optimizer, batch)
    assert model.hidden.kernel.get_value().sharding.spec == P(None, "data")
    assert optimizer.opt_state[0].mu["hidden"]["kernel"].get_value().sharding.spec == P(None, "data")


@pytest.mark.parametrize("mode", substrax.MODES)
def test_the_plain_call_donates_a_copy_of_what_someone_else_holds(
    mesh8: jax.sharding.Mesh, mode: str
) -> None:
    """An array the user kept is never deleted under them, and the step stays one program.

    Which program runs must not hang on who holds what: on several processes a save in
    flight holds arrays on some of them (tests/workers/mp_worker.py's ``held`` check).
    """
    batch = regression_batches(1, rows=32)[0]
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    ran = lambda: {donate for (*_, donate), f in step._pure_steps.items() if f._cache_size()}  # noqa: E731
    first = model.hidden.kernel.get_value()  # uncommitted: the first call steps a copy placed on the mesh
    step(model, optimizer, batch)
    assert not first.is_deleted() and ran() == {True}
    kept = model.hidden.kernel.get_value()  # held from before the next step
    before = np.asarray(kept).copy()
    step(model, optimizer, batch)
    assert not kept.is_deleted() and np.array_equal(np.asarray(kept), before)
    assert not np.array_equal(np.asarray(model.hidden.kernel.get_value()), before)  # the step updated it
    del kept
    mu = optimizer.opt_state[0].mu["out"]["kernel"].get_value()  # held between steps
    mu_before = np.asarray(mu).copy()
    step(model, optimizer, batch)
    assert not mu.is_deleted() and np.array_equal(np.asarray(mu), mu_before)
    assert ran() == {True} and sum(f._cache_size() for f in step._pure_steps.values()) == 1


@pytest.mark.parametrize("mode", substrax.MODES)
@pytest.mark.parametrize("spelling", ["call", "bind"])
def test_the_first_call_compiles_the_program_every_later_call_runs(
    mesh8: jax.sharding.Mesh, mode: str, spelling: str
) -> None:
    """Uncommitted state (a model made off the mesh) is placed as a step leaves it, before the first call."""
    batch = regression_batches(1, rows=32)[0]
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    assert not model.hidden.kernel.get_value().committed
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    lowered = step.lower(model, optimizer, batch, donate=True).as_text()
    assert not model.hidden.kernel.get_value().committed  # lowering leaves the model where it is
    if spelling == "call":
        for _ in range(3):
            step(model, optimizer, batch)
    else:
        with step.bind(model, optimizer) as fast:
            for _ in range(3):
                fast(batch)
    assert sum(f._cache_size() for f in step._pure_steps.values()) == 1
    replicated = NamedSharding(mesh8, P())
    assert all(a.sharding == replicated for a in jax.tree.leaves(nnx.state((model, optimizer))))
    assert step.lower(model, optimizer, batch, donate=True).as_text() == lowered  # what ran was lowered
    assert not optimizer.opt_state[0].mu["out"]["kernel"].get_value().is_deleted()


PLACES = [
    *((m, p) for m in substrax.MODES for p in ("zero1", "fsdp")),
    ("implicit", "specs"),
    ("implicit", "eager"),
]


@pytest.mark.parametrize(("mode", "place"), PLACES)  # explicit mode reads the layout shard_state records
def test_placed_state_compiles_one_program_for_every_call(
    mesh8: jax.sharding.Mesh, mode: str, place: str
) -> None:
    """State placed by ``shard_state``, ``place_nnx_state_on_shards`` or flax's eager sharding
    with specs that end in ``None`` (``P("data", None)``) is stepped as the step writes its
    results (``P("data")``): the second call does not compile the step again (it did, the
    state's shardings unequal); an array the caller held from before is left whole."""
    batch = regression_batches(1, rows=32, din=8)[0]
    if place == "eager":
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", None))
        with jax.set_mesh(mesh8):
            model = MLP(din=8, width=16, dout=8)
            model.hidden = nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(1))
            optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    else:
        model = MLP(din=8, width=16, dout=8)
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    held = model.hidden.kernel.get_value()
    before = np.asarray(held).copy()
    if place == "specs":
        specs = [(nnx.PathContains("kernel"), P("data", None)), (nnx.PathContains("bias"), P(None))]
        placed = substrax.spmd.place_nnx_state_on_shards(nnx.state((model, optimizer)), mesh8, specs)
        nnx.update((model, optimizer), placed)
        assert model.out.kernel.get_value().sharding.spec == P("data")
    elif place != "eager":
        substrax.shard_state(model, optimizer, mesh=mesh8, layout=place, min_size=1)
    step = substrax.make_train_step(mse, mode, mesh=mesh8)
    for _ in range(3):
        step(model, optimizer, batch)
    assert sum(f._cache_size() for f in step._pure_steps.values()) == 1
    assert not held.is_deleted() and np.array_equal(np.asarray(held), before)


@pytest.mark.parametrize("mode", substrax.MODES)
@pytest.mark.parametrize("layout", ["hsdp", "fsdp"])
def test_state_split_over_an_axis_of_size_one_compiles_one_program(mode: str, layout: str) -> None:
    """An axis of size 1 splits nothing: ``shard_state`` places no spec naming it, as jit writes
    a step's results, so the second call does not compile the step again (HSDP on 2 devices,
    ``(replica=2, data=1)``, compiled 2 programs; the fuzzer's draw)."""
    mesh = create_device_mesh({"replica": 2, "data": 1} if layout == "hsdp" else {"data": 1})
    model = MLP(din=8, width=16, dout=8)
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh, layout=layout, min_size=1)
    assert model.hidden.kernel.get_value().sharding.spec == P()
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    rows = 2 * mesh.size
    for batch in regression_batches(3, rows=rows, din=8):
        step(model, optimizer, batch)
    assert sum(f._cache_size() for f in step._pure_steps.values()) == 1


def test_a_train_step_takes_its_options_whole() -> None:
    with pytest.raises(TypeError, match="options must be a substrax.StepOptions; got 'implicit'"):
        substrax.TrainStep(mse, "implicit")  # the keywords belong to make_train_step
    step = substrax.TrainStep(mse, substrax.StepOptions(mode="explicit", microbatches=2))
    assert (step.mode, step.microbatches) == ("explicit", 2)
