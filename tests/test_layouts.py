"""Replicated, ZeRO-1 and FSDP state in both modes, and microbatches, against a one-device reference."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, assert_params_close, mse, params_of, reference_training, regression_batches
from flax import nnx
from jax.sharding import PartitionSpec

import substrax
from substrax.census import census
from substrax.mesh import create_device_mesh
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

P = PartitionSpec
LR = 1e-2
MIN_SIZE = 16  # the test MLP (width 16): hidden kernel, hidden bias and out kernel split; out bias not


def _shardings(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, PartitionSpec]:
    flat = nnx.to_flat_state(nnx.state((model, optimizer)))
    return {
        "/".join(map(str, p)): v.get_value().sharding.spec
        for p, v in flat
        if hasattr(v.get_value(), "sharding")
    }


def _same_layout(model: nnx.Module, optimizer: nnx.Optimizer, before: dict) -> None:
    """Every array is placed as ``before`` says (equivalent shardings: a size-1 axis splits nothing)."""
    for p, v in nnx.to_flat_state(nnx.state((model, optimizer))):
        value = v.get_value()
        want = jax.sharding.NamedSharding(value.sharding.mesh, before["/".join(map(str, p))])
        assert value.sharding.is_equivalent_to(want, value.ndim), (p, value.sharding, want)


def _placed(mesh: jax.sharding.Mesh, layout: str) -> tuple[MLP, nnx.Optimizer]:
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    if layout != "replicated":
        substrax.shard_state(model, optimizer, mesh=mesh, params=layout == "fsdp", min_size=MIN_SIZE)
    return model, optimizer


def _train(mode: str, layout: str, mesh: jax.sharding.Mesh, batches: list) -> tuple[list, dict, dict]:
    model, optimizer = _placed(mesh, layout)
    before = _shardings(model, optimizer)
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    sharding = create_data_parallel_sharding(mesh)
    losses = [float(step(model, optimizer, place_batch_on_shards(b, sharding))) for b in batches]
    _same_layout(model, optimizer, before)
    return losses, params_of(model), before


@pytest.fixture(scope="module")
def batches() -> list[dict]:
    return regression_batches(10, rows=32)


@pytest.fixture(scope="module")
def reference(batches: list[dict]) -> tuple[list[float], dict]:
    return reference_training(batches, lr=LR)


@pytest.fixture(scope="module")
def reference5(batches: list[dict]) -> tuple[list[float], dict]:
    return reference_training(batches[:5], lr=LR)


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_layout_trains_like_one_device_and_keeps_its_placement(
    mode: str, layout: str, devices: int, batches: list, reference: tuple
) -> None:
    mesh = create_device_mesh({"data": devices})
    losses, params, before = _train(mode, layout, mesh, batches)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_params_close(params, reference[1])
    split = P(None, "data") if devices > 1 else P()  # as jit writes it: an axis of size 1 splits nothing
    assert before["0/hidden/kernel"] == (split if layout == "fsdp" else P())
    assert before["1/opt_state/0/mu/hidden/kernel"] == split


@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
def test_state_bytes_per_device(mesh8: jax.sharding.Mesh, layout: str) -> None:
    model, optimizer = _placed(mesh8, layout)
    report = substrax.layout_of(model, optimizer)
    held = sum(
        v.get_value().addressable_shards[0].data.nbytes
        for _, v in nnx.to_flat_state(nnx.state((model, optimizer)))
        if isinstance(v.get_value(), jax.Array)
        and not jnp.issubdtype(v.get_value().dtype, jax.dtypes.prng_key)
    )
    split = sum(r.nbytes for r in report.rows if r.split_dim is not None)
    whole = sum(r.nbytes for r in report.rows if r.split_dim is None)
    assert held == report.bytes_per_device <= split // 8 + whole
    assert report.kind == layout and split > 0
    assert "split on dim 1" in str(report) and "model['out']['bias']" in str(report)


class Odd(nnx.Module):
    """A (33, 63) kernel (no dimension a multiple of 8), a (63, 64) one, a (64,) bias."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.odd = nnx.Linear(33, 63, use_bias=False, rngs=rngs)
        self.even = nnx.Linear(63, 64, rngs=rngs)


