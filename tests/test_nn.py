"""substrax.nn: tensor-parallel layers equal their one-device selves, explicit and implicit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import mse

import substrax
from substrax import census
from substrax._base import declared
from substrax.census import phase_of
from substrax.mesh import create_device_mesh
from substrax.nn import (
    ColumnParallelLinear,
    ParallelEmbedding,
    ParallelSelfAttention,
    RowParallelLinear,
    declare_backward,
    declare_forward,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}
ROWS = P("data")  # an input's rows split over data, its features whole


class Block(nnx.Module):
    """Column -> relu -> Row: a transformer's MLP."""

    def __init__(self, *, sequence_parallel: bool = False, collective_matmul: bool = False) -> None:
        rngs = nnx.Rngs(0)
        self.up = ColumnParallelLinear(
            8, 16, sequence_parallel=sequence_parallel, collective_matmul=collective_matmul, rngs=rngs
        )
        self.down = RowParallelLinear(16, 8, sequence_parallel=sequence_parallel, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.relu(self.up(x)))


def batch(shape: tuple[int, ...] = (4, 8, 8), seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape)


def one_device(model: nnx.Module, x: jax.Array) -> tuple[jax.Array, jax.Array, tuple]:
    """Output, loss and gradients (state, input) of ``mean(model(x)**2)``, unsplit."""
    graphdef, state = nnx.split(model)

    def loss(state, x):
        y = nnx.merge(graphdef, state)(x)
        return jnp.mean(y**2), y

    (value, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
    return y, value, grads


def explicit(model: nnx.Module, mesh, x_spec: P, loss_axes):
    """The same under ``shard_map(check_vma=True)``, parameters split by their metadata."""
    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)

    def per_device(state, x):
        def loss(state, x):
            y = nnx.merge(graphdef, state)(x)
            return jax.lax.pmean(jnp.mean(y**2), loss_axes), y

        (value, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return y, value, grads

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(specs, x_spec),
        out_specs=(x_spec, P(), (specs, x_spec)),
        check_vma=True,
    )
    forward, _ = sharded_forward(model, mesh, x_spec)
    return jax.jit(run), jax.jit(forward), state


def sharded_forward(model: nnx.Module, mesh, x_spec: P = ROWS, *, check_vma: bool = True):
    """``model``'s forward pass under ``shard_map``, parameters split by their metadata; and its state."""
    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)
    run = jax.shard_map(
        lambda state, x: nnx.merge(graphdef, state)(x),
        mesh=mesh,
        in_specs=(specs, x_spec),
        out_specs=x_spec,
        check_vma=check_vma,
    )
    return run, state


def assert_trees_close(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


def model_collectives(fn, *args, mesh) -> dict[str, int]:
    """The compiled program's collectives over the model axis alone, by kind."""
    counts: dict[str, int] = {}
    for row in census(fn.lower(*args).compile(), mesh=mesh).rows:
        if row.axes == ("model",):
            counts[row.kind] = counts.get(row.kind, 0) + 1
    return counts


# --- one device, no mesh -----------------------------------------------------------


@pytest.mark.parametrize("layer", [ColumnParallelLinear, RowParallelLinear])
def test_linear_is_nnx_linear_without_mesh(layer) -> None:
    want = nnx.Linear(8, 12, rngs=nnx.Rngs(0))
    got = layer(8, 12, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(got.kernel[...], want.kernel[...])
    np.testing.assert_array_equal(got.bias[...], want.bias[...])
    x = batch((3, 5, 8))
    np.testing.assert_array_equal(got(x), want(x))
    plain = layer(8, 12, use_bias=False, rngs=nnx.Rngs(0))
    assert plain.bias is None
    np.testing.assert_array_equal(plain(x), x @ want.kernel[...])


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_tensor_parallel_model_without_a_mesh_trains_as_nnx_does_on_one_device(mode: str) -> None:
    """Without a mesh the layers are plain (above): the implicit step trains them on one
    device, as ``nnx.jit`` does; the explicit step, which needs a mesh, says so."""
    b = {"x": batch((4, 8, 8)), "y": batch((4, 8, 8), seed=2)}
    model = Block()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = substrax.make_train_step(mse, mode)
    if mode == "explicit":
        with pytest.raises(ValueError, match=r"No mesh: pass mesh=, or call inside `with jax\.set_mesh"):
            step(model, optimizer, b)
        return
    reference = Block()
    ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def ref_step(m: nnx.Module, o: nnx.Optimizer, b: dict) -> jax.Array:
        loss, grads = nnx.value_and_grad(mse)(m, b)
        o.update(m, grads)
        return loss

    for _ in range(2):
        np.testing.assert_allclose(step(model, optimizer, b), ref_step(reference, ref_optimizer, b), **TOL)
    leaves = jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reference))
    for got, want in zip(*leaves, strict=True):
        np.testing.assert_allclose(got, want, **TOL)


