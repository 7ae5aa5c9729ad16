"""The step census accounts for what the library adds and what the model issues itself.

A BatchNorm model's step communicates more than its gradients and loss: the explicit
step averages the running statistics of a BatchNorm without ``axis_name``; a BatchNorm
with ``axis_name`` ``pmean``-s its batch statistics in the forward pass (and their
transposes run in the backward pass); in implicit mode XLA all-reduces the global
batch's statistics. The census attributes each buffer, from the operation names XLA
keeps in the compiled HLO, and still catches a buffer the library reduces twice.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models import MLP, Normed, mse, regression_batches, stack

import substrax
from substrax.census import Comparison, census, compare, expected_communication, library_scope, phase_of
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

F32 = 4


def _state(model: nnx.Module, mesh: jax.sharding.Mesh, layout: str, tx: Any = None) -> nnx.Optimizer:
    optimizer = nnx.Optimizer(model, tx if tx is not None else optax.adam(1e-2), wrt=nnx.Param)
    if layout != "replicated":
        substrax.shard_state(model, optimizer, mesh=mesh, params=layout == "fsdp", min_size=16)
    return optimizer


def _batch(mesh: jax.sharding.Mesh) -> dict:
    return place_batch_on_shards(regression_batches(1, rows=32)[0], create_data_parallel_sharding(mesh))


def _normed_census(
    mesh: jax.sharding.Mesh, mode: str, layout: str, axis_name: str | None, k: int
) -> Comparison:
    model = Normed(axis_name, width=16)
    optimizer = _state(model, mesh, layout)
    return substrax.make_train_step(mse, mode, mesh=mesh, microbatches=k).census(
        model, optimizer, _batch(mesh)
    )


def _sources(found: Comparison) -> dict[str, int]:
    """Compiled bytes per step by what they were matched to."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for item, parts in found.matched:
        for p in parts:
            if id(p) not in seen:
                seen.add(id(p))
                out[item.category] = out.get(item.category, 0) + p.bytes_per_step
    return out


PARAMS = (4 * 16 + 16 + 16 + 16 + 16 * 1 + 1) * F32  # Normed's gradients: 516 B
STATS = 2 * 16 * F32  # its running mean and variance: 128 B

# --- the operation names XLA keeps -------------------------------------------------------------


def test_named_scopes_reach_the_compiled_hlo_per_buffer(mesh8: jax.sharding.Mesh) -> None:
    """A psum under one scope and a pmean under another, combined by XLA into one all-reduce,
    keep their own operation names: the get-tuple-element of each result carries it."""

    def f(a: jax.Array) -> tuple[jax.Array, jax.Array]:
        with jax.named_scope("substrax.grad_reduce"):
            s = jax.lax.psum(a, "data")
        with jax.named_scope("substrax.loss"):
            m = jax.lax.pmean(jnp.sum(a), "data")
        return s, m

    jitted = jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P("data"), out_specs=(P(), P())))
    text = jitted.lower(jax.ShapeDtypeStruct((64, 16), jnp.float32)).compile().as_text()
    (row,) = census(text).rows  # one combined all-reduce
    assert (
        row.op_name == "jit(f)/shard_map/(substrax.grad_reduce/psum_invariant:substrax.loss/psum_invariant)"
    )
    first, second = row.parts
    assert (str(first.buffer), first.op_name) == (
        "f32[8,16]",
        "jit(f)/shard_map/substrax.grad_reduce/psum_invariant",
    )
    assert (str(second.buffer), second.op_name) == ("f32[]", "jit(f)/shard_map/substrax.loss/psum_invariant")
    assert (first.scope, second.scope) == ("substrax.grad_reduce", "substrax.loss")
    assert sum(p.bytes for p in row.parts) == row.bytes


