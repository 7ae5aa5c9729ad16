"""substrax.nn on a mesh without the ``model`` axis: the layers compute as plain ones, placed
whole by the step with no ``shard_state`` needed, and train as on one device."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import substrax
from substrax.mesh import create_device_mesh
from substrax.nn import (
    ColumnParallelLinear,
    ParallelEmbedding,
    ParallelSelfAttention,
    RowParallelLinear,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}


def assert_trees_close(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


class SmallLM(nnx.Module):
    """Every layer of substrax.nn once: embedding (features split), attention, column -> row MLP."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.emb = ParallelEmbedding(16, 8, split="features", rngs=rngs)
        self.attn = ParallelSelfAttention(4, 8, qkv_features=16, causal=True, rngs=rngs)
        self.up = ColumnParallelLinear(8, 16, rngs=rngs)
        self.down = RowParallelLinear(16, 8, rngs=rngs)
        self.head = nnx.Linear(8, 16, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.emb(ids)
        x = x + self.attn(x)
        return self.head(x + self.down(jax.nn.gelu(self.up(x))))


def lm_loss(model: SmallLM, batch: dict) -> jax.Array:
    logits = model(batch["ids"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["next"]).mean()


LM_BATCHES = [
    {"ids": ids[:, :-1], "next": ids[:, 1:]}
    for ids in np.random.default_rng(0).integers(0, 16, size=(3, 16, 7)).astype(np.int32)
]


def lm_optimizer(model: SmallLM) -> nnx.Optimizer:
    # momentum: optimizer state that mirrors every parameter, its split metadata copied
    return nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


@pytest.fixture(scope="module")
def lm_reference() -> tuple[list[float], dict]:
    model = SmallLM()
    optimizer = lm_optimizer(model)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    with jax.default_device(jax.devices()[0]):
        losses = [float(step(model, optimizer, b)) for b in LM_BATCHES]
    return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("layout", [None, "zero1"])
@pytest.mark.parametrize("built", ["under the mesh", "without a mesh"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_model_of_these_layers_trains_on_a_mesh_without_model_axis(
    mode, built, layout, lm_reference
) -> None:
    """No shard_state needed (layout None): the declared model axis is optional, so the step
    places these layers' parameters whole on a data-only mesh; the result is one device's."""
    mesh = create_device_mesh({"data": 8})
    if built == "under the mesh":
        with jax.set_mesh(mesh):
            model = SmallLM()
            optimizer = lm_optimizer(model)
    else:
        model = SmallLM()
        optimizer = lm_optimizer(model)
    if layout is not None:
        substrax.shard_state(model, optimizer, mesh=mesh, layout=layout, min_size=64)
    step = substrax.make_train_step(lm_loss, mode, mesh=mesh)
    losses = [float(step(model, optimizer, b)) for b in LM_BATCHES]
    want_losses, want_params = lm_reference
    np.testing.assert_allclose(losses, want_losses, **TOL)
    assert_trees_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), want_params)
    # the declaration is kept for a mesh with the axis: shard_state splits over model there
    said = model.up.kernel.get_metadata()
    assert (said.get("declared_sharding") or said["out_sharding"]) == (None, "model")
    assert said["optional_axes"] == ("model",)
