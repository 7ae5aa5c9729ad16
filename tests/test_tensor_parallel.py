"""A second mesh axis: a tensor-parallel model (``substrax.nn``) trained on (data, model) meshes.

Every run is held against one device: the same model trained with the same batches by a
plain ``nnx.jit`` step, no mesh. The optimizer clips by the global norm and then takes
SGD steps with momentum, so the update reads whole tensors across both axes, and the parameters are
held strictly, to float32 round-off (the modes and mesh shapes sum in different orders).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import params_of
from flax import nnx

import substrax
from substrax import checkpoint
from substrax._metrics.collectives import gather_invariant
from substrax.mesh import create_device_mesh

SHAPES = [(8, 1), (4, 2), (2, 4), (1, 8)]
STEPS, ROWS, SEQ, D = 3, 16, 4, 16
RTOL, ATOL = 2e-5, 2e-6  # float32 round-off of a 2-block model over differently ordered sums


class Block(nnx.Module):
    """Attention with heads split over ``model``, then a column -> gelu -> row MLP."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn = substrax.nn.ParallelSelfAttention(8, D, causal=True, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up = substrax.nn.ColumnParallelLinear(D, 4 * D, rngs=rngs)
        self.down = substrax.nn.RowParallelLinear(4 * D, D, rngs=rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(x)
        x = x + self.down(jax.nn.gelu(self.up(self.norm(x))))
        return self.head(x)[..., 0]


def loss_fn(model: Block, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batches() -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(ROWS, SEQ, D)).astype(np.float32),
            "y": rng.normal(size=(ROWS, SEQ)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


BATCHES = _batches()


def _tx() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9))


