"""The step census accounts for what the library adds and what the model issues itself.

A BatchNorm model's step communicates more than its gradients and loss: the explicit
step averages the running statistics of a BatchNorm without ``axis_name``; a BatchNorm
with ``axis_name`` ``pmean``-s its batch statistics in the forward pass (and their
transposes run in the backward pass); in implicit mode XLA all-reduces the global
batch's statistics. The census attributes each buffer, from the operation names XLA
keeps in the compiled HLO, and still catches a buffer the library reduces twice.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models import MLP, mse, regression_batches

import substrax
from substrax.census import Comparison, census, compare, expected_communication, library_scope, phase_of
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards

F32 = 4


class Normed(nnx.Module):
    """Linear, BatchNorm (16 features), Linear: 129 parameters, 32 statistics."""

    def __init__(self, axis_name: str | None = None) -> None:
        rngs = nnx.Rngs(0)
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.5, axis_name=axis_name, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.norm(self.hidden(x)))


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
    model = Normed(axis_name)
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
    text = """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (a: f32[4], b: f32[]) -> (f32[4], f32[]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[] parameter(1)
  ROOT %ar = (f32[4]{0}, f32[]) all-reduce(%a, %b), replica_groups={}, to_apply=%add, metadata={op_name="jit(s)/shard_map/(transpose(jvp())/psum:jvp(substrax.loss)/psum)"}
}
"""
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
    model = Normed("data")
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
    from substrax.census import _step as _step_census

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