@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
def test_a_parameter_no_dimension_of_which_divides_is_named_not_left_whole_silently(
    mesh8: jax.sharding.Mesh, layout: str
) -> None:
    model = Odd()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    with pytest.warns(UserWarning) as seen:
        placed = substrax.shard_state(model, optimizer, mesh=mesh8, layout=layout)
    said = [str(w.message) for w in seen if "leaves" in str(w.message)]
    assert len(said) == 1, said  # once, naming every such leaf
    assert re.search(
        rf"shard_state\(layout='{layout}'\) leaves 1 parameter of at least min_size=1,024 elements whole "
        r"on every device: no dimension of it is a multiple of the 8 devices of 'data' "
        r"\(model\['odd'\]\['kernel'\] \(33, 63\)\)\. .*pad a dimension to a multiple of 8",
        said[0],
    ), said[0]
    assert "even" not in said[0]  # the (64,) bias, below min_size, is counted, not warned about
    assert [(w.path, w.shape, w.reason) for w in placed.left_whole] == [
        ("model['even']['bias']", (64,), "small"),
        ("model['odd']['kernel']", (33, 63), "indivisible"),
    ]
    summary = str(placed).splitlines()[0]
    assert summary.endswith(
        "; 2 parameters left whole: 1 of fewer than 1,024 elements (min_size), "
        "1 with no dimension a multiple of 8: model['odd']['kernel'] (33, 63)"
    ), summary
    assert summary.startswith(f"layout {layout} over 'data' (8 devices)")  # the (63, 64) kernel is split


