"""compare_gradients on attention, dropout and BatchNorm: no false alarm, and real mistakes still named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MLP, Normed, mse, regression_batches
from flax import nnx
from jax.sharding import PartitionSpec

from substrax.explicit import compare_gradients
from substrax.mesh import create_device_mesh

P = PartitionSpec


class TinyDecoder(nnx.Module):
    """Embed, a default nnx.MultiHeadAttention (its key bias has a zero gradient), LayerNorm, Dropout."""

    def __init__(self, *, vocab: int = 12, width: int = 8, dropout: float = 0.0, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=width, decode=False, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens)
        h = h + self.attn(h, mask=nnx.make_causal_mask(tokens))
        return self.out(self.drop(self.norm(h)))


def _lm_loss(model: TinyDecoder, batch: dict) -> jax.Array:
    logp = jax.nn.log_softmax(model(batch["tokens"]))
    return -jnp.mean(jnp.take_along_axis(logp, batch["next"][..., None], axis=-1))


def _lm_batch(rows: int = 16, length: int = 6, vocab: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (rows, length + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "next": tokens[:, 1:]}


def _shard_map_grads(loss_fn, mesh, *, average_after: bool, check_vma: bool = True, split: str = "data"):
    """A hand-written candidate: the loss pmean-ed over 'data' before grad, or the gradient after it."""

    def grads(model: nnx.Module, batch: dict) -> nnx.State:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def per_device(params: nnx.State, rest: nnx.State, shard: dict) -> nnx.State:
            def loss(p: nnx.State) -> jax.Array:
                local = loss_fn(nnx.merge(graphdef, p, rest), shard)
                return local if average_after else jax.lax.pmean(local, "data")

            g = jax.grad(loss)(params)
            return jax.lax.pmean(g, "data") if average_after else g

        run = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), P(), P(split)), out_specs=P(), check_vma=check_vma
        )
        return run(params, rest, batch)

    return grads


@pytest.mark.slow  # make test-slow (in .ci/run); the axis-size diagnosis of an MLP stays in make test
def test_default_attention_passes_and_an_average_after_grad_names_the_axis_size(
    mesh8: jax.sharding.Mesh,
) -> None:
    candidate = _shard_map_grads(_lm_loss, mesh8, average_after=True)  # the deliberate bug
    report = compare_gradients(TinyDecoder(), _lm_loss, _lm_batch(), mesh8, candidate=candidate)
    # no false alarm on the implicit and explicit paths ...
    assert all(row.ok["implicit"] and row.ok["explicit"] for row in report.rows), str(report)
    assert report.diagnosis.keys() == {"candidate"}
    key_bias = next(row for row in report.rows if row.path == "attn.key.bias")
    largest = max(row.reference_norm for row in report.rows)
    assert key_bias.reference_norm < 1e-6 * largest  # zero in exact arithmetic: round-off alone
    # ... and the bug is named by its factor
    assert not report.ok
    assert report.scale["candidate"] == pytest.approx(8.0, rel=1e-4)
    assert (
        "gradient is 8x the reference: a factor of 8, the size of mesh axis 'data'"
        in report.diagnosis["candidate"]
    )


def test_a_missing_all_reduce_is_caught(mesh8: jax.sharding.Mesh) -> None:
    # check_vma=False: no implicit psum; each device keeps its own shard's gradient / 8
    candidate = _shard_map_grads(mse, mesh8, average_after=False, check_vma=False)
    report = compare_gradients(
        MLP(seed=1), mse, regression_batches(1, rows=32)[0], mesh8, candidate=candidate
    )
    assert not report.ok and "not by a constant factor" in report.diagnosis["candidate"]


def test_a_wrong_axis_split_is_caught() -> None:
    mesh = create_device_mesh({"data": 4, "model": 2})
    # the batch split over 'model' (halves) and the loss averaged over 'data': half the batch's gradient
    candidate = _shard_map_grads(mse, mesh, average_after=False, split="model")
    report = compare_gradients(MLP(seed=1), mse, regression_batches(1, rows=32)[0], mesh, candidate=candidate)
    assert not report.ok
    assert all(row.ok["implicit"] and row.ok["explicit"] for row in report.rows)
    # under check_vma=True the gradient also sums over 'model': the two halves' gradients added
    assert report.scale["candidate"] == pytest.approx(2.0, rel=1e-4)
    assert "the size of mesh axis 'model', which is not the data axis 'data'" in report.diagnosis["candidate"]


def test_a_tiny_leaf_off_by_the_axis_size_still_fails_with_the_rest(mesh8: jax.sharding.Mesh) -> None:
    # The tolerance is relative to the whole gradient: an 8x error shows on the large leaves.
    candidate = _shard_map_grads(mse, mesh8, average_after=True)
    report = compare_gradients(
        MLP(seed=1), mse, regression_batches(1, rows=32)[0], mesh8, candidate=candidate
    )
    assert not any(row.ok["candidate"] for row in report.rows if row.reference_norm > 1e-3)
    assert "a factor of 8" in report.diagnosis["candidate"]


def test_active_dropout_is_refused_naming_the_stream(mesh8: jax.sharding.Mesh) -> None:
    model = TinyDecoder(dropout=0.5)
    with pytest.raises(
        ValueError, match=r"draws random numbers from the model's nnx.Rngs \(stream\(s\) drop.rngs"
    ) as e:
        compare_gradients(model, _lm_loss, _lm_batch(), mesh8)
    assert "model.set_attributes(deterministic=True)" in str(e.value)
    model.set_attributes(deterministic=True)  # what the message says to do
    assert compare_gradients(model, _lm_loss, _lm_batch(), mesh8).ok


def test_batchnorm_with_the_data_axis_name_passes_and_the_model_is_unchanged(
    mesh8: jax.sharding.Mesh,
) -> None:
    # The reference and the implicit path run where no shard_map binds 'data': the axis is
    # bound with size 1 there, so the layer's pmean is a no-op over the whole batch.
    model = Normed(axis_name="data", tanh=True)
    report = compare_gradients(model, mse, regression_batches(1, rows=32)[0], mesh8)
    assert report.ok and not report.diagnosis, str(report)
    assert report.methods == ("implicit", "explicit")
    np.testing.assert_array_equal(model.norm.mean.get_value(), 0.0)  # the running statistics untouched


def test_per_shard_batch_statistics_are_named_as_the_cause(mesh8: jax.sharding.Mesh) -> None:
    model = Normed(axis_name=None, tanh=True)
    report = compare_gradients(model, mse, regression_batches(1, rows=32)[0], mesh8)
    # the implicit path normalizes the global batch, as the reference does; explicit, each shard
    assert not report.ok
    assert all(row.ok["implicit"] for row in report.rows) and report.diagnosis.keys() == {"explicit"}
    text = report.diagnosis["explicit"]
    assert "not by a constant factor" not in text
    assert "nnx.BatchNorm in training mode at norm (axis_name=None)" in text
    assert "that shard's own batch statistics" in text and "not the global batch's" in text
    assert "axis_name='data'" in text
    model.eval()  # the running averages: the same on every device
    assert compare_gradients(model, mse, regression_batches(1, rows=32)[0], mesh8).ok


class Centered(nnx.Module):
    """Not a BatchNorm: subtracts its input's batch mean, and keeps it in an nnx.BatchStat."""

    def __init__(self) -> None:
        self.inner = MLP(seed=1)
        self.last_mean = nnx.BatchStat(jnp.zeros((4,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = jnp.mean(x, axis=0)
        self.last_mean.set_value(mean)
        return self.inner(x - mean)


def test_other_per_shard_batch_statistics_name_the_layer_and_its_variable(mesh8: jax.sharding.Mesh) -> None:
    report = compare_gradients(Centered(), mse, regression_batches(1, rows=32)[0], mesh8)
    assert not report.ok and report.diagnosis.keys() == {"explicit"}
    text = report.diagnosis["explicit"]
    assert "nnx.BatchStat variables updated by the loss at (the model) (Centered: last_mean)" in text
    assert "jax.lax.pmean(..., 'data')" in text