def test_a_spec_that_is_not_a_layers_own_without_a_mesh_is_refused_naming_the_variable() -> None:
    """A variable placed over an axis it cannot do without (here ``data``, not a layer's
    optional ``model``) cannot be kept placed by a step with no mesh."""
    model = Block()
    model.up.kernel.set_metadata(out_sharding=("data", "model"))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = substrax.make_train_step(mse, "implicit")
    with pytest.raises(
        ValueError,
        match=r"model\['up'\]\['kernel'\] is placed as PartitionSpec\('data', 'model'\), but the step "
        r"has no mesh: pass mesh= to make_train_step",
    ):
        step(model, optimizer, {"x": batch((4, 8, 8)), "y": batch((4, 8, 8), seed=2)})


def test_partition_specs_from_metadata() -> None:
    col = nnx.get_partition_spec(nnx.state(ColumnParallelLinear(8, 12, model_axis="tp", rngs=nnx.Rngs(0))))
    row = nnx.get_partition_spec(nnx.state(RowParallelLinear(8, 12, model_axis="tp", rngs=nnx.Rngs(0))))
    assert (col["kernel"].get_value(), col["bias"].get_value()) == (P(None, "tp"), P("tp"))
    assert (row["kernel"].get_value(), row["bias"].get_value()) == (P("tp", None), P(None))
    vocab = nnx.get_partition_spec(nnx.state(ParallelEmbedding(16, 8, rngs=nnx.Rngs(0))))
    feats = nnx.get_partition_spec(nnx.state(ParallelEmbedding(16, 8, split="features", rngs=nnx.Rngs(0))))
    assert vocab["embedding"].get_value() == P("model", None)
    assert feats["embedding"].get_value() == P(None, "model")


def test_set_mesh_places_parameters_split() -> None:
    """flax's eager sharding: under jax.set_mesh the parameters are created split."""
    mesh = create_device_mesh({"data": 2, "model": 4})
    with jax.set_mesh(mesh):
        col = ColumnParallelLinear(8, 12, rngs=nnx.Rngs(0))
        emb = ParallelEmbedding(16, 8, rngs=nnx.Rngs(0))
    assert col.kernel[...].sharding == NamedSharding(mesh, P(None, "model"))
    assert col.bias[...].sharding == NamedSharding(mesh, P("model"))
    assert emb.embedding[...].sharding == NamedSharding(mesh, P("model", None))
    np.testing.assert_array_equal(col.kernel[...], nnx.Linear(8, 12, rngs=nnx.Rngs(0)).kernel[...])


@pytest.mark.parametrize("split", ["vocab", "features"])
def test_embedding_is_nnx_embed_without_mesh(split) -> None:
    want = nnx.Embed(16, 8, rngs=nnx.Rngs(0))
    got = ParallelEmbedding(16, 8, split=split, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(got.embedding[...], want.embedding[...])
    ids = jnp.array([[0, 3, 15], [7, 7, 1]])
    np.testing.assert_array_equal(got(ids), want(ids))
    q = batch((2, 8))
    np.testing.assert_array_equal(got.attend(q), want.attend(q))


def attention_reference(model: ParallelSelfAttention, x: np.ndarray, causal: bool) -> np.ndarray:
    """Multi-head softmax attention in NumPy, from the model's parameters."""

    def proj(layer, h):
        return h @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])

    heads, d = model.num_heads, model.head_dim
    b, s, _ = x.shape
    q, k, v = (proj(p, x).reshape(b, s, heads, d) for p in (model.query, model.key, model.value))
    out = np.zeros((b, s, heads, d))
    for i in range(b):
        for h in range(heads):
            scores = q[i, :, h] @ k[i, :, h].T / np.sqrt(d)
            if causal:
                scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            out[i, :, h] = (w / w.sum(-1, keepdims=True)) @ v[i, :, h]
    return proj(model.out, out.reshape(b, s, heads * d))


