"""Random streams in a scanned stack (#60 items 3 and 5), both modes, pipelined or not.

``nnx.split_rngs`` gives each stacked layer its own key (a key array ``[L]``, a count ``[L]``). The
probe model: an embedding, 4 layers stacked by ``nnx.vmap`` and applied by ``scan_layers`` (a
linear layer whose output is dropped out with one mask per row, and a shift register in the
carry's first columns that records each layer's mask: after the stack, column ``i`` holds layer
``i``'s), a head. The register is a metric gathered over the batch, so the masks each layer and
each device drew are compared with ``jax.random`` by hand, as the modes guide states them. Dropout
off, the step trains like one device. Pipelined, a step draws the masks of the same step without
stages and with the same microbatches, and trains to its parameters (SGD, float32 round-off).
A stack under the user's own ``jax.checkpoint`` or ``nnx.remat`` in a pipelined loss is refused,
naming ``scan_layers``'s ``remat=True``, which trains (in the pipelined cases below).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import PIPELINES
from flax import nnx
from models import one_device_params, params_of, sine_batches, stack

import substrax
import substrax.nn
from substrax.mesh import create_device_mesh

DEPTH, WIDTH, ROWS, RATE = 4, 8, 64, 0.5
STRICT_RTOL, STRICT_ATOL = 1e-5, 1e-6
SGD = 0.05


class Shifting(nnx.Module):
    """One layer of the carry ``[register (DEPTH) | features (WIDTH)]``: the features plus the
    dropped-out ``tanh(Linear(features))``, one mask per row; that mask pushed into the register."""

    def __init__(self, rate: float, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(rate, broadcast_dims=(1,), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        register, features = x[:, :DEPTH], x[:, DEPTH:]
        ones = jnp.ones_like(features[:, :1])
        dropped = self.drop(jnp.concatenate([ones, jnp.tanh(self.linear(features))], axis=1))
        return jnp.concatenate([register[:, 1:], dropped[:, :1], features + dropped[:, 1:]], axis=1)


class Probe(nnx.Module):
    """``Linear(4, WIDTH)``, ``DEPTH`` ``Shifting`` layers (``scan_layers``, ``remat`` as given),
    ``Linear(WIDTH, 1)``; returns the prediction and the register (each layer's mask per row)."""

    def __init__(self, rate: float = RATE, remat: bool = False) -> None:
        rngs = nnx.Rngs(0, dropout=1)
        self.embed = nnx.Linear(4, WIDTH, rngs=rngs)
        self.layers = stack(lambda r: Shifting(rate, r), DEPTH, rngs)
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)
        self.remat = remat

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = self.embed(x)
        h = jnp.concatenate([jnp.zeros((h.shape[0], DEPTH), h.dtype), h], axis=1)
        out = substrax.nn.scan_layers(self.layers, h, remat=self.remat)
        return self.head(out[:, DEPTH:])[:, 0], out[:, :DEPTH]


def with_masks(model: Probe, batch: dict) -> tuple[jax.Array, dict]:
    pred, masks = model(batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2), {"masks": masks}


def squared_error(model: Probe, batch: dict) -> jax.Array:
    return with_masks(model, batch)[0]


def _batches(steps: int = 2) -> list[dict]:
    return sine_batches(steps, ROWS)


def _placed(
    shape: dict, layout: str, stages: bool = False, chunks: int = 1, **probe: bool
) -> tuple[jax.sharding.Mesh, Probe, nnx.Optimizer]:
    mesh = create_device_mesh(shape)
    with jax.set_mesh(mesh):
        model = Probe(**probe)
        opt = nnx.Optimizer(model, optax.sgd(SGD), wrt=nnx.Param)
    substrax.shard_state(
        model,
        opt,
        mesh=mesh,
        layout=layout,
        min_size=1,
        stages=Shifting if stages else None,
        virtual_stages=chunks,
    )
    return mesh, model, opt


def _streams(model: Probe) -> tuple[np.ndarray, np.ndarray]:
    """The stack's dropout keys (their data, ``[DEPTH, 2]``: the step donates the arrays) and counts."""
    rngs = model.layers.drop.rngs
    return np.asarray(jax.random.key_data(rngs.key.get_value())), np.asarray(rngs.count.get_value())