def test_combined_names_are_split_when_no_get_tuple_element_says() -> None:
    text = (
        """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: f32[4], b: f32[]) -> (f32[4], f32[]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[] parameter(1)
"""
        "  ROOT %ar = (f32[4]{0}, f32[]) all-reduce(%a, %b), replica_groups={}, to_apply=%add, "
        'metadata={op_name="jit(s)/shard_map/(transpose(jvp())/psum:jvp(substrax.loss)/psum)"}\n'
        "}\n"
    )
    (row,) = census(text).rows
    assert [p.op_name for p in row.parts] == [
        "jit(s)/shard_map/transpose(jvp())/psum",
        "jit(s)/shard_map/jvp(substrax.loss)/psum",
    ]
    assert [phase_of(p.op_name) for p in row.parts] == ["backward", "forward"]
    assert [library_scope(p.op_name) for p in row.parts] == [None, "substrax.loss"]


# --- a BatchNorm model's step matches in every mode, layout and microbatch count ---------------

EXPLICIT_CASES = [
    (layout, axis_name, k)
    for layout in ("replicated", "fsdp")
    for axis_name in (None, "data")
    for k in (1, 2)
] + [("zero1", None, 1), ("zero1", "data", 2)]


@pytest.mark.parametrize(("layout", "axis_name", "k"), EXPLICIT_CASES)
def test_explicit_batchnorm_step_matches(
    mesh8: jax.sharding.Mesh, layout: str, axis_name: str | None, k: int
) -> None:
    found = _normed_census(mesh8, "explicit", layout, axis_name, k)
    assert found.matches, str(found)
    sources = _sources(found)
    assert sources["gradients"] == PARAMS and sources["loss"] == F32
    assert sources.get("parameters", 0) == (PARAMS - 4 if layout == "fsdp" else 0)  # all but out/bias split
    if axis_name is None:  # the step averages the per-device statistics, under its own scope
        assert sources["batch stats"] == STATS and not found.model
        averaged = [p for i, ps in found.matched if i.category == "batch stats" for p in ps]
        assert {p.scope for p in averaged} == {"substrax.batch_stats"}
    else:  # the layer pmean-s its statistics (forward) and their cotangents (backward): the model's
        assert "batch stats" not in sources
        assert {p.phase for p in found.model} == {"forward", "backward"}
        assert all(p.scope is None and p.row.trip_count == (k if k > 1 else None) for p in found.model)
        forward = sum(p.bytes for p in found.model if p.phase == "forward")
        assert forward == STATS  # the mean and the mean of squares of 16 features
        assert sources["model"] == sum(p.bytes for p in found.model) * k  # once per microbatch
        assert "model: f32[" in str(found) and "jvp()/psum_invariant" in str(found)
    assert not found.differences and not found.unexpected


@pytest.mark.parametrize("layout", ["replicated", "zero1", "fsdp"])
def test_implicit_batchnorm_step_matches(mesh8: jax.sharding.Mesh, layout: str) -> None:
    found = _normed_census(mesh8, "implicit", layout, None, 1)
    assert found.matches, str(found)
    sources = _sources(found)
    assert sources["gradients"] == PARAMS
    # XLA all-reduces the global batch's statistics in the forward pass, and more in the backward:
    # the model's reductions over the batch, attributed to it and listed
    forward = [p for p in found.model if p.kind == "all-reduce" and p.phase == "forward"]
    assert sum(p.bytes for p in forward) == STATS
    assert all("jvp()" in p.op_name for p in found.model)


@pytest.mark.parametrize("layout", ["replicated", "fsdp"])
def test_implicit_batchnorm_microbatches_flag_only_the_gradient_reduction_in_the_loop(
    mesh8: jax.sharding.Mesh, layout: str
) -> None:
    found = _normed_census(mesh8, "implicit", layout, None, 2)
    # XLA keeps the gradient all-reduce inside the accumulation loop (README: use explicit mode
    # to accumulate): that, and only that, is a difference; the BatchNorm's own all-reduces of
    # each microbatch's statistics run in the loop too, and are the model's
    assert not found.matches
    assert found.differences and all("inside a while loop and runs 2 times" in d for d in found.differences)
    assert any("model['hidden']['kernel']" in d for d in found.differences)
    forward = [p for p in found.model if p.phase == "forward" and p.kind == "all-reduce"]
    assert forward and all(p.row.trip_count == 2 for p in forward)
    assert sum(p.bytes for p in forward) == STATS


# --- metrics gathered per example: XLA may derive the loss from them ---------------------------