@pytest.mark.parametrize("sequence_parallel", [False, True])  # no shard_map: it changes nothing
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_numpy_reference(causal, sequence_parallel) -> None:
    model = ParallelSelfAttention(
        4,
        8,
        qkv_features=16,
        out_features=6,
        causal=causal,
        sequence_parallel=sequence_parallel,
        rngs=nnx.Rngs(0),
    )
    x = batch((2, 5, 8))
    np.testing.assert_allclose(model(x), attention_reference(model, np.asarray(x, np.float64), causal), **TOL)


# --- explicit: inside shard_map ----------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 4), (1, 8), (4, 2)])
def test_explicit_block_matches_one_device(shape) -> None:
    mesh = create_device_mesh({"data": shape[0], "model": shape[1]})
    model, x = Block(), batch()
    run, forward, state = explicit(model, mesh, P("data"), "data")
    y, value, grads = run(state, x)
    want_y, want_value, want_grads = one_device(model, x)
    np.testing.assert_allclose(y, want_y, **TOL)
    np.testing.assert_allclose(value, want_value, **TOL)
    assert_trees_close(grads, want_grads)  # the input's gradient: psum-ed over model by AD
    if shape == (2, 4):
        assert model_collectives(forward, state, x, mesh=mesh) == {"all-reduce": 1}  # the row layer's psum
        rows = [r for r in census(run.lower(state, x).compile(), mesh=mesh).rows if r.axes == ("model",)]
        assert sorted(r.kind for r in rows) == ["all-reduce", "all-reduce"]  # + the input gradient's
        # both written by the layers: the row layer's psum, and the transpose of the column
        # layer's cast of its input to varying
        assert all("substrax.tensor_parallel" in r.op_name for r in rows), rows
        assert sorted(phase_of(r.op_name) for r in rows) == ["backward", "forward"]


@pytest.mark.parametrize("collective_matmul", [False, True])
def test_explicit_sequence_parallel(collective_matmul) -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    model, x = Block(sequence_parallel=True, collective_matmul=collective_matmul), batch()
    spec = P("data", "model")  # the batch over data, the sequence (dim -2) over model
    run, forward, state = explicit(model, mesh, spec, ("data", "model"))
    y, value, grads = run(state, x)
    want_y, want_value, want_grads = one_device(model, x)
    np.testing.assert_allclose(y, want_y, **TOL)
    np.testing.assert_allclose(value, want_value, **TOL)
    assert_trees_close(grads, want_grads)
    counts = model_collectives(forward, state, x, mesh=mesh)
    if collective_matmul:
        assert counts == {"collective-permute": 3, "reduce-scatter": 1}
    else:
        assert counts == {"all-gather": 1, "reduce-scatter": 1}


def test_explicit_attention_matches_one_device() -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    model = ParallelSelfAttention(4, 8, qkv_features=16, causal=True, rngs=nnx.Rngs(0))
    x = batch((4, 5, 8))
    run, forward, state = explicit(model, mesh, P("data"), "data")
    y, value, grads = run(state, x)
    want_y, want_value, want_grads = one_device(model, x)
    np.testing.assert_allclose(y, want_y, **TOL)
    np.testing.assert_allclose(value, want_value, **TOL)
    assert_trees_close(grads, want_grads)
    assert model_collectives(forward, state, x, mesh=mesh) == {"all-reduce": 1}  # the output projection's


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_sequence_parallel_attention_matches_one_device(causal) -> None:
    """The sequence split over model: gathered once for q, k, v (the causal mask over the whole
    sequence), the output reduce-scattered back to each device's part of it."""
    mesh = create_device_mesh({"data": 2, "model": 4})
    model = ParallelSelfAttention(
        4, 8, qkv_features=16, causal=causal, sequence_parallel=True, rngs=nnx.Rngs(0)
    )
    x = batch((4, 8, 8))
    run, forward, state = explicit(model, mesh, P("data", "model"), ("data", "model"))
    y, value, grads = run(state, x)
    want_y, want_value, want_grads = one_device(model, x)
    np.testing.assert_allclose(y, want_y, **TOL)
    np.testing.assert_allclose(value, want_value, **TOL)
    assert_trees_close(grads, want_grads)
    assert model_collectives(forward, state, x, mesh=mesh) == {"all-gather": 1, "reduce-scatter": 1}