def _build() -> tuple[Block, nnx.Optimizer]:
    model = Block(nnx.Rngs(0))
    return model, nnx.Optimizer(model, _tx(), wrt=nnx.Param)


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    model, optimizer = _build()

    @nnx.jit
    def step(model: Block, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    with jax.default_device(jax.devices()[0]):
        losses = [float(step(model, optimizer, b)) for b in BATCHES]
    return losses, params_of(model)


def _train(
    mode: str, shape: tuple[int, int], layout: str, **options: object
) -> tuple[list[float], dict, Block, nnx.Optimizer, jax.sharding.Mesh]:
    mesh = create_device_mesh({"data": shape[0], "model": shape[1]})
    model, optimizer = _build()
    substrax.shard_state(model, optimizer, mesh=mesh, layout=layout, min_size=64)
    step = substrax.make_train_step(loss_fn, mode, mesh=mesh, **options)
    losses = [float(step(model, optimizer, b)) for b in BATCHES]
    return losses, params_of(model), model, optimizer, mesh


def _assert_like(got: tuple[list[float], dict], want: tuple[list[float], dict]) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    for name, value in want[1].items():
        np.testing.assert_allclose(got[1][name], value, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"data{s[0]}xmodel{s[1]}")
@pytest.mark.parametrize("mode", substrax.MODES)
def test_fsdp_on_every_mesh_shape_trains_like_one_device(
    mode: str, shape: tuple[int, int], reference: tuple
) -> None:
    losses, params, model, _, _ = _train(mode, shape, "fsdp")
    _assert_like((losses, params), reference)
    kernel = model.up.kernel.get_value()
    assert kernel.dtype == jnp.float32
    want = jax.sharding.NamedSharding(kernel.sharding.mesh, jax.sharding.PartitionSpec("data", "model"))
    assert kernel.sharding.is_equivalent_to(want, 2), kernel.sharding  # split over both axes


@pytest.mark.parametrize("mode", substrax.MODES)
def test_the_same_model_on_a_mesh_without_model_axis_trains_like_one_device(
    mode: str, reference: tuple
) -> None:
    """One model definition: on a data-only mesh shard_state places the layers' splits whole."""
    mesh = create_device_mesh({"data": 8})
    model, optimizer = _build()
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    step = substrax.make_train_step(loss_fn, mode, mesh=mesh)
    losses = [float(step(model, optimizer, b)) for b in BATCHES]
    _assert_like((losses, params_of(model)), reference)


@pytest.mark.parametrize("layout", ["replicated", "zero1"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_other_layouts_on_a_2d_mesh_train_like_one_device(mode: str, layout: str, reference: tuple) -> None:
    losses, params, _, optimizer, _ = _train(mode, (4, 2), layout)
    _assert_like((losses, params), reference)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_microbatches_on_a_2d_mesh_train_like_one_device(mode: str, reference: tuple) -> None:
    losses, params, *_ = _train(mode, (2, 4), "fsdp", microbatches=2)
    _assert_like((losses, params), reference)


def test_layout_table_names_both_axes() -> None:
    mesh = create_device_mesh({"data": 4, "model": 2})
    model, optimizer = _build()
    layout = substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    rows = {r.path: r for r in layout.rows}
    up = rows["model['up']['kernel']"]
    assert (up.split_dim, up.other_splits) == (0, ((1, "model", 2),))
    assert up.bytes_per_device == up.nbytes // 8
    down = rows["model['down']['kernel']"]
    assert (down.split_dim, down.other_splits) == (1, ((0, "model", 2),))
    assert "dim 0 over 'data'; dim 1 over 'model'" in str(layout)
    mu = next(r for r in layout.rows if r.owner == "optimizer" and r.path.endswith("['up']['kernel']"))
    assert (mu.split_dim, mu.other_splits) == (0, ((1, "model", 2),))  # the momentum follows its parameter


# What the layers write over 'model', each rows x sequence x features per device: a forward
# psum per row layer (attention's output, the MLP's down projection) and the backward psum
# of the MLP column layer's input (attention's input is the batch: no gradient, no psum).
LAYER_COLLECTIVES = [
    ("model['attn']['out']", "forward", "all-reduce"),
    ("model['down']", "forward", "all-reduce"),
    ("model['up']", "backward", "all-reduce"),
]


@pytest.mark.parametrize("mode", substrax.MODES)
def test_census_of_a_2d_step_matches_and_names_the_model_axis(mode: str) -> None:
    mesh = create_device_mesh({"data": 4, "model": 2})
    model, optimizer = _build()
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    step = substrax.make_train_step(loss_fn, mode, mesh=mesh)
    check = step.check_communication(model, optimizer, BATCHES[0])
    if mode == "explicit":  # implicit: XLA may choose other collectives than the rule's
        assert check.matches, str(check)
        said = [(item, parts) for item, parts in check.matched if item.category == "model"]
        assert sorted((i.what.split(" ")[0], i.phase, i.kind) for i, _ in said) == LAYER_COLLECTIVES, str(
            check
        )
        for item, parts in said:  # each expected from its layer, each matched to one compiled over model
            assert item.axes == ("model",) and item.buffer == f"f32[{ROWS // 4},{SEQ},{D}]", item
            assert [(p.row.axes, p.phase) for p in parts] == [(("model",), item.phase)], str(check)
        assert (
            sorted(p.buffer.shape for p in check.model if p.row.axes == ("model",))
            == [(ROWS // 4, SEQ, D)] * 3
        )
        assert "model['down'] forward: the partial products, summed" in str(check)
    assert {row.axes for row in check.report.rows} >= {("data",), ("model",)}, str(check.report)


def test_census_of_microbatches_expects_the_layers_collectives_in_the_loop() -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    model, optimizer = _build()
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    step = substrax.make_train_step(loss_fn, "explicit", mesh=mesh, microbatches=2)
    check = step.check_communication(model, optimizer, BATCHES[0])
    assert check.matches, str(check)
    said = [(item, parts) for item, parts in check.matched if item.category == "model"]
    assert sorted((i.what.split(" ")[0], i.phase, i.kind) for i, _ in said) == LAYER_COLLECTIVES
    for item, parts in said:  # per microbatch (ROWS / data / 2 rows), twice per step, in the loop
        assert item.in_loop and item.bytes == 2 * (ROWS // 4) * SEQ * D * 4, item
        assert [(p.row.in_loop, p.row.trip_count) for p in parts] == [(True, 2)], str(check)


@pytest.mark.parametrize("fault", ["undeclared", "declared twice"])
def test_census_catches_a_layer_that_does_not_say_what_it_writes(fault: str, monkeypatch) -> None:
    """The census's expectation over 'model' is what the layers declare; a layer whose
    declarations and program disagree is a difference that names the layer or the buffer."""
    from substrax.nn import _linear

    declare = _linear.declare_forward
    if fault == "undeclared":  # the row layers psum without declaring it
        monkeypatch.setattr(_linear, "declare_forward", lambda *args, **kwargs: None)
    else:
        monkeypatch.setattr(
            _linear, "declare_forward", lambda *a, **k: (declare(*a, **k), declare(*a, **k))[0]
        )
    mesh = create_device_mesh({"data": 4, "model": 2})
    model, optimizer = _build()
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    step = substrax.make_train_step(loss_fn, "explicit", mesh=mesh)
    check = step.check_communication(model, optimizer, BATCHES[0])
    assert not check.matches, str(check)
    text = " ".join(check.differences)
    if fault == "undeclared":
        assert "nothing expected accounts for" in text and "substrax.tensor_parallel" in text, text
        assert len([p for p in check.unexpected if p.row.axes == ("model",)]) == 2, text
    else:
        assert "not compiled: model['" in text and "forward: the partial products, summed" in text, text


def test_compare_gradients_on_a_2d_mesh() -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    model, _ = _build()
    report = substrax.explicit.compare_gradients(model, loss_fn, BATCHES[0], mesh)
    assert report.ok, str(report)


def test_a_checkpoint_saved_on_one_mesh_shape_resumes_on_another(tmp_path, reference: tuple) -> None:
    mesh = create_device_mesh({"data": 4, "model": 2})
    model, optimizer = _build()
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    step = substrax.make_train_step(loss_fn, "explicit", mesh=mesh)
    losses = [float(step(model, optimizer, b)) for b in BATCHES[:1]]
    checkpoint.save(tmp_path, 1, model, optimizer)

    mesh = create_device_mesh({"data": 2, "model": 4})
    model, optimizer = _build()
    substrax.shard_state(model, optimizer, mesh=mesh, layout="zero1", min_size=64)
    assert checkpoint.restore(tmp_path, model, optimizer) == 1
    step = substrax.make_train_step(loss_fn, "implicit", mesh=mesh)
    losses += [float(step(model, optimizer, b)) for b in BATCHES[1:]]
    _assert_like((losses, params_of(model)), reference)


class Unreduced(nnx.Module):
    """A column layer with no row layer after it: its output stays split over ``model``."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = substrax.nn.ColumnParallelLinear(D, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.up(x)


def test_a_loss_left_varying_over_the_model_axis_is_refused() -> None:
    mesh = create_device_mesh({"data": 4, "model": 2})
    model = Unreduced(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    step = substrax.make_train_step(lambda m, b: jnp.mean(m(b["x"])), "explicit", mesh=mesh)
    with pytest.raises(ValueError, match=r"the loss still varies over mesh axis 'model'.*RowParallelLinear"):
        step(model, optimizer, BATCHES[0])


class OwnGather(nnx.Module):
    """Attention, then a column layer whose blocks a collective of the user's own gathers."""

    def __init__(self, rngs: nnx.Rngs, declare: bool) -> None:
        self.attn = substrax.nn.ParallelSelfAttention(8, D, rngs=rngs)
        self.up = substrax.nn.ColumnParallelLinear(D, 8, rngs=rngs)
        self.declare = declare

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.up(x + self.attn(x))
        if "model" in (substrax.explicit.varying_axes(y) or ()):  # the explicit step: this device's block
            y = gather_invariant(y, "model", axis=y.ndim - 1, tiled=True)
            if self.declare:
                substrax.nn.declare_forward(self, "all-gather", "model", y, "the column blocks, gathered")
        return jnp.mean(y, axis=-1)


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "undeclared"])
def test_a_layer_of_your_own_declares_its_collectives(declare: bool) -> None:
    """Over 'model' the census expects what layers declare; a user's own collective there is
    expected once declared with ``substrax.nn.declare_forward``, and named as undeclared if not."""
    mesh = create_device_mesh({"data": 4, "model": 2})
    model = OwnGather(nnx.Rngs(0), declare)
    want = float(loss_fn(model, BATCHES[0]))  # one device, before any step
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    step = substrax.make_train_step(loss_fn, "explicit", mesh=mesh)
    np.testing.assert_allclose(float(step(model, optimizer, BATCHES[0])), want, rtol=RTOL)
    check = step.check_communication(model, optimizer, BATCHES[0])
    gathered = f"f32[{ROWS // 4},{SEQ},8]"
    if declare:
        assert check.matches, str(check)
        said = {(i.what, i.kind, i.buffer) for i, _ in check.matched if i.category == "model"}
        assert ("model (the root) forward: the column blocks, gathered", "all-gather", gathered) in said, said
    else:
        assert not check.matches, str(check)
        (difference,) = check.differences
        assert gathered in difference and "substrax.nn.declare_forward" in difference, difference


def test_a_model_axis_of_one_device_costs_no_collective() -> None:
    """On (8, 1) the explicit step runs the layers as plain ones: nothing over 1-device groups."""
    mesh = create_device_mesh({"data": 8, "model": 1})
    model, optimizer = _build()
    substrax.shard_state(model, optimizer, mesh=mesh, layout="fsdp", min_size=64)
    step = substrax.make_train_step(loss_fn, "explicit", mesh=mesh)
    check = step.check_communication(model, optimizer, BATCHES[0])
    assert check.matches, str(check)
    assert [i for i, _ in check.matched if i.category == "model"] == []  # no layer wrote one
    assert {row.axes for row in check.report.rows} == {("data",)}, str(check.report)