def _per_example(model: MLP, batch: dict) -> tuple[jax.Array, dict]:
    per = ((model(batch["x"]) - batch["y"]) ** 2).mean(-1)
    return per.mean(), {"per_example": per}


@pytest.mark.parametrize(
    ("mode", "layout"), [("implicit", "replicated"), ("implicit", "fsdp"), ("explicit", "zero1")]
)
def test_a_loss_computed_from_gathered_values_matches(
    mesh8: jax.sharding.Mesh, mode: str, layout: str
) -> None:
    model = MLP()
    optimizer = _state(model, mesh8, layout)
    step = substrax.make_train_step(
        _per_example, mode, mesh=mesh8, has_aux=True, reduce={"per_example": "gather"}
    )
    found = step.census(model, optimizer, _batch(mesh8))
    assert found.matches, str(found)
    assert _sources(found)["metrics"] == 32 * F32  # the 32 per-example values, gathered
    loss = [i for i in found.expected.items if i.category == "loss"]
    if mode == "implicit":  # measured: XLA reuses the gathered vector, and the loss's all-reduce is gone
        assert [i.optional for i in loss] == [True]
        assert any("not compiled, optional: loss" in n and "gathers" in n for n in found.notes)
    else:
        assert [i.optional for i in loss] == [False] and _sources(found)["loss"] == F32


# --- what the update communicates: its own census ----------------------------------------------


@pytest.mark.parametrize("mode", ["implicit", "explicit"])
def test_a_global_norm_clip_under_fsdp_is_the_updates_communication(
    mesh8: jax.sharding.Mesh, mode: str
) -> None:
    model = MLP()
    optimizer = _state(model, mesh8, "fsdp", optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))
    found = substrax.make_train_step(mse, mode, mesh=mesh8).census(model, optimizer, _batch(mesh8))
    assert found.matches, str(found)
    update = [i for i in found.expected.items if i.category == "update"]
    norms = [i for i in update if i.buffer == "f32[]" and "substrax.update" in i.what]
    assert norms and all(i.kind == "all-reduce" and i.bytes == F32 for i in norms)  # partial sums of squares
    assert "update: substrax.update/" in str(found.expected)


# --- an extra reduction is still caught, and named ---------------------------------------------