def _documented_masks(keys: np.ndarray, counts: np.ndarray, mode: str, devices: int) -> np.ndarray:
    """``[ROWS, DEPTH]``: layer ``l``'s mask per row, as the modes guide says each mode draws it (an
    ``nnx.Dropout`` mask: ``bernoulli(fold_in(key, count), 1 - rate)``, kept rows scaled by
    ``1 / (1 - rate)``). Implicit: one draw for the global batch from the layer's key; explicit: each
    device draws for its rows from the layer's key with the device's index folded in."""
    columns = []
    for layer in range(DEPTH):
        key, count = jax.random.wrap_key_data(keys[layer]), int(counts[layer])
        if mode == "implicit":
            keep = jax.random.bernoulli(jax.random.fold_in(key, count), 1 - RATE, (ROWS, 1))
        else:
            per_device = [
                jax.random.bernoulli(
                    jax.random.fold_in(jax.random.fold_in(key, d), count), 1 - RATE, (ROWS // devices, 1)
                )
                for d in range(devices)
            ]
            keep = jnp.concatenate(per_device)
        columns.append(np.asarray(keep, np.float32)[:, 0] / (1 - RATE))
    return np.stack(columns, axis=1)


@pytest.mark.parametrize("layout", ["replicated", "zero1", "fsdp", "hsdp"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_each_layer_and_device_draws_the_documented_mask(mode: str, layout: str) -> None:
    """On 8 devices (HSDP: ``(replica=2, data=4)``, the rows over both, device ``4 r + d``)."""
    mesh, model, opt = _placed({"replica": 2, "data": 4} if layout == "hsdp" else {"data": 8}, layout)
    keys, counts, before = *_streams(model), params_of(model)
    step = substrax.make_train_step(with_masks, mode, mesh=mesh, has_aux=True, reduce={"masks": "gather"})
    loss, metrics = step(model, opt, _batches(1)[0])
    got = np.asarray(metrics["masks"])
    assert np.isfinite(float(loss))
    assert all(np.any(params_of(model)[k] != v) for k, v in before.items())  # every parameter moved
    np.testing.assert_array_equal(got, _documented_masks(keys, counts, mode, 8))
    assert len({got[:, i].tobytes() for i in range(DEPTH)}) == DEPTH  # each layer its own mask
    blocks = got.reshape(8, ROWS // 8, DEPTH)  # the rows of each data device
    assert len({b.tobytes() for b in blocks}) == 8  # no two devices' rows masked alike
    after_keys, after_counts = _streams(model)
    np.testing.assert_array_equal(after_counts, counts + 1)  # one draw a layer; the keys as they were
    np.testing.assert_array_equal(after_keys, keys)


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_stack_with_its_dropout_off_trains_like_one_device(mode: str, layout: str) -> None:
    """Rate 0: the streams are in the state (and the explicit step folds each device's index into
    each layer's key), but nothing is drawn: the parameters of one device."""
    want = one_device_params(lambda: Probe(rate=0.0), optax.sgd(SGD), _batches(), squared_error)
    mesh, model, opt = _placed({"data": 8}, layout, rate=0.0)
    step = substrax.make_train_step(squared_error, mode, mesh=mesh)
    for b in _batches():
        step(model, opt, b)
    got = params_of(model)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=STRICT_RTOL, atol=STRICT_ATOL, err_msg=key)


def _trained(mesh: jax.sharding.Mesh, model: Probe, opt: nnx.Optimizer, mode: str, **options: str) -> tuple:
    """Two steps of 4 microbatches: ``(each step's masks, the parameters, the streams' counts)``."""
    step = substrax.make_train_step(
        with_masks, mode, mesh=mesh, microbatches=4, has_aux=True, reduce={"masks": "gather"}, **options
    )
    masks = [np.asarray(step(model, opt, b)[1]["masks"]) for b in _batches()]
    return masks, params_of(model), _streams(model)[1]


@pytest.fixture(scope="module")
def unstaged() -> dict[str, tuple]:
    """Each mode's run on (data=2) without stages: the pipelined runs' reference."""
    return {mode: _trained(*_placed({"data": 2}, "replicated"), mode) for mode in substrax.MODES}


@pytest.mark.parametrize(
    ("mode", "schedule", "layout", "remat"),
    [
        ("explicit", "1f1b", "fsdp", True),
        ("explicit", "gpipe", "replicated", False),
        ("implicit", "gpipe", "fsdp", True),
        ("implicit", "1f1b", "replicated", False),
        ("explicit", "zb-h1", "fsdp", True),
        ("explicit", "zb-h1", "replicated", False),
        ("explicit", "interleaved-1f1b", "fsdp", True),
        ("explicit", "interleaved-1f1b", "replicated", False),
    ],
)
def test_a_pipelined_stack_draws_the_masks_of_the_step_without_stages(
    mode: str, schedule: str, layout: str, remat: bool, unstaged: dict
) -> None:
    """(stage=4, data=2), 4 microbatches: each stage carries its layers' counts from microbatch to
    microbatch (1F1B's and ZB-H1's backward slot redraws from the stashed ones), as the step without stages
    carries the model's (interleaved: two chunks a stage, the counts moved with them and back).
    ``remat``: ``scan_layers(..., remat=True)``, recomputed in the backward pass."""
    chunks = 2 if schedule == "interleaved-1f1b" else 1  # (stage=2, data=2): 2 x 2 chunks of one layer
    shape = {"data": 2, "stage": 4 // chunks}
    mesh, model, opt = _placed(shape, layout, stages=True, chunks=chunks, remat=remat)
    masks, got, counts = _trained(mesh, model, opt, mode, schedule=schedule)
    want_masks, want, want_counts = unstaged[mode]
    for step, (m, w) in enumerate(zip(masks, want_masks)):
        np.testing.assert_array_equal(m, w, err_msg=f"step {step + 1}")
    np.testing.assert_array_equal(counts, want_counts)
    assert list(want_counts) == [8] * DEPTH  # 2 steps of 4 microbatches, one draw each
    assert model.layers.drop.rngs.count.get_value().sharding.spec[0] == "stage"  # each stage's counts
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=STRICT_RTOL, atol=STRICT_ATOL, err_msg=key)


@pytest.mark.parametrize("wrap", ["jax.checkpoint", "nnx.remat"])
@pytest.mark.parametrize(("mode", "schedule"), PIPELINES)
def test_the_stack_under_the_users_own_remat_in_a_pipeline_is_refused(
    mode: str, schedule: str, wrap: str
) -> None:
    """A pipeline cuts the loss at ``scan_layers``; a transform around it in ``loss_fn`` cannot span the
    cut (its input would leak out of the transform's trace): refused, naming ``remat=True``."""

    def remat_loss(model: Probe, batch: dict) -> jax.Array:
        h = model.embed(batch["x"])
        h = jnp.concatenate([jnp.zeros((h.shape[0], DEPTH), h.dtype), h], axis=1)
        if wrap == "jax.checkpoint":
            out = jax.checkpoint(lambda h: substrax.nn.scan_layers(model.layers, h))(h)
        else:
            out = nnx.remat(lambda layers, h: substrax.nn.scan_layers(layers, h))(model.layers, h)
        return jnp.mean((model.head(out[:, DEPTH:])[:, 0] - batch["y"]) ** 2)

    chunks = 2 if schedule == "interleaved-1f1b" else 1
    mesh, model, opt = _placed({"data": 2, "stage": 4 // chunks}, "replicated", stages=True, chunks=chunks)
    step = substrax.make_train_step(remat_loss, mode, mesh=mesh, microbatches=4, schedule=schedule)
    with pytest.raises(
        ValueError,
        match=r"loss_fn ran the staged stack model\['layers'\] through scan_layers inside a transform of its "
        r"own \(jax.checkpoint, nnx.remat.*substrax.nn.scan_layers\(stack, x, remat=True\)",
    ):
        step(model, opt, _batches(1)[0])


def test_the_plan_takes_a_model_with_random_streams() -> None:
    """A key among the state (the stack's dropout keys): ``substrax.plan`` estimates the step (it raised
    a TypeError on the key's dtype), one device's state, keys and batch the compiled step's arguments."""
    mesh = create_device_mesh({"data": 8})

    def build() -> tuple[Probe, nnx.Optimizer]:
        model = Probe()
        return model, nnx.Optimizer(model, optax.sgd(SGD), wrt=nnx.Param)

    batch = _batches(1)[0]
    (row,) = substrax.plan(squared_error, *build(), batch, mesh=mesh, layouts=("replicated",)).rows
    model, opt = build()
    with jax.set_mesh(mesh):
        row.shard_state(model, opt)
    step = row.make_train_step(squared_error)
    memory = step.lower(model, opt, batch, donate=True).compile().memory_analysis()
    keys = DEPTH * jax.random.key(0).dtype.itemsize  # the layout's bytes leave typed keys out
    assert row.state_bytes + row.batch_bytes + keys == memory.argument_size_in_bytes
    assert row.peak_bytes > row.state_bytes