@pytest.mark.parametrize("split", ["vocab", "features"])
def test_explicit_embedding_matches_one_device(split) -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    model = ParallelEmbedding(16, 8, split=split, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)
    ids = jax.random.randint(jax.random.key(2), (4, 6), 0, 16)
    q = batch((4, 8))
    logits_spec = P("data", "model") if split == "vocab" else P("data")  # vocab: each device its block

    def per_device(state, ids, q):
        def loss(state):
            emb = nnx.merge(graphdef, state)
            return jax.lax.pmean(jnp.mean(emb(ids) ** 2), "data")

        emb = nnx.merge(graphdef, state)
        return emb(ids), emb.attend(q), jax.grad(loss)(state)

    run = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(specs, P("data"), P("data")),
            out_specs=(P("data"), logits_spec, specs),
            check_vma=True,
        )
    )
    y, logits, grads = run(state, ids, q)
    np.testing.assert_allclose(y, model(ids), **TOL)
    np.testing.assert_allclose(logits, model.attend(q), **TOL)
    want = jax.grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(ids) ** 2))(state)
    assert_trees_close(grads, want)


class TiedLM(nnx.Module):
    """Embedding -> attention -> the embedding's tied logits: every layer's collectives at once."""

    def __init__(self, split: str) -> None:
        rngs = nnx.Rngs(0)
        self.emb = ParallelEmbedding(16, 8, split=split, rngs=rngs)
        self.attn = ParallelSelfAttention(4, 8, qkv_features=16, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.emb(ids)
        return self.emb.attend(x + self.attn(x))


def tied_lm(split: str, mesh):
    """``TiedLM``'s loss and gradient under ``shard_map``, a fresh ``jax.jit`` each call."""
    graphdef, state = nnx.split(TiedLM(split))
    specs = nnx.get_partition_spec(state)
    axes = ("data", "model") if split == "vocab" else "data"  # vocab: each device its logits' block

    def per_device(state, ids):
        loss = lambda s: jax.lax.pmean(jnp.mean(nnx.merge(graphdef, s)(ids) ** 2), axes)  # noqa: E731
        return jax.value_and_grad(loss)(state)

    run = jax.shard_map(
        per_device, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs), check_vma=True
    )
    return jax.jit(run), (state, jax.random.randint(jax.random.key(2), (4, 6), 0, 16))


def block_run(mesh, **options):
    spec, axes = (P("data", "model"), ("data", "model")) if options else (P("data"), "data")
    run, _, state = explicit(Block(**options), mesh, spec, axes)
    return run, (state, batch())


def attention_run(mesh, sequence_parallel=False):
    model = ParallelSelfAttention(
        4, 8, qkv_features=16, causal=True, sequence_parallel=sequence_parallel, rngs=nnx.Rngs(0)
    )
    spec, axes = (P("data", "model"), ("data", "model")) if sequence_parallel else (P("data"), "data")
    run, _, state = explicit(model, mesh, spec, axes)
    return run, (state, batch((4, 8, 8)))


LAYER_RUNS = {
    "block": block_run,
    "sequence-parallel": lambda mesh: block_run(mesh, sequence_parallel=True),
    "collective-matmul": lambda mesh: block_run(mesh, sequence_parallel=True, collective_matmul=True),
    "attention": attention_run,
    "attention-sequence-parallel": lambda mesh: attention_run(mesh, sequence_parallel=True),
    "embedding-vocab": lambda mesh: tied_lm("vocab", mesh),
    "embedding-features": lambda mesh: tied_lm("features", mesh),
}


@pytest.mark.parametrize("name", list(LAYER_RUNS))
def test_layers_say_every_collective_they_compile_to(name) -> None:
    """What the layers declare while traced (the census's expectation over ``model``,
    ``substrax._base.declared``) is, buffer for buffer and phase for phase, what XLA compiled
    over ``model``: forward and backward, the input's gradient psum-ed only when taken."""
    mesh = create_device_mesh({"data": 2, "model": 4})
    run, args = LAYER_RUNS[name](mesh)
    with declared.recording() as said:
        compiled = run.lower(*args).compile()
    parts = [p for row in census(compiled, mesh=mesh).rows if row.axes == ("model",) for p in row.parts]
    got = sorted((phase_of(p.op_name), p.kind, p.buffer.shape, p.bytes_per_step) for p in parts)
    want = sorted((i.phase, i.kind, i.shape, i.bytes) for i in said)
    assert got == want, "\n".join(map(str, said))


def test_a_declaration_names_a_kind_the_census_counts_and_one_axis() -> None:
    from substrax.census import KINDS

    assert set(declared.KINDS) <= set(KINDS)
    model, x = Block(), batch()
    with pytest.raises(ValueError, match=r"declare_forward: 'allreduce' is not a collective.*'all-reduce'"):
        declare_forward(model, "allreduce", "model", x, "why")  # checked outside a recording too
    with pytest.raises(
        TypeError, match=r"declare_backward: axis must be one mesh axis name.*\('data', 'model'\)"
    ):
        declare_backward(model, "all-reduce", ("data", "model"), x, "why")