def test_gradients_the_step_reduces_twice_are_caught(
    mesh8: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library bug, simulated: the explicit step reduces every gradient a second time, under its
    own gradient-reduction scope. No attribution hides it."""
    from substrax.explicit import _step

    original = _step.reduce_gradients

    def twice(grads: nnx.State, plans: Any, data_axis: str, **kwargs: Any) -> nnx.State:
        reduced = original(grads, plans, data_axis, **kwargs)
        with jax.named_scope("substrax.grad_reduce"):
            again = jax.lax.psum(
                [2.0 * g for g in jax.tree.leaves(grads)], data_axis
            )  # not CSE-d with the first
        leaves, treedef = jax.tree.flatten(reduced)
        return jax.tree.unflatten(treedef, [r + 0.0 * a for r, a in zip(leaves, again, strict=True)])

    monkeypatch.setattr(_step, "reduce_gradients", twice)
    model = Normed("data", width=16)
    optimizer = _state(model, mesh8, "replicated")
    found = substrax.make_train_step(mse, "explicit", mesh=mesh8).census(model, optimizer, _batch(mesh8))
    assert not found.matches
    (difference,) = found.differences
    assert f"({PARAMS:,} B more)" in difference and "gradients reduced twice?" in difference
    assert "f32[4,16]" in difference and "substrax.grad_reduce/psum" in difference  # the buffers, named
    assert {p.scope for p in found.unexpected} == {"substrax.grad_reduce"}


def test_a_collective_in_the_loss_is_the_models_and_is_listed(mesh8: jax.sharding.Mesh) -> None:
    def with_psum(model: MLP, batch: dict) -> jax.Array:
        return mse(model, batch) + 0.0 * jax.lax.psum(batch["x"][:, :3].sum(0), "data").sum()

    model = MLP()
    found = substrax.make_train_step(with_psum, "explicit", mesh=mesh8).census(
        model, _state(model, mesh8, "replicated"), _batch(mesh8)
    )
    assert found.matches, str(found)  # the loss asks for it: the model's own communication
    (part,) = found.model
    assert str(part.buffer) == "f32[3]" and part.phase == "forward"
    assert "model: f32[3] (12 B)" in str(found)
    assert [i.what for i in found.expected.items if i.category == "model"] == [f"model: {part.op_name}"]


# --- hand-written programs: attribution does not excuse what runs outside the loss -------------

LEAVES = [("w", (16, 8), jnp.float32, False), ("b", (8,), jnp.float32, False)]


def _program(mesh: jax.sharding.Mesh, extra: str | None) -> Any:
    def loss(p: dict, x: jax.Array) -> jax.Array:
        value = jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)
        if extra == "in the loss":
            value = value + 0.0 * jax.lax.psum(x[:, :5].sum(0), "data").sum()
        return jax.lax.pmean(value, "data")

    def step(p: dict, x: jax.Array) -> tuple[jax.Array, dict]:
        value, grads = jax.value_and_grad(loss)(p, x)
        if extra == "after the gradient":
            grads = {**grads, "b": grads["b"] + 0.0 * jax.lax.psum(x[:, :5].sum(0), "data")[0]}
        if extra == "concatenated":
            return value, grads
        return value, grads

    params = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32), "b": jax.ShapeDtypeStruct((8,), jnp.float32)}
    shard = jax.shard_map(
        step, mesh=mesh, in_specs=({"w": P(), "b": P()}, P("data")), out_specs=(P(), {"w": P(), "b": P()})
    )
    return jax.jit(shard).lower(params, jax.ShapeDtypeStruct((64, 16), jnp.float32)).compile()


@pytest.mark.parametrize("extra", [None, "in the loss", "after the gradient"])
def test_attribution_of_hand_written_programs(mesh8: jax.sharding.Mesh, extra: str | None) -> None:
    report = census(_program(mesh8, extra), mesh=mesh8)
    expected = expected_communication(LEAVES, layout="replicated", mode="explicit")
    plain, attributed = compare(report, expected), compare(report, expected, attribute_model=True)
    assert plain.matches is (extra is None)
    assert attributed.matches is (extra != "after the gradient")
    if extra is not None:
        assert "f32[5]" in " ".join(plain.differences)  # the extra buffer, named
    if extra == "in the loss":
        assert [str(p.buffer) for p in attributed.model] == ["f32[5]"]
    if extra == "after the gradient":  # outside the differentiated loss: not the model's
        (difference,) = attributed.differences
        assert (
            "extra all-reduce" in difference and "f32[5] (20 B)" in difference and "20 B more" in difference
        )
        assert not attributed.model


def test_a_missing_buffer_is_named(mesh8: jax.sharding.Mesh) -> None:
    report = census(_program(mesh8, None), mesh=mesh8)
    expected = expected_communication(
        [*LEAVES, ("v", (5, 3), jnp.float32, False)], layout="replicated", mode="explicit"
    )
    matches, differences = compare(report, expected)
    assert not matches
    (difference,) = differences
    assert (
        "too little all-reduce" in difference
        and "(60 B short)" in difference
        and "v f32[5,3] (all-reduce, 60 B)" in difference
    )


def test_buffers_xla_concatenates_match(mesh8: jax.sharding.Mesh) -> None:
    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.lax.psum(jnp.concatenate([a.sum(0), b.sum(0)]), "data")

    spec = jax.ShapeDtypeStruct((64, 16), jnp.float32)
    compiled = (
        jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=(P("data"), P("data")), out_specs=P()))
        .lower(spec, spec)
        .compile()
    )
    report = census(compiled)
    leaves = [("a", (16,), jnp.float32, False), ("b", (16,), jnp.float32, False)]
    found = compare(
        report, expected_communication(leaves, layout="replicated", mode="explicit", loss_bytes=0)
    )
    assert found.matches, str(found)
    assert any("compiled combined differently, as f32[32]" in n for n in found.notes), str(found)
    np.testing.assert_equal(report.bytes("all-reduce"), 32 * F32)


def test_an_update_that_cannot_be_compiled_alone_falls_back_to_the_rule(
    mesh8: jax.sharding.Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    from substrax.census import _update as _step_census

    def fails(*args: Any) -> None:
        raise RuntimeError("no")

    monkeypatch.setattr(_step_census, "update_census", fails)
    model = MLP()
    optimizer = _state(model, mesh8, "zero1")
    step = substrax.make_train_step(mse, "explicit", mesh=mesh8, skip_nonfinite=False)
    found = step.census(model, optimizer, _batch(mesh8))
    assert found.matches, str(found)  # the rule's ZeRO-1 all-gather of each updated parameter
    assert any("could not be compiled alone (RuntimeError: no)" in n for n in found.notes)
    assert _sources(found)["update"] == sum(
        4 * int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)) if v.size >= 16
    )


# --- a scanned stack in implicit mode: each layer's gradient reduced inside the loop ----------


class _Block(nnx.Module):
    """Attention-like kernels (q and o 16x16, k 16x8: two shapes shared), an MLP (16x32, 32x16), a norm."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm = nnx.RMSNorm(16, rngs=rngs)
        self.q = nnx.Linear(16, 16, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(16, 8, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(16, 16, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(16, 32, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(32, 16, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm(x)
        k = self.k(h)
        att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", self.q(h), jnp.concatenate([k, k], -1)), -1)
        x = x + self.o(jnp.einsum("bts,bsd->btd", att, h))
        return x + self.down(jnp.tanh(self.up(x)))


class _ScannedLM(nnx.Module):
    """A token embedding (tied as the head, or a separate head), 3 ``_Block``s stacked by ``nnx.vmap``
    and applied by ``nnx.scan`` (under ``nnx.remat``), or by ``substrax.nn.scan_layers``."""

    def __init__(self, *, tied: bool, remat: bool, scan_layers: bool = False) -> None:
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(48, 16, rngs=rngs)
        self.blocks = stack(_Block, 3, rngs)
        self.head = None if tied else nnx.Linear(16, 48, use_bias=False, rngs=rngs)
        self.remat, self.scan_layers = remat, scan_layers

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if self.scan_layers:
            h = substrax.nn.scan_layers(self.blocks, self.embed(tokens), remat=self.remat)
        else:

            def body(h: jax.Array, block: _Block) -> tuple[jax.Array, None]:
                return block(h), None

            run = nnx.remat(body) if self.remat else body
            scan = nnx.scan(run, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
            h, _ = scan(self.embed(tokens), self.blocks)
        return self.embed.attend(h) if self.head is None else self.head(h)


def _next_token(model: _ScannedLM, batch: dict) -> jax.Array:
    logits = model(batch["t"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["t"][:, 1:]).mean()


def _scanned_census(
    mesh: jax.sharding.Mesh, layout: str, microbatches: int = 1, **kw: bool
) -> tuple[Comparison, _ScannedLM]:
    model = _ScannedLM(**kw)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    if layout != "replicated":
        substrax.shard_state(model, optimizer, mesh=mesh, layout=layout, min_size=64)
    tokens = np.random.default_rng(0).integers(0, 48, size=(16, 9)).astype(np.int32)
    batch = place_batch_on_shards({"t": tokens}, create_data_parallel_sharding(mesh))
    step = substrax.make_train_step(_next_token, "implicit", mesh=mesh, microbatches=microbatches)
    return step.check_communication(model, optimizer, batch), model


def _layer_shapes(model: nnx.Module) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Per parameter, the shapes a buffer of it may have: whole, and (a stack's) one layer."""
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = tuple(v.get_value().shape)
        name = "model" + "".join(f"[{k!r}]" for k in path)
        out[name] = (shape, shape[1:]) if "blocks" in path else (shape,)
    return out


def _fits(buffer: Any, shapes: tuple[tuple[int, ...], ...]) -> bool:
    return any(sorted(d for d in buffer.shape if d != 1) == sorted(d for d in s if d != 1) for s in shapes)


@pytest.mark.parametrize(
    ("layout", "variant"),
    [("replicated", "scan"), ("replicated", "remat"), ("replicated", "scan_layers"), ("fsdp", "remat")],
)
def test_a_scanned_models_implicit_census_says_only_what_the_program_says(
    mesh8: jax.sharding.Mesh, layout: str, variant: str
) -> None:
    """Each parameter named for a buffer of its shape (or one layer of it), no gradient-shaped
    reduction called the model's, and each too-little/extra sentence true to its own numbers."""
    found, model = _scanned_census(
        mesh8, layout, tied=True, remat=variant != "scan", scan_layers=variant == "scan_layers"
    )
    shapes = _layer_shapes(model)
    for item, parts in found.matched:
        if item.category in ("gradients", "parameters"):
            for p in parts:
                assert _fits(p.buffer, shapes[item.what]), f"{item.what} named for {p}\n{found}"
    for d in found.differences:  # "carrying X": X has the shape of one of the row's buffers
        if ", carrying " in d:
            row = next(r for r in found.report.rows if f"{r.kind} {r.name} (" in d)
            buffers = row.results if row.kind == "all-gather" else row.operands
            for name in shapes:
                if name in d.partition(", carrying ")[2].partition(", sits")[0]:
                    assert any(_fits(b, shapes[name]) for b in buffers), d
    matrices = [s for ss in shapes.values() for s in ss if sum(d > 1 for d in s) >= 2]
    for p in found.model:
        gradient_like = p.phase == "backward" and _fits(p.buffer, tuple(matrices))
        assert not gradient_like, f"{p} called the model's\n{found}"
    for d in found.differences:
        counts = r": compiled ([\d,]+) B per step, expected ([\d,]+) B \(([\d,]+) B "
        short = re.search(r"too little .*?" + counts + r"short\)", d)
        more = re.search(r"extra .*?" + counts + r"more\)", d)
        if short:
            got, want, gap = (int(g.replace(",", "")) for g in short.groups())
            assert want - got == gap > 0, d
        if more:
            got, want, gap = (int(g.replace(",", "")) for g in more.groups())
            assert got - want == gap > 0, d
        assert "too little" not in d or short, d
    # the tied embedding: XLA reduces its two uses' gradients apart, each at its full size (measured)
    if layout == "replicated":
        (extra,) = found.unexpected
        assert str(extra.buffer) == "f32[48,16]" and "the shape of model['embed']['embedding']" in str(found)


@pytest.mark.parametrize("variant", ["scan", "remat"])
def test_a_scanned_stacks_per_layer_gradient_reduction_matches_the_rule(
    mesh8: jax.sharding.Mesh, variant: str
) -> None:
    """XLA reduces each layer's gradient inside the backward loop, one layer per iteration: the
    rule's bytes, in the scanned stack's loop. It matches, and a note says so."""
    found, model = _scanned_census(mesh8, "replicated", tied=False, remat=variant == "remat")
    assert found.matches, str(found)
    stacked = [i for i, _ in found.matched if i.what.startswith("model['blocks']")]
    assert stacked and all(i.in_loop for i in stacked)
    for item, (part,) in ((i, ps) for i, ps in found.matched if i in stacked):
        assert part.row.trip_count == 3 and part.bytes * 3 == item.bytes and part.phase == "backward"
    assert any("one layer per iteration, inside a loop of 3" in n for n in found.notes), str(found)
    # q and o share a shape: which buffer is which the program does not say, and the note says so
    assert any("['q']['kernel']" in n and "by shape alone" in n for n in found.notes), str(found)
    assert not found.model, str(found)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert _sources(found)["gradients"] == sum(4 * v.size for v in params)


def test_a_scanned_stack_under_microbatches_is_the_layers_gradients_in_both_loops(
    mesh8: jax.sharding.Mesh,
) -> None:
    """With 2 microbatches each layer's gradient is reduced once per layer and microbatch (6 times): not
    the rule's bytes, a difference; still each layer's gradient, never the model's."""
    found, _ = _scanned_census(mesh8, "replicated", microbatches=2, tied=False, remat=False)
    assert not found.matches
    q = "model['blocks']['q']['kernel']"
    assert any("runs 6 times per step" in d and q in d for d in found.differences), str(found)
    assert not any("one layer per iteration" in n for n in found.notes), str(found)
    stacked = [ps for i, ps in found.matched if i.what.startswith("model['blocks']")]
    assert stacked and all(len(ps) == 1 and ps[0].row.trip_count == 6 for ps in stacked), str(found)
    assert not [p for p in found.model if p.phase == "backward"], str(found)
