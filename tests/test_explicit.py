"""The explicit path's metrics, its gradient rule and its traps, and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, Normed, mse, regression_batches
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import substrax
from substrax.explicit import (
    compare_gradients,
    data_parallel_value_and_grad,
    explicit_train_step,
    reduce_metrics_collective,
)
from substrax.mesh import create_device_mesh
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

P = PartitionSpec


def _metrics_loss(model: MLP, batch: dict) -> tuple[jax.Array, dict]:
    err = (model(batch["x"]) - batch["y"])[:, 0]
    metrics = {
        "mse": jnp.mean(err**2),
        "sse": jnp.sum(err**2),
        "max_err": jnp.max(err),
        "min_err": jnp.min(err),
        "per_example": err,
        "shard_size": jnp.float32(err.shape[0]),
    }
    return jnp.mean(err**2), metrics


REDUCE = {"sse": "sum", "max_err": "max", "min_err": "min", "per_example": "gather", "shard_size": None}


def _numpy_metrics(model: MLP, batch: dict) -> np.ndarray:
    return (np.asarray(model(jnp.asarray(batch["x"]))) - batch["y"])[:, 0]


@pytest.mark.parametrize("mode", ["implicit", "explicit"])
def test_metrics_match_numpy_on_the_global_batch(mesh8: jax.sharding.Mesh, mode: str) -> None:
    batch = regression_batches(1, rows=32)[0]
    with jax.set_mesh(mesh8):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)  # lr 0: metrics of the initial model
    err = _numpy_metrics(model, batch)
    step = substrax.make_train_step(_metrics_loss, mode, mesh=mesh8, has_aux=True, reduce=REDUCE)
    loss, metrics = step(model, optimizer, place_batch_on_shards(batch, create_data_parallel_sharding(mesh8)))
    np.testing.assert_allclose(loss, np.mean(err**2), rtol=1e-5)
    np.testing.assert_allclose(metrics["mse"], np.mean(err**2), rtol=1e-5)
    np.testing.assert_allclose(metrics["sse"], np.sum(err**2), rtol=1e-5)
    np.testing.assert_allclose(metrics["max_err"], np.max(err), rtol=1e-6)
    np.testing.assert_allclose(metrics["min_err"], np.min(err), rtol=1e-6)
    np.testing.assert_allclose(metrics["per_example"], err, rtol=1e-5, atol=1e-6)  # in batch order
    # None: implicit keeps the global value, explicit stacks one value per device
    want_sizes = [32.0] if mode == "implicit" else [4.0] * 8
    np.testing.assert_array_equal(np.atleast_1d(metrics["shard_size"]), want_sizes)


def test_reduce_metrics_collective_rejects_unknown_operation(mesh8: jax.sharding.Mesh) -> None:
    def body(x: jax.Array) -> dict:
        return reduce_metrics_collective({"loss": x.sum()}, {"loss": "median"}, "data")

    with pytest.raises(
        ValueError,
        match=r"Metric 'loss' asks for reduction 'median'; use one of 'mean', 'sum', 'max', 'min', 'gather'",
    ):
        jax.shard_map(body, mesh=mesh8, in_specs=P("data"), out_specs=P())(np.ones(8))


# --- the gradient rule and its two traps --------------------------------------------------


def _linear_loss(w: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ w - y) ** 2)


@pytest.fixture(scope="module")
def linear_problem() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 3)).astype(np.float32)
    y = rng.normal(size=(32,)).astype(np.float32)
    w = rng.normal(size=(3,)).astype(np.float32)
    want = 2 * x.T @ (x @ w - y) / len(y)  # the gradient by hand, in NumPy
    return w, x, y, want


def _shard_mapped(fn: object, mesh: jax.sharding.Mesh, check_vma: bool) -> object:
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(), check_vma=check_vma)
    )


def test_pmean_before_grad_is_the_full_gradient(mesh8: jax.sharding.Mesh, linear_problem: tuple) -> None:
    w, x, y, want = linear_problem
    value_and_grad = data_parallel_value_and_grad(_linear_loss, "data")
    loss, grad = _shard_mapped(value_and_grad, mesh8, True)(w, x, y)
    np.testing.assert_allclose(grad, want, rtol=1e-5)
    np.testing.assert_allclose(loss, np.mean((x @ w - y) ** 2), rtol=1e-6)


def test_trap_pmean_after_grad_is_axis_size_too_large(
    mesh8: jax.sharding.Mesh, linear_problem: tuple
) -> None:
    w, x, y, want = linear_problem
    wrong = _shard_mapped(lambda w, x, y: jax.lax.pmean(jax.grad(_linear_loss)(w, x, y), "data"), mesh8, True)
    np.testing.assert_allclose(wrong(w, x, y), 8 * want, rtol=1e-5)


def test_trap_check_vma_false_flips_the_rule(mesh8: jax.sharding.Mesh, linear_problem: tuple) -> None:
    w, x, y, want = linear_problem
    before = _shard_mapped(
        lambda w, x, y: jax.grad(lambda w: jax.lax.pmean(_linear_loss(w, x, y), "data"))(w), mesh8, False
    )
    after = _shard_mapped(
        lambda w, x, y: jax.lax.pmean(jax.grad(_linear_loss)(w, x, y), "data"), mesh8, False
    )
    # without the pvary/psum pair each device keeps the gradient of its own shard, and the
    # replicated out_spec returns device 0's
    shard0 = 2 * x[:4].T @ (x[:4] @ w - y[:4]) / 4
    np.testing.assert_allclose(before(w, x, y), shard0, rtol=1e-5)
    assert not np.allclose(before(w, x, y), want, rtol=1e-2)
    np.testing.assert_allclose(after(w, x, y), want, rtol=1e-5)


def test_helper_refuses_check_vma_false(mesh8: jax.sharding.Mesh, linear_problem: tuple) -> None:
    w, x, y, _ = linear_problem
    with pytest.raises(ValueError, match=r"does not vary over axis 'data'.*check_vma=False"):
        _shard_mapped(data_parallel_value_and_grad(_linear_loss, "data"), mesh8, False)(w, x, y)


def test_helper_refuses_a_non_scalar_loss(mesh8: jax.sharding.Mesh, linear_problem: tuple) -> None:
    w, x, y, _ = linear_problem
    with pytest.raises(
        ValueError, match=r"The loss must be a scalar array; loss_fn returned an array of shape \(4,\)"
    ):
        _shard_mapped(data_parallel_value_and_grad(lambda w, x, y: (x @ w - y) ** 2, "data"), mesh8, True)(
            w, x, y
        )


# --- compare_gradients ---------------------------------------------------------------------


def _candidate(mesh: jax.sharding.Mesh, *, average_after: bool, check_vma: bool):
    def grads(model: MLP, batch: dict) -> nnx.State:
        graphdef, params = nnx.split(model, nnx.Param)

        def per_device(params: nnx.State, shard: dict) -> nnx.State:
            def loss(p: nnx.State) -> jax.Array:
                local = mse(nnx.merge(graphdef, p), shard)
                return local if average_after else jax.lax.pmean(local, "data")

            g = jax.grad(loss)(params)
            return jax.lax.pmean(g, "data") if average_after else g

        return jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=check_vma
        )(params, batch)

    return grads


def test_compare_gradients_passes_a_correct_candidate(mesh8: jax.sharding.Mesh) -> None:
    batch = regression_batches(1, rows=32)[0]
    report = compare_gradients(
        MLP(seed=1), mse, batch, mesh8, candidate=_candidate(mesh8, average_after=False, check_vma=True)
    )
    assert report.ok, str(report)
    assert report.methods == ("implicit", "explicit", "candidate")
    assert report.max_abs_diff < 1e-5
    assert {row.path for row in report.rows} == {"hidden.bias", "hidden.kernel", "out.bias", "out.kernel"}
    assert "gradient check: OK" in str(report)
    assert report.scale["candidate"] == pytest.approx(1.0, rel=1e-5)


def test_compare_gradients_names_the_axis_size_factor(mesh8: jax.sharding.Mesh) -> None:
    batch = regression_batches(1, rows=32)[0]
    report = compare_gradients(
        MLP(seed=1), mse, batch, mesh8, candidate=_candidate(mesh8, average_after=True, check_vma=True)
    )
    assert not report.ok
    assert all(row.ok["implicit"] and row.ok["explicit"] and not row.ok["candidate"] for row in report.rows)
    assert report.scale["candidate"] == pytest.approx(8.0, rel=1e-4)
    text = str(report)
    assert "MISMATCH" in text
    assert "gradient is 8x the reference: a factor of 8, the size of mesh axis 'data'" in text
    assert "pmean(grad(loss))" in text


def test_compare_gradients_catches_the_check_vma_false_trap(mesh8: jax.sharding.Mesh) -> None:
    batch = regression_batches(1, rows=32)[0]
    report = compare_gradients(
        MLP(seed=1), mse, batch, mesh8, candidate=_candidate(mesh8, average_after=False, check_vma=False)
    )
    assert not report.ok
    text = report.diagnosis["candidate"]
    assert "not by a constant factor" in text and "check_vma=False" in text and "worst leaves" in text


def test_compare_gradients_on_a_2d_mesh_with_a_prefix_batch() -> None:
    mesh = create_device_mesh({"data": 4, "model": 2})
    rows = regression_batches(1, rows=16)[0]
    batch = {"rows": rows, "scale": np.float32(2.0)}
    report = compare_gradients(
        MLP(),
        lambda m, b: b["scale"] * mse(m, b["rows"]),
        batch,
        mesh,
        batch_spec={"rows": P("data"), "scale": P()},
    )
    assert report.ok, str(report)


def test_compare_gradients_rejects_a_candidate_with_missing_leaves(mesh8: jax.sharding.Mesh) -> None:
    batch = regression_batches(1, rows=32)[0]

    def partial(model: MLP, batch: dict) -> nnx.State:
        return nnx.grad(mse)(model, batch)["hidden"]

    with pytest.raises(
        ValueError,
        match=(
            r"candidate gradient does not have the model's parameters: it lacks "
            r"\['hidden.bias', 'hidden.kernel', 'out.bias', 'out.kernel'\] and has \['bias', 'kernel'\]"
        ),
    ):
        compare_gradients(MLP(), mse, batch, mesh8, candidate=partial)


def test_compare_gradients_blames_a_summed_loss_for_a_one_over_axis_factor(mesh8: jax.sharding.Mesh) -> None:
    batch = regression_batches(1, rows=32)[0]
    summed = lambda m, b: jnp.sum((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    report = compare_gradients(MLP(), summed, batch, mesh8)
    assert all(row.ok["implicit"] and not row.ok["explicit"] for row in report.rows)
    assert report.scale["explicit"] == pytest.approx(1 / 8, rel=1e-4)
    assert "1/8 of the reference" in report.diagnosis["explicit"]
    assert "sums over the examples instead of averaging" in report.diagnosis["explicit"]


def test_compare_gradients_with_aux(mesh8: jax.sharding.Mesh) -> None:
    batch = regression_batches(1, rows=32)[0]
    assert compare_gradients(MLP(), _metrics_loss, batch, mesh8, has_aux=True).ok


# --- errors --------------------------------------------------------------------------------


def _model_and_optimizer(mesh: jax.sharding.Mesh) -> tuple[MLP, nnx.Optimizer]:
    with jax.set_mesh(mesh):
        model = MLP()
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_no_mesh(mesh8: jax.sharding.Mesh) -> None:
    model, optimizer = _model_and_optimizer(mesh8)
    batch = regression_batches(1, rows=8)[0]
    with pytest.raises(ValueError, match=r"No mesh: pass mesh=, or call inside `with jax.set_mesh"):
        nnx.jit(lambda m, o, b: explicit_train_step(m, o, mse, b))(model, optimizer, batch)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_misnamed_data_axis_is_refused_when_the_step_is_called(mesh8: jax.sharding.Mesh, mode: str) -> None:
    """A mesh may lack the data axis (one device along it), but not leave an axis without a role."""
    model, optimizer = _model_and_optimizer(mesh8)
    step = substrax.make_train_step(mse, mode, mesh=mesh8, data_axis="batch")
    with pytest.raises(
        ValueError,
        match=r"Axis 'batch' is not in the mesh, whose axes are \('data',\)\. .* axis 'data' \(8 devices\) "
        r"has no role.* Pass data_axis='data'",
    ):
        step(model, optimizer, regression_batches(1, rows=8)[0])  # (test_axis_roles: before lowering)


def test_batch_spec_errors(mesh8: jax.sharding.Mesh) -> None:
    model, optimizer = _model_and_optimizer(mesh8)
    rows = regression_batches(1, rows=8)[0]
    batch = {"rows": rows, "scale": np.float32(1.0)}
    loss = lambda m, b: mse(m, b["rows"])  # noqa: E731
    cases = [
        ({"rows": P("data"), "scale": P("data")}, r"batch\['scale'\] has shape \(\) .* splits dimension 0"),
        ({"rows": P("data")}, r"batch_spec tree does not fit the batch at batch \(the root\)"),
        (
            {"rows": P("data"), "scale": P("model")},
            r"axis 'model' of .* is not in the mesh, whose axes are \('data',\)",
        ),
        (
            {"rows": P("data"), "scale": "replicated"},
            r"holds 'replicated' at batch\['scale'\], which is not a batch_spec",
        ),
    ]
    for spec, message in cases:
        step = substrax.make_train_step(loss, "explicit", mesh=mesh8, batch_spec=spec)
        with pytest.raises(ValueError, match=message):
            step(model, optimizer, batch)
    ok = substrax.make_train_step(
        loss, "explicit", mesh=mesh8, batch_spec={"rows": NamedSharding(mesh8, P("data")), "scale": P()}
    )
    assert np.isfinite(float(ok(model, optimizer, batch)))


def test_indivisible_batch(mesh8: jax.sharding.Mesh) -> None:
    model, optimizer = _model_and_optimizer(mesh8)
    batch = regression_batches(1, rows=12)[0]
    step = substrax.make_train_step(mse, "explicit", mesh=mesh8)
    with pytest.raises(
        ValueError, match=r"batch\['x'\] has size 12 along dimension 0, which does not divide by 8"
    ):
        step(model, optimizer, batch)


def test_unknown_mode_and_unknown_reduction(mesh8: jax.sharding.Mesh) -> None:
    with pytest.raises(ValueError, match=r"mode must be one of \('implicit', 'explicit'\); got 'explicity'"):
        substrax.make_train_step(mse, "explicity")  # type: ignore[arg-type]
    for mode in substrax.MODES:  # refused when the step is built, before any tracing
        with pytest.raises(ValueError, match=r"Metric 'sse' asks for reduction 'total'"):
            substrax.make_train_step(_metrics_loss, mode, mesh=mesh8, has_aux=True, reduce={"sse": "total"})


def test_batch_statistics_are_averaged_over_the_data_axis(mesh8: jax.sharding.Mesh) -> None:
    batch = regression_batches(1, rows=32)[0]
    with jax.set_mesh(mesh8):
        model = Normed()
        optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    h = batch["x"] @ np.asarray(model.hidden.kernel.get_value()) + np.asarray(model.hidden.bias.get_value())
    shards = h.reshape(8, 4, 8)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh8)
    step(model, optimizer, place_batch_on_shards(batch, create_data_parallel_sharding(mesh8)))
    # each device's running statistics come from its 4 rows; the step keeps their average
    np.testing.assert_allclose(
        model.norm.mean.get_value(), 0.5 * shards.mean(1).mean(0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(model.norm.var.get_value(), 0.5 + 0.5 * shards.var(1).mean(0), rtol=1e-5)
    assert model.norm.mean.get_value().sharding.is_fully_replicated


def test_batchnorm_with_the_axis_name_matches_the_implicit_step(mesh8: jax.sharding.Mesh) -> None:
    batches = regression_batches(5, rows=32)
    sharding = create_data_parallel_sharding(mesh8)
    results = {}
    for mode, axis_name in (("implicit", None), ("explicit", "data")):
        with jax.set_mesh(mesh8):
            model = Normed(axis_name)
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = substrax.make_train_step(mse, mode, mesh=mesh8)
        losses = [float(step(model, optimizer, place_batch_on_shards(b, sharding))) for b in batches]
        results[mode] = (
            losses,
            np.asarray(model.norm.var.get_value()),
            np.asarray(model.out.kernel.get_value()),
        )
    for got, want in zip(results["explicit"], results["implicit"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


class Counting(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.positives = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:
        self.positives.set_value(self.positives.get_value() + jnp.sum(x[:, 0] > 0).astype(jnp.int32))
        return super().__call__(x)


def test_per_device_integer_state_is_refused_with_its_path(mesh8: jax.sharding.Mesh) -> None:
    with jax.set_mesh(mesh8):
        model = Counting()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    batch = place_batch_on_shards(regression_batches(1, rows=32)[0], create_data_parallel_sharding(mesh8))
    step = substrax.make_train_step(mse, "explicit", mesh=mesh8)
    with pytest.raises(
        ValueError,
        match=r"model\['positives'\] \(BatchStat, int32\) came out of the step different on each device",
    ):
        step(model, optimizer, batch)


class Dropped(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7))

    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(self.drop(x))


def _mask_loss(model: Dropped, batch: dict) -> tuple[jax.Array, dict]:
    kept = model.drop(jnp.ones_like(batch["x"])) != 0  # the mask this device draws for its rows
    return mse(model, batch), {"kept": kept.astype(jnp.float32)}


def test_each_device_draws_its_own_dropout_mask(mesh8: jax.sharding.Mesh) -> None:
    with jax.set_mesh(mesh8):
        model = Dropped()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    count = int(model.drop.rngs.count.get_value())
    key = np.asarray(jax.random.key_data(model.drop.rngs.key.get_value()))
    batch = place_batch_on_shards(regression_batches(1, rows=64)[0], create_data_parallel_sharding(mesh8))
    step = substrax.make_train_step(
        _mask_loss, "explicit", mesh=mesh8, has_aux=True, reduce={"kept": "gather"}
    )
    _, metrics = step(model, optimizer, batch)
    masks = np.asarray(metrics["kept"]).reshape(8, 8, 4)  # device, row, feature
    assert len({m.tobytes() for m in masks}) == 8  # no two devices drew the same mask
    assert 0.3 < masks.mean() < 0.7
    # the stream advanced by the same count on every device and its key is unchanged
    assert int(model.drop.rngs.count.get_value()) == count + 2
    np.testing.assert_array_equal(jax.random.key_data(model.drop.rngs.key.get_value()), key)


# --- what loss_fn returns, and the metrics' names -------------------------------------------


@pytest.mark.parametrize("mode", ["implicit", "explicit"])
def test_loss_output_must_match_has_aux(mesh8: jax.sharding.Mesh, mode: str) -> None:
    model, optimizer = _model_and_optimizer(mesh8)
    batch = regression_batches(1, rows=8)[0]
    with pytest.raises(
        ValueError,
        match=(
            r"loss_fn returned a tuple of 2 where the loss goes; if it returns \(loss, metrics\), "
            r"pass has_aux=True"
        ),
    ):
        substrax.make_train_step(_metrics_loss, mode, mesh=mesh8)(model, optimizer, batch)
    with pytest.raises(
        ValueError,
        match=r"With has_aux=True, loss_fn must return \(loss, metrics\); it returned an array of shape \(\)",
    ):
        substrax.make_train_step(mse, mode, mesh=mesh8, has_aux=True)(model, optimizer, batch)
    as_tuple = lambda m, b: (mse(m, b), (mse(m, b),))  # noqa: E731
    with pytest.raises(
        ValueError, match=r"Metrics must be a flat mapping from name to value; got a tuple of 1"
    ):
        substrax.make_train_step(as_tuple, mode, mesh=mesh8, has_aux=True)(model, optimizer, batch)
    nested = lambda m, b: (mse(m, b), {"g": {"a": mse(m, b)}})  # noqa: E731
    with pytest.raises(ValueError, match=r"Metric 'g' is a dict with keys \['a'\]; metrics must be flat"):
        substrax.make_train_step(nested, mode, mesh=mesh8, has_aux=True)(model, optimizer, batch)


@pytest.mark.parametrize("mode", ["implicit", "explicit"])
def test_reductions_must_name_real_metrics(mesh8: jax.sharding.Mesh, mode: str) -> None:
    model, optimizer = _model_and_optimizer(mesh8)
    batch = regression_batches(1, rows=8)[0]
    step = substrax.make_train_step(_metrics_loss, mode, mesh=mesh8, has_aux=True, reduce={"max_eror": "max"})
    with pytest.raises(
        ValueError, match=r"name metric\(s\) \['max_eror'\] that are not among the metrics \['max_err'"
    ):
        step(model, optimizer, batch)
    step = substrax.make_train_step(_metrics_loss, mode, mesh=mesh8, has_aux=True, reduce={"mse": "gather"})
    with pytest.raises(ValueError, match=r"Metric 'mse' asks for 'gather'.* but it is a scalar"):
        step(model, optimizer, batch)
    with pytest.raises(
        ValueError, match=r"reduce= says how to reduce metrics, which loss_fn returns only with has_aux=True"
    ):
        substrax.make_train_step(mse, mode, mesh=mesh8, reduce={"mse": "sum"})


def test_reduce_custom_refuses_an_unknown_name() -> None:
    from substrax.spmd import reduce_custom

    with pytest.raises(ValueError, match=r"\['b'\] that are not among the metrics \['a'\]"):
        reduce_custom({"a": jnp.arange(4.0)}, {"b": "sum"})


def test_collectives_name_an_unbound_axis(mesh8: jax.sharding.Mesh) -> None:
    from substrax.spmd import reduce_mean_collective

    def body(x: jax.Array) -> dict:
        return reduce_mean_collective({"a": x.sum()})  # the reference's default axis, 'batch'

    with pytest.raises(
        ValueError,
        match=(
            r"reduce_mean_collective: axis 'batch' is not bound here "
            r"\(the enclosing shard_map's axes are \('data',\)\)"
        ),
    ):
        jax.shard_map(body, mesh=mesh8, in_specs=P("data"), out_specs=P())(np.ones(8))
    with pytest.raises(
        ValueError, match=r"axis 'data' is not bound here \(no shard_map or pmap encloses the call\)"
    ):
        data_parallel_value_and_grad(_linear_loss, "data")(np.ones(3), np.ones((4, 3)), np.ones(4))


def test_implicit_mode_splits_a_host_batch_over_the_data_axis(mesh8: jax.sharding.Mesh) -> None:
    model, optimizer = _model_and_optimizer(mesh8)
    host = regression_batches(1, rows=32)[0]
    report = substrax.census(
        substrax.make_train_step(mse, "implicit", mesh=mesh8).lower(model, optimizer, host).compile()
    )
    assert (
        report.count("all-reduce") == 1
    )  # each device computed on its own rows, then the gradients were summed
    with pytest.raises(
        ValueError, match=r"batch\['x'\] has size 12 along dimension 0, which does not divide by 8"
    ):
        substrax.make_train_step(mse, "implicit", mesh=mesh8)(
            model, optimizer, regression_batches(1, rows=12)[0]
        )
    with pytest.raises(ValueError, match=r"Axis 'batch' is not in the mesh, whose axes are \('data',\)"):
        substrax.make_train_step(mse, "implicit", mesh=mesh8, data_axis="batch")(model, optimizer, host)


def test_explicit_mode_refuses_a_sharded_model() -> None:
    mesh = create_device_mesh({"data": 4, "model": 2})
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))

    class Wide(nnx.Module):
        def __init__(self) -> None:
            self.hidden = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.hidden(x).sum(-1, keepdims=True)

    with jax.set_mesh(mesh):
        model = Wide()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    batch = regression_batches(1, rows=8)[0]
    with pytest.raises(
        ValueError,
        match=r"model\['hidden'\]\['kernel'\] is sharded as P\(None, 'model'\).*use mode='implicit'",
    ):
        substrax.make_train_step(mse, "explicit", mesh=mesh)(model, optimizer, batch)
    assert np.isfinite(float(substrax.make_train_step(mse, "implicit", mesh=mesh)(model, optimizer, batch)))
    assert model.hidden.kernel.get_value().sharding.spec == P(None, "model")  # implicit kept the layout
