"""Hybrid sharding (#28): FSDP over ``data`` within a replica, replicated over ``replica``.

On ``(replica=2, data=4)``: both modes split the batch's rows over both axes and train to
the one-device result (SGD with momentum, whose state ZeRO-1 splits: strictly) in every
layout, with and without microbatches and units; the explicit step's census expects the
gathers and reduce-scatters over ``data`` and one all-reduce of the gradient's slices over
``replica``, outside any loop; a mesh without the replica axis is refused by name; a
checkpoint saved under HSDP restores into FSDP on one axis and into replicated state.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import MLP, assert_trains_to, mse, params_of, regression_batches
from flax import nnx
from jax.sharding import PartitionSpec
from models import Residual, make_placed, one_device_params

import substrax
from substrax.mesh import create_device_mesh

P = PartitionSpec
HYBRID = create_device_mesh({"replica": 2, "data": 4})
LR = 0.1


def _one_device(batches: list[dict], width: int = 16) -> dict[str, np.ndarray]:
    return one_device_params(lambda: MLP(width=width), optax.sgd(LR, momentum=0.9), batches)


def _placed(mesh: jax.sharding.Mesh, layout: str, units=None, width: int = 16) -> tuple[MLP, nnx.Optimizer]:
    tx = optax.sgd(LR, momentum=0.9)
    return make_placed(lambda: MLP(width=width), tx, mesh, layout=layout, min_size=1, units=units)


@pytest.mark.parametrize(
    ("layout", "units"),
    [("hsdp", None), ("hsdp", nnx.Linear), ("zero1", None), ("replicated", None)],
    ids=["hsdp", "hsdp+units", "zero1", "replicated"],
)
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_hybrid_sharding_trains_like_one_device(mode: str, microbatches: int, layout: str, units) -> None:
    batches = regression_batches(3, rows=32)
    want = _one_device(batches)
    model, optimizer = _placed(HYBRID, layout, units)
    if layout == "hsdp":  # split within a replica, replicated across: no spec names the replica axis
        assert model.hidden.kernel.get_value().sharding.spec == P(None, "data")
        assert substrax.layout_of(model, optimizer).kind == "hsdp"
    step = substrax.make_train_step(mse, mode, mesh=HYBRID, microbatches=microbatches)
    assert_trains_to(step, model, optimizer, batches, want)
    if mode == "implicit":  # what XLA chose: the census attributes it, values are the test
        return
    comparison = step.check_communication(model, optimizer, batches[0])
    assert comparison.matches, str(comparison)
    across = [(i, parts) for i, parts in comparison.matched if i.what.startswith("across 'replica'")]
    if layout == "replicated":
        assert not across  # every gradient whole: one all-reduce over both axes
        return
    split = [v for v in jax.tree.leaves(nnx.state(model, nnx.Param)) if v.size % 4 == 0 and v.size >= 4]
    assert sorted(i.bytes for i, _ in across) == sorted(v.size for v in split)  # a quarter of each, float32
    (row,) = {p.row for _, parts in across for p in parts}  # one collective across replicas, once per step
    assert not row.in_loop and tuple(row.axes) == ("replica",)


def test_hsdp_refuses_a_mesh_without_the_replica_axis() -> None:
    mesh = create_device_mesh({"data": 8})
    with jax.set_mesh(mesh):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.sgd(LR, momentum=0.9), wrt=nnx.Param)
    with pytest.raises(
        ValueError, match=r"layout='hsdp' .* over 'replica', which the mesh \{'data': 8\} lacks"
    ):
        substrax.shard_state(model, optimizer, mesh=mesh, layout="hsdp")
    named = create_device_mesh({"dcn": 2, "data": 4})  # a replica axis of another name
    with jax.set_mesh(named):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.sgd(LR, momentum=0.9), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=named, layout="hsdp", replica_axis="dcn", min_size=1)
    assert model.hidden.kernel.get_value().sharding.spec == P(None, "data")


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_step_built_for_another_replica_axis_is_refused_naming_both(mode: str) -> None:
    # regression (#51): the step split the rows over 'data' only (16 a device, not 8), each
    # 'dcn' replica computing the same rows, without a word
    named = create_device_mesh({"dcn": 2, "data": 4})
    batches = regression_batches(2, rows=32)
    with jax.set_mesh(named):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.sgd(LR, momentum=0.9), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=named, layout="hsdp", replica_axis="dcn", min_size=1)
    assert substrax.layout_of(model, optimizer).kind == "hsdp"
    default = substrax.make_train_step(mse, mode, mesh=named)  # replica_axis='replica'
    with pytest.raises(
        ValueError,
        match=r"placed with shard_state\(\.\.\., layout='hsdp', replica_axis='dcn'\), but the step was built "
        r"with replica_axis='replica': it would split the batch's rows over 'data' only, .* "
        r"make_train_step\(\.\.\., replica_axis='dcn'\)",
    ):
        default(model, optimizer, batches[0])
    # the state placed over the default axis, a step built for another: refused the other way round
    other, other_opt = _placed(HYBRID, "hsdp")
    elsewhere = substrax.make_train_step(mse, mode, mesh=HYBRID, replica_axis="dcn")
    with pytest.raises(ValueError, match=r"'replica'\), but the step was built with replica_axis='dcn'"):
        elsewhere.bind(other, other_opt)(batches[0])
    # built with the state's axis: rows over ('dcn', 'data'), the one-device result
    rows = []
    step = substrax.make_train_step(lambda m, b: rows.append(len(b["x"])) or mse(m, b), mode, mesh=named,
                                    replica_axis="dcn")  # fmt: skip
    assert_trains_to(step, model, optimizer, batches, _one_device(batches))
    assert rows[0] == (4 if mode == "explicit" else 32)  # a device's rows: 32 over 2 x 4
    # placed again as FSDP: nothing recorded, no replica axis asked of the step
    substrax.shard_state(model, optimizer, mesh=named, layout="fsdp", min_size=1)
    default(model, optimizer, batches[0])


def test_a_checkpoint_saved_under_hsdp_restores_into_fsdp_and_replicated(tmp_path: Path) -> None:
    model, optimizer = _placed(HYBRID, "hsdp")
    step = substrax.make_train_step(mse, "explicit", mesh=HYBRID)
    step(model, optimizer, regression_batches(1, rows=32)[0])
    substrax.checkpoint.save(tmp_path / "ckpt", 1, model, optimizer)
    for mesh, layout in (
        (create_device_mesh({"data": 8}), "fsdp"),
        (create_device_mesh({"data": 2}), "replicated"),
    ):
        other, other_opt = _placed(mesh, layout)
        substrax.checkpoint.restore(tmp_path / "ckpt", other, other_opt)
        for key, value in params_of(model).items():
            np.testing.assert_array_equal(params_of(other)[key], value)


@pytest.mark.parametrize("units", [False, True], ids=["plain", "units"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_hybrid_sharding_beside_a_model_axis(mode: str, units: bool) -> None:
    """(replica, data, model): substrax.nn layers in a scanned stack, split over model, hsdp over the rest."""
    from test_scanned import Scanned, _batches, one_device_reference

    want = one_device_reference()
    mesh = create_device_mesh({"replica": 2, "data": 2, "model": 2})
    units = Residual if units else None
    model, optimizer = make_placed(
        lambda: Scanned(3, 16), optax.sgd(0.1), mesh, layout="hsdp", min_size=1, units=units
    )
    assert model.layers.up.kernel.get_value().sharding.spec == P(None, "data", "model")
    step = substrax.make_train_step(mse, mode, mesh=mesh)
    assert_trains_to(step, model, optimizer, _batches(), want)
    if mode == "explicit":
        comparison = step.check_communication(model, optimizer, _batches(1)[0])
        assert comparison.matches, str(comparison)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_regression_a_batch_placed_over_data_only_is_not_counted_once_per_replica(mode: str) -> None:
    """Found by the fuzzer: rows placed over ``data`` alone on a hybrid mesh are the same on
    both replicas; the explicit step reduced its metrics over both axes (a gather of twice
    the rows, a sum twice too large). The step reduces over the axes the rows are split on."""
    from substrax.spmd import place_batch_on_shards

    batch = regression_batches(1, rows=32)[0]

    def loss_fn(model: MLP, b: dict) -> tuple:
        err = (model(b["x"]) - b["y"])[:, 0] ** 2
        return err.mean(), {"sum": err.sum(), "rows": err}

    with jax.default_device(jax.devices()[0]):
        want_loss, want = loss_fn(MLP(), batch)
    model, optimizer = _placed(HYBRID, "hsdp")
    step = substrax.make_train_step(
        loss_fn, mode, mesh=HYBRID, has_aux=True, reduce={"sum": "sum", "rows": "gather"}
    )
    placed = place_batch_on_shards(batch, jax.sharding.NamedSharding(HYBRID, P("data")))
    loss, metrics = step(model, optimizer, placed)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["sum"]), float(want["sum"]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(metrics["rows"]), np.asarray(want["rows"]), rtol=1e-5, atol=1e-7)


def test_rows_split_over_replicas_for_some_leaves_only_are_refused_by_name() -> None:
    batch = regression_batches(1, rows=32)[0]
    model, optimizer = _placed(HYBRID, "hsdp")
    step = substrax.make_train_step(
        mse, "explicit", mesh=HYBRID, batch_spec={"x": P(("replica", "data")), "y": P("data")}
    )
    with pytest.raises(ValueError, match=r"Some of the batch's leaves split their rows over \['replica'\]"):
        step(model, optimizer, batch)


def test_regression_compare_gradients_on_a_hybrid_mesh() -> None:
    """Found by the fuzzer (``Config(mode='implicit', layout='hsdp', ..., compare_gradients=True,
    seed=922)``): ``compare_gradients`` raised for a batch split over ``(replica, data)``, its
    loss typed varying over ``replica``. It now reduces over both axes, as the steps do."""
    from substrax.explicit import compare_gradients

    model, _ = _placed(HYBRID, "hsdp")
    report = compare_gradients(
        model,
        mse,
        regression_batches(1, rows=32)[0],
        HYBRID,
        batch_spec={"x": P(("replica", "data")), "y": P(("replica", "data"))},
    )
    assert report.ok, str(report)


@pytest.mark.parametrize("units", [None, nnx.Linear], ids=["plain", "units"])
def test_regression_replicas_of_one_device_each(units) -> None:
    """Found by the fuzzer (``Config(mode='explicit', layout='hsdp', devices=2, microbatches=4,
    units='stack', scan='remat', seed=56)``): on ``(replica=2, data=1)`` the explicit step
    gathered units over the one-device data axis inside the loop, and the census, reading a
    data axis of size 1, expected nothing. Nothing is split over one device: no gather, no
    unit; the gradient is reduced across the replicas, which the census expects."""
    mesh = create_device_mesh({"replica": 2, "data": 1}, devices=jax.devices()[:2])
    batches = regression_batches(2, rows=32)
    want = _one_device(batches)
    model, optimizer = _placed(mesh, "hsdp", units)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh, microbatches=2)
    assert_trains_to(step, model, optimizer, batches, want)
    comparison = step.check_communication(model, optimizer, batches[0])
    assert comparison.matches, str(comparison)
    assert comparison.report.count("all-gather") == 0  # nothing gathered over one device