def test_a_layout_that_could_split_nothing_says_what_was_asked(mesh8: jax.sharding.Mesh) -> None:
    model = nnx.Linear(33, 63, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    with pytest.warns(UserWarning, match=r"\(model\['kernel'\] \(33, 63\)\)"):
        placed = substrax.shard_state(model, optimizer, mesh=mesh8, layout="fsdp")
    assert (placed.kind, placed.asked) == ("replicated", "fsdp")
    said = "layout replicated (fsdp asked) over 'data' (8 devices): 25,712 state bytes"
    assert str(placed).startswith(said)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replicated on purpose, or nothing odd: no warning
        quiet = substrax.shard_state(model, optimizer, mesh=mesh8, layout="replicated")
        mlp = MLP()  # every parameter splits but the (1,) bias: fewer elements than devices
        mlp_optimizer = nnx.Optimizer(mlp, optax.adam(LR), wrt=nnx.Param)
        tiny = substrax.shard_state(mlp, mlp_optimizer, mesh=mesh8, min_size=1)
    assert quiet.left_whole == () and "left whole" not in str(quiet)
    assert "1 with no dimension a multiple of 8: model['out']['bias'] (1,)" in str(tiny)  # named, not warned


def test_a_parameter_split_over_model_on_its_only_dimension_is_counted_not_warned_about() -> None:
    """A column layer's bias (64,) on (data 4, model 2): its one dimension is the layer's own split."""
    model = substrax.nn.ColumnParallelLinear(16, 64, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    mesh = create_device_mesh({"data": 4, "model": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placed = substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    assert [(w.path, w.reason) for w in placed.left_whole] == [("model['bias']", "taken")]
    said = "1 parameter left whole: 1 with every such dimension split over another axis: model['bias'] (64,)"
    assert said in str(placed)


def test_explicit_fsdp_step_gathers_and_reduce_scatters(mesh8: jax.sharding.Mesh, batches: list) -> None:
    model, optimizer = _placed(mesh8, "fsdp")
    batch = place_batch_on_shards(batches[0], create_data_parallel_sharding(mesh8))
    report = census(
        substrax.make_train_step(mse, "explicit", mesh=mesh8).lower(model, optimizer, batch).compile()
    )
    split_bytes = sum(
        r.nbytes
        for r in substrax.layout_of(model, optimizer).rows
        if r.owner == "model" and r.split_dim is not None
    )
    assert report.bytes("all-gather") == split_bytes  # each split parameter gathered whole, once
    assert report.bytes("reduce-scatter") == split_bytes  # and its gradient reduce-scattered, once
    assert report.bytes("all-reduce") < 16  # the loss and the 1-element out bias; no split gradient
    assert not report.in_loop()


class Noisy(nnx.Module):
    """BatchNorm over the global batch and dropout: state a layer updates, and random streams."""

    def __init__(self, mode: str, *, dropout: float) -> None:
        rngs = nnx.Rngs(0, dropout=1)
        self.hidden = nnx.Linear(4, 16, use_bias=False, rngs=rngs)  # a bias before BatchNorm has no gradient
        # the global batch's statistics: implicit mode sees it whole; explicit mode reduces over the axis
        self.norm = nnx.BatchNorm(
            16, momentum=0.5, axis_name="data" if mode == "explicit" else None, rngs=rngs
        )
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(jnp.tanh(self.norm(self.hidden(x)))))


def _train_noisy(mode: str, layout: str, dropout: float, mesh: jax.sharding.Mesh, batches: list) -> tuple:
    model = Noisy(mode, dropout=dropout)
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh, params=layout == "fsdp", min_size=MIN_SIZE)
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    losses = [float(step(model, optimizer, b)) for b in batches]
    return losses, params_of(model), np.asarray(model.norm.mean.get_value())


@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
def test_batchnorm_model_matches_between_modes_and_dropout_trains(
    mesh8: jax.sharding.Mesh, batches: list, layout: str
) -> None:
    results = {mode: _train_noisy(mode, layout, 0.0, mesh8, batches[:4]) for mode in substrax.MODES}
    np.testing.assert_allclose(results["explicit"][0], results["implicit"][0], rtol=1e-5)
    assert_params_close(results["explicit"][1], results["implicit"][1])
    np.testing.assert_allclose(results["explicit"][2], results["implicit"][2], rtol=1e-5, atol=1e-6)
    for mode in substrax.MODES:  # dropout draws masks: the losses move off the deterministic ones
        losses = _train_noisy(mode, layout, 0.5, mesh8, batches[:3])[0]
        assert np.all(np.isfinite(losses)) and losses != results[mode][0][:3]


def test_shard_state_errors(mesh8: jax.sharding.Mesh) -> None:
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"Axis 'batch' is not in the mesh, whose axes are \('data',\)"):
        substrax.shard_state(model, optimizer, mesh=mesh8, axis="batch")
    with pytest.raises(ValueError, match=r"min_size must be >= 0 .* got -1"):
        substrax.shard_state(model, optimizer, mesh=mesh8, min_size=-1)
    with pytest.raises(TypeError, match=r"min_size must be an int"):
        substrax.shard_state(model, optimizer, mesh=mesh8, min_size=2.5)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"takes the model's nnx.Optimizer; got Adam|got GradientTransformation"
    ):
        substrax.shard_state(model, optax.adam(LR), mesh=mesh8)  # type: ignore[arg-type]
    other = nnx.Optimizer(MLP(width=32), optax.adam(LR), wrt=nnx.Param)
    with pytest.raises(
        ValueError,
        match=(
            r"optimizer\['opt_state'\]\[0\]\['mu'\]\['hidden'\]\['bias'\] \(shape \(32,\)\) "
            r"mirrors no parameter"
        ),
    ):
        substrax.shard_state(model, other, mesh=mesh8)