def test_nothing_is_declared_outside_a_recording_or_without_a_split() -> None:
    model, x = Block(), batch()
    assert declare_backward(model, "all-reduce", "model", x, "why") is x  # the program as written
    with declared.recording() as said:
        jax.grad(lambda m, x: jnp.mean(m(x) ** 2), argnums=1)(model, x)  # one device: no collective
    assert said == []


# --- implicit: jax.jit over placed arrays ------------------------------------------


def test_implicit_matches_one_device() -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    x = batch((4, 5, 8))
    for model in (Block(), ParallelSelfAttention(4, 8, qkv_features=16, rngs=nnx.Rngs(0))):
        graphdef, state = nnx.split(model)
        placed = jax.device_put(state, nnx.get_named_sharding(state, mesh))
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))

        def loss(state, x, graphdef=graphdef):
            y = nnx.merge(graphdef, state)(x)
            return jnp.mean(y**2), y

        (value, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(placed, xs)
        want_y, want_value, want_grads = one_device(model, x)
        np.testing.assert_allclose(y, want_y, **TOL)
        np.testing.assert_allclose(value, want_value, **TOL)
        assert_trees_close(grads, want_grads)


# --- errors ------------------------------------------------------------------------


def test_row_layer_names_the_input_it_wants() -> None:
    row = RowParallelLinear(16, 8, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError, match=r"last dimension is 16 \(in_features\); got shape \(4, 8\).*ColumnParallelLinear"
    ):
        row(jnp.ones((4, 8)))
    mesh = create_device_mesh({"data": 2, "model": 4})
    whole, state = sharded_forward(row, mesh)  # the whole input, not a column layer's block
    with pytest.raises(
        ValueError,
        match=r"last dimension is 4 .*in_features=16 split over 'model' of size 4.*got shape \(2, 16\)",
    ):
        whole(state, jnp.ones((4, 16)))


def test_heads_must_divide_over_model_axis() -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    message = r"num_heads=2 cannot be split over axis 'model' of size 4"
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=message):
        ParallelSelfAttention(2, 8, rngs=nnx.Rngs(0))
    run, state = sharded_forward(ParallelSelfAttention(2, 8, rngs=nnx.Rngs(0)), mesh)  # no mesh: built whole
    with pytest.raises(ValueError, match=message):
        run(state, batch((4, 5, 8)))
    with pytest.raises(ValueError, match="qkv_features=10 is not a multiple of num_heads=4"):
        ParallelSelfAttention(4, 8, qkv_features=10, rngs=nnx.Rngs(0))


def test_shard_without_check_vma_is_refused() -> None:
    mesh = create_device_mesh({"data": 2, "model": 4})
    run, state = sharded_forward(Block(), mesh, check_vma=False)
    with pytest.raises(
        ValueError, match=r"ColumnParallelLinear: .*not typed as varying over 'model'.*check_vma=True"
    ):
        run(state, batch())


def test_option_errors() -> None:
    with pytest.raises(ValueError, match="pass sequence_parallel=True"):
        ColumnParallelLinear(8, 8, collective_matmul=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="split must be one of"):
        ParallelEmbedding(8, 8, split="rows", rngs=nnx.Rngs(0))  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["shard_state", "step"])
def test_a_stack_built_without_transform_metadata_is_refused_by_path(where: str) -> None:
    """#27.4: stacked by nnx.vmap without transform_metadata, a declared split is one dimension off."""
    from substrax.nn import ColumnParallelLinear

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key: jax.Array) -> ColumnParallelLinear:
        return ColumnParallelLinear(8, 16, rngs=nnx.Rngs(key))

    mesh = substrax.mesh.create_device_mesh({"data": 4, "model": 2})
    with jax.set_mesh(mesh):
        stack = make(jax.random.split(jax.random.key(0), 4))
        optimizer = nnx.Optimizer(stack, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(
        ValueError, match=r"model\['(bias|kernel)'\] has [23] dimensions .* transform_metadata"
    ):
        if where == "shard_state":
            substrax.shard_state(stack, optimizer, mesh=mesh)
        else:
            step = substrax.make_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2), "explicit", mesh=mesh)
            step(stack, optimizer, {"x": np.ones((8, 4, 8), np.float32)})