def _declared_over_model(optional: bool = False) -> tuple[nnx.Module, nnx.Optimizer]:
    """The MLP with its hidden kernel declared split over ``model``, as a tensor-parallel layer would
    (``optional``: as ``substrax.nn``'s layers declare it, ``optional_axes=("model",)``)."""
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(create_device_mesh({"data": 4, "model": 2})):
        model = MLP()
        model.hidden = nnx.Linear(4, 16, kernel_init=init, rngs=nnx.Rngs(0))
        if optional:
            model.hidden.kernel.set_metadata(optional_axes=("model",))
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
    mesh = create_device_mesh({"data": 8})
    for _, variable in nnx.to_flat_state(nnx.state((model, optimizer))):  # bring every array to the 1-D mesh
        value = variable.get_value()
        if hasattr(value, "shape") and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            variable.set_value(jax.device_put(np.asarray(value), jax.sharding.NamedSharding(mesh, P())))
    return model, optimizer


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_split_over_an_axis_the_mesh_lacks_is_refused_by_the_step_by_path(mode: str, batches: list) -> None:
    model, optimizer = _declared_over_model()

    step = substrax.make_train_step(mse, mode, mesh=create_device_mesh({"data": 8}))
    said = r"model\['hidden'\]\['kernel'\] is declared sharded as .*over mesh axis 'model', which the mesh"
    with pytest.raises(ValueError, match=said + r".*substrax.shard_state"):
        step(model, optimizer, batches[0])


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_split_over_an_optional_axis_the_mesh_lacks_is_placed_whole_by_the_step(
    mode: str, batches: list, reference5: tuple
) -> None:
    """A spec that declares its axis optional (as substrax.nn's layers do) needs no shard_state."""
    model, optimizer = _declared_over_model(optional=True)
    step = substrax.make_train_step(mse, mode, mesh=create_device_mesh({"data": 8}))
    losses = [float(step(model, optimizer, b)) for b in batches[:5]]
    want_losses, want_params = reference5
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5, atol=2e-6)
    assert_params_close(params_of(model), want_params)
    assert model.hidden.kernel.get_metadata()["out_sharding"] == (
        None,
        "model",
    )  # fitted inside the step only


@pytest.mark.parametrize("mode", substrax.MODES)
def test_shard_state_places_a_split_over_an_axis_the_mesh_lacks_whole_and_keeps_it(
    mode: str, batches: list
) -> None:
    """On a mesh without ``model`` the declared split is none; a later 2-D mesh splits it again."""
    model, optimizer = _declared_over_model()
    mesh = create_device_mesh({"data": 8})
    layout = substrax.shard_state(model, optimizer, mesh=mesh, layout="zero1", min_size=8)
    hidden = next(r for r in layout.rows if r.path == "model['hidden']['kernel']")
    assert (hidden.split_dim, hidden.other_splits) == (None, ())
    assert model.hidden.kernel.get_metadata()["declared_sharding"] == (None, "model")
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    assert np.isfinite(float(step(model, optimizer, batches[0])))
    layout = substrax.shard_state(
        model, optimizer, mesh=create_device_mesh({"data": 4, "model": 2}), min_size=8
    )
    hidden = next(r for r in layout.rows if r.path == "model['hidden']['kernel']")
    assert (hidden.split_dim, hidden.other_splits) == (0, ((1, "model", 2),))


# ----------------------------------------------------------------------------------------- microbatches


def _aux_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, dict]:
    x0 = batch["x"][:, 0]
    return mse(model, batch), {"x0": x0, "x0_max": x0, "x0_sum": x0, "x0_mean": x0}


@pytest.mark.parametrize("microbatches", [1, 2, 4])
@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_microbatches_train_like_the_whole_batch(
    mode: str, layout: str, microbatches: int, mesh8: jax.sharding.Mesh, batches: list, reference5: tuple
) -> None:
    model, optimizer = _placed(mesh8, layout)
    reduce = {"x0": "gather", "x0_max": "max", "x0_sum": "sum", "x0_mean": "mean"}
    step = substrax.make_train_step(
        _aux_loss, mode, mesh=mesh8, has_aux=True, reduce=reduce, microbatches=microbatches
    )
    losses = []
    for b in batches[:5]:
        loss, metrics = step(model, optimizer, place_batch_on_shards(b, create_data_parallel_sharding(mesh8)))
        losses.append(float(loss))
        x0 = b["x"][:, 0]
        np.testing.assert_array_equal(np.asarray(metrics["x0"]), x0)  # every row, in the global order
        np.testing.assert_allclose(
            [metrics["x0_max"], metrics["x0_sum"], metrics["x0_mean"]],
            [x0.max(), x0.sum(), x0.mean()],
            rtol=1e-5,
        )
    np.testing.assert_allclose(losses, reference5[0], rtol=1e-5)
    assert_params_close(params_of(model), reference5[1])


def _reductions(report: object) -> list:
    return [r for r in report.rows if r.kind in ("all-reduce", "reduce-scatter")]  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_explicit_microbatches_reduce_once_outside_the_loop(
    mesh8: jax.sharding.Mesh, batches: list, layout: str
) -> None:
    batch = place_batch_on_shards(batches[0], create_data_parallel_sharding(mesh8))
    reports = {}
    for k in (1, 4):
        model, optimizer = _placed(mesh8, layout)
        step = substrax.make_train_step(mse, "explicit", mesh=mesh8, microbatches=k)
        reports[k] = census(step.lower(model, optimizer, batch).compile())
    looped = reports[4]
    assert looped.in_loop() == ()  # no collective of any kind runs per microbatch
    assert len(_reductions(looped)) <= len(_reductions(reports[1]))
    assert sum(r.bytes for r in _reductions(looped)) == sum(r.bytes for r in _reductions(reports[1]))


def test_microbatch_errors(mesh8: jax.sharding.Mesh, batches: list) -> None:
    with pytest.raises(ValueError, match=r"microbatches must be >= 1 .* got 0"):
        substrax.make_train_step(mse, "explicit", microbatches=0)
    with pytest.raises(TypeError, match=r"microbatches must be an int; got '2'"):
        substrax.make_train_step(mse, "implicit", microbatches="2")  # type: ignore[arg-type]
    for mode in substrax.MODES:
        model, optimizer = _placed(mesh8, "replicated")
        step = substrax.make_train_step(mse, mode, mesh=mesh8, microbatches=3)
        with pytest.raises(
            ValueError,
            match=(
                r"batch\['x'\] has 4 rows per device \(32 rows over 8 devices\), "
                r"which do not split into microbatches=3"
            ),
        ):
            step(model, optimizer, batches[0])


@pytest.mark.parametrize("layout", ["zero1", "fsdp"])
def test_compare_gradients_accepts_split_state(mesh8: jax.sharding.Mesh, batches: list, layout: str) -> None:
    from substrax.explicit import compare_gradients

    model, _ = _placed(mesh8, layout)
    report = compare_gradients(model, mse, batches[0], mesh8)
    assert report.ok, str(report)
    assert report.max_abs_diff < 1e-5


@pytest.fixture(scope="module")
def two_process_run():
    """One launch of ``workers/layout_worker.py`` (2 processes x 4 devices), both its parts."""
    from workers.launching import launch

    return launch(2, 4, "layout_worker.py", timeout=300)


def test_two_processes_train_split_state_like_one(mesh8: jax.sharding.Mesh, two_process_run) -> None:
    run = two_process_run
    assert run.returncode == 0, run.output
    assert run.stdout.count("DEVICES 2 x 4") == 2, run.output  # one 8-device system from 2 processes
    batches = regression_batches(6, rows=32)
    sharding = create_data_parallel_sharding(mesh8)
    for mode in substrax.MODES:
        for layout in ("fsdp", "zero1"):
            model, optimizer = _placed(mesh8, layout)
            step = substrax.make_train_step(mse, mode, mesh=mesh8)
            want = [float(step(model, optimizer, place_batch_on_shards(b, sharding))) for b in batches]
            for process in ("p0", "p1"):
                got = re.search(rf"^\[{process}\] LOSSES {mode} {layout} (.*)$", run.stdout, flags=re.M)
                assert got is not None, run.output
                np.testing.assert_allclose([float(x) for x in got.group(1).split(",")], want, rtol=1e-6)
                assert re.search(rf"^\[{process}\] SPLIT {mode} {layout} True$", run.stdout, flags=re.M), (
                    run.output
                )


def test_shard_state_places_random_streams_of_a_model_built_outside_any_mesh(two_process_run) -> None:
    # nnx.Dropout with nnx.Rngs: the random key must be placed on every process's devices.
    run = two_process_run
    assert run.returncode == 0, run.output
    for name in ("rngs_placed", "rngs_implicit"):
        got = dict(re.findall(rf"^(\[p\d\]) RESULT {name} (.*)$", run.stdout, flags=re.M))
        assert got == {"[p0]": "ok", "[p1]": "ok"}, run.output
    for layout in ("fsdp", "zero1"):  # explicit mode: per-device masks, the same on both processes
        got = dict(re.findall(rf"^(\[p\d\]) RNGS explicit {layout} (.*)$", run.stdout, flags=re.M))
        assert got.keys() == {"[p0]", "[p1]"} and got["[p0]"] == got["[p1]"], run.output
        assert np.all(np.isfinite([float(x) for x in got["[p0]"].split(",")])), run.output
