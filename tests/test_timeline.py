"""``substrax.timeline``: the pieces of a step's predicted time, on programs compiled here (CPU) and
on HLO written out, each held to its formula worked by hand (NumPy)."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mse
from jax.sharding import PartitionSpec as P
from models import abstract_batch, abstract_mlp

import substrax
from substrax.mesh import create_device_mesh
from substrax.timeline import TARGETS, Target, predict, target_of

V5E = TARGETS["v5e"]


def _compiled(fn, *shapes):
    return jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes)).compile()


def test_a_matrix_product_costs_its_flops_or_its_bytes_whichever_is_longer() -> None:
    """In float32: jax 0.11's CPU compiler writes a bfloat16 product as float32 between two converts."""
    m, k, n = 256, 512, 128
    timeline = predict(_compiled(jnp.matmul, ((m, k), jnp.float32), ((k, n), jnp.float32)), target="v5e")
    flops = 2 * m * k * n
    moved = 4 * (m * k + k * n + m * n)  # f32 operands and result, once
    assert timeline.flops == flops
    assert timeline.compute_seconds == pytest.approx(max(flops / V5E.f32_flops, moved / V5E.hbm_bytes_per_s))
    assert timeline.communication_seconds == timeline.exposed_seconds == 0
    assert timeline.step_seconds == timeline.compute_seconds


@pytest.mark.parametrize(
    ("window", "padding", "strides", "lhs_dilation"),
    [
        ((32,), ((31, 31),), (1,), (1,)),  # the TPU's matrix product over heads: one tap in 32 on input
        ((3, 5), ((1, 1), (2, 0)), (1, 2), (1, 1)),
        ((7,), ((3, 3),), (1,), (2,)),  # a dilated input's holes
    ],
)
def test_a_convolution_counts_the_taps_that_meet_input_not_padding(
    window, padding, strides, lhs_dilation
) -> None:
    """Against the convolution of ones (each result element: the features times its taps on input)."""
    spatial = (1,) if window == (32,) else (9, 8) if len(window) == 2 else (4,)
    lhs, rhs = (2, 16, *spatial), (8, 16, *window)

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, strides, padding, lhs_dilation=lhs_dilation)

    ones = conv(jnp.ones(lhs, jnp.float32), jnp.ones(rhs, jnp.float32))
    timeline = predict(_compiled(conv, (lhs, jnp.float32), (rhs, jnp.float32)), target="v5e")
    assert timeline.flops == pytest.approx(2 * float(ones.sum()))


def test_a_float32_product_runs_at_the_targets_float32_rate() -> None:
    m = k = n = 1024  # large enough to be bound by the matrix units on an H100
    timeline = predict(_compiled(jnp.matmul, ((m, k), jnp.float32), ((k, n), jnp.float32)), target="h100")
    h100 = TARGETS["h100"]
    assert timeline.compute_seconds == pytest.approx(2 * m * k * n / h100.f32_flops)
    assert h100.f32_flops == h100.flops / 2  # TF32


def test_a_loops_body_counts_its_trip_count_times() -> None:
    def looped(a, b):
        return jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ b), a)

    shapes = ((64, 128), jnp.float32), ((128, 128), jnp.float32)
    once = predict(_compiled(lambda a, b: jnp.tanh(a @ b), *shapes), target="v5e")
    five = predict(_compiled(looped, *shapes), target="v5e")
    assert five.flops == pytest.approx(5 * once.flops, rel=0.02)  # the loop's counter adds a few
    assert five.compute_seconds >= 5 * 2 * 64 * 128 * 128 / V5E.f32_flops
    assert not five.notes


@pytest.mark.parametrize("kind", ["psum", "all_gather", "psum_scatter"])
def test_a_collective_takes_its_kinds_share_of_its_bytes_at_the_links_bandwidth(kind: str) -> None:
    mesh = create_device_mesh({"data": 8})
    op = {
        "psum": lambda x: jax.lax.psum(x, "data"),
        "all_gather": lambda x: jax.lax.all_gather(x, "data", tiled=True),
        "psum_scatter": lambda x: jax.lax.psum_scatter(x, "data", tiled=True),
    }[kind]
    fn = jax.shard_map(op, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(jax.ShapeDtypeStruct((8 * 1024, 64), jnp.float32)).compile()
    timeline = predict(compiled, mesh=mesh, target="v5e")
    (row,) = substrax.census(compiled, mesh=mesh).rows
    share = {"psum": 2 * 7 / 8, "all_gather": 7 / 8, "psum_scatter": 7 / 8}[kind]  # ring, n = 8
    assert row.group_size == 8
    assert timeline.communication_seconds == pytest.approx(share * row.bytes / V5E.links["ici"])
    assert timeline.exposed_seconds == pytest.approx(timeline.communication_seconds)  # synchronous
    assert timeline.step_seconds == pytest.approx(timeline.compute_seconds + timeline.exposed_seconds)


# An asynchronous all-gather started before a product and done after it: hidden behind it up to
# the product's length. Written out (XLA's CPU compiler runs collectives synchronously).
ASYNC = """HloModule overlap, num_partitions=4

%fused_dot (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %dot.1 = bf16[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[1024,1024], b: bf16[1024,1024], w: f32[SHARD]) -> (bf16[1024,1024], f32[FULL]) {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %b = bf16[1024,1024]{1,0} parameter(1)
  %w = f32[SHARD]{0} parameter(2)
  %gather = (f32[SHARD]{0}, f32[FULL]{0}) all-gather-start(%w), replica_groups={{0,1,2,3}}, dimensions={0}
  %fusion = bf16[1024,1024]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
  %all-gather-done = f32[FULL]{0} all-gather-done(%gather)
  ROOT %tuple = (bf16[1024,1024]{1,0}, f32[FULL]{0}) tuple(%fusion, %all-gather-done)
}
"""


@pytest.mark.parametrize("elements", [1 << 16, 1 << 24])
def test_an_asynchronous_collective_hides_behind_the_compute_between_its_start_and_done(
    elements: int,
) -> None:
    text = ASYNC.replace("SHARD", str(elements // 4)).replace("FULL", str(elements))
    timeline = predict(text, target="v5e")
    dot = max(2 * 1024**3 / V5E.flops, 3 * 2 * 1024**2 / V5E.hbm_bytes_per_s)
    gather = 3 / 4 * elements * 4 / V5E.links["ici"]
    assert timeline.compute_seconds == pytest.approx(dot)
    assert timeline.communication_seconds == pytest.approx(gather)
    assert timeline.exposed_seconds == pytest.approx(max(0.0, gather - dot))
    assert timeline.step_seconds == pytest.approx(max(dot, gather))
    (event,) = timeline.collectives()
    assert (
        event.kind == "all-gather"
        and event.lane == "ici"
        and event.exposed == pytest.approx(max(0, gather - dot))
    )


def test_the_chrome_trace_has_a_track_for_the_compute_and_one_per_link(tmp_path) -> None:
    text = ASYNC.replace("SHARD", str(1 << 22)).replace("FULL", str(1 << 24))
    timeline = predict(text, target="v5e")
    path = timeline.write_trace(str(tmp_path / "step.json"), title="overlap")
    trace = json.loads(open(path).read())
    threads = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert set(threads) == {"compute", "ici"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_name = {e["name"]: e for e in spans}
    assert by_name["fusion"]["tid"] == threads["compute"] and by_name["gather"]["tid"] == threads["ici"]
    assert by_name["gather"]["dur"] == pytest.approx(timeline.communication_seconds * 1e6)
    assert by_name["gather"]["ts"] == 0 and by_name["fusion"]["ts"] == 0  # side by side
    assert all({"ph", "pid", "tid", "ts", "dur", "name"} <= set(e) for e in spans)


def test_the_targets_numbers_have_sources_and_can_be_overridden() -> None:
    assert {"v4", "v5e", "v5p", "v6e", "a100", "h100", "h200", "b200"} <= set(TARGETS)
    for target in TARGETS.values():
        assert target.sources and target.flops > 0 and target.hbm_bytes_per_s > 0
        assert set(target.links) <= set(substrax.timeline.LINKS)
    assert V5E.flops == 197e12 and V5E.hbm_bytes_per_s == 819e9
    slower = dataclasses.replace(V5E, hbm_bytes_per_s=V5E.hbm_bytes_per_s / 2)
    shapes = ((4096, 64), jnp.float32), ((64, 64), jnp.float32)  # bound by memory on a v5e
    fast, slow = (predict(_compiled(jnp.matmul, *shapes), target=t) for t in (V5E, slower))
    assert slow.compute_seconds == pytest.approx(2 * fast.compute_seconds)


def test_bad_targets_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown target 'v9': name one of \['a100', "):
        target_of(None, "v9")
    with pytest.raises(TypeError, match=r"target= takes a Target, one of .* or None; got 3"):
        target_of(None, 3)
    with pytest.raises(ValueError, match=r"has no 'dcn' link; it has \['network', 'nvlink'\]"):
        TARGETS["h100"].link("dcn")
    compiled = _compiled(jnp.matmul, ((4, 4), jnp.float32), ((4, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"no Target for these devices \(a CPU's\).*Pass target="):
        predict(compiled)
    assert target_of(compiled.input_shardings[0][0].device_set.pop()) is None
    assert isinstance(target_of(None, "H100"), Target)


def test_every_collective_kind_has_an_algorithm() -> None:
    from substrax.timeline._links import collective_seconds

    @dataclasses.dataclass
    class Row:
        kind: str
        bytes: int
        group_size: int | None

    n, size, bandwidth = 16, 1 << 20, 1e9
    want = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n,
            "all-to-all": (n - 1) / n, "collective-permute": 1.0, "send": 1.0, "recv": 1.0}  # fmt: skip
    for kind, share in want.items():
        assert collective_seconds(Row(kind, size, n), bandwidth) == pytest.approx(share * size / bandwidth)
    assert collective_seconds(Row("all-reduce", size, None), bandwidth, devices=4) == pytest.approx(
        1.5 * size / bandwidth
    )
    assert math.isclose(np.float64(collective_seconds(Row("all-gather", size, 1), bandwidth)), 0.0)


def _row(layout: str, step: float | None, total: int, temp: int, **extra) -> substrax.PlanRow:
    return substrax.PlanRow(
        mode="explicit", layout=layout, units="-", mesh="data=8", bytes={("all-gather", "data"): total},
        optional_bytes=0, state_bytes=1000, batch_bytes=0, temp_bytes=temp, device_bytes=10_000,
        step_seconds=step, compute_seconds=step, exposed_seconds=0.0 if step else None, **extra,
    )  # fmt: skip


def test_best_takes_the_least_step_seconds_among_the_rows_that_fit_then_the_smaller_peak() -> None:
    rows = (_row("replicated", 0.010, 0, 20_000), _row("zero1", 0.030, 50, 100),
            _row("fsdp", 0.020, 900, 5_000), _row("hsdp", 0.020, 100, 3_000))  # fmt: skip
    plan = substrax.Plan(rows)
    assert plan.best().layout == "hsdp"  # fastest of those that fit, tied with fsdp: the smaller peak
    assert plan.best(memory=2_000).layout == "zero1"
    assert plan.best(bandwidth=1e9).layout == "zero1"  # communication alone, as asked
    # without seconds (estimated on the CPU): the fewest bytes, a tie to the smaller peak
    untimed = substrax.Plan(tuple(dataclasses.replace(r, step_seconds=None) for r in rows[1:]))
    assert untimed.best().layout == "zero1"
    tied = substrax.Plan((_row("zero1", None, 50, 4_000), _row("fsdp", None, 50, 100)))
    assert tied.best().layout == "fsdp"  # before: the first of the tie, zero1, whatever its peak


def test_a_rows_one_line_says_what_fits_its_step_mfu_and_what_is_exposed() -> None:
    row = dataclasses.replace(
        _row("fsdp", 0.41, 10, 10_000_000_000),
        units="Block",
        mfu=0.52,
        exposed_seconds=0.012,
        device_bytes=16_909_336_064,
        compiler="tpu (compiled)",
    )
    assert str(row) == (
        "explicit fsdp, units=Block, on data=8: fits 9.31 of 15.75 GiB; ~410 ms a step; MFU 0.52; "
        "12 ms of communication exposed"
    )
    plan = substrax.Plan((row,))
    assert plan.summary() == str(row)
    head, _, line = [[c.strip() for c in s.split(" | ")] for s in str(plan).splitlines()]
    assert head[-5:] == ["peak GiB (compiled)", "fits", "step ms", "MFU", "exposed ms"]
    assert line[-5:] == ["9.31", "yes", "410", "0.52", "12"]
    slow = substrax.Plan((dataclasses.replace(row, step_seconds=1.8612),))
    assert [c.strip() for c in str(slow).splitlines()[2].split(" | ")][-3] == "1,861"  # not 1.86e+03
    cpu = _row("fsdp", None, 10, 100)
    assert "no seconds: estimated on the CPU" in str(cpu) and "step ms" not in str(substrax.Plan((cpu,)))


# One layer of a stacked [64, 4096, 1024] buffer read through a nested fusion's dynamic-slice, as
# the TPU reads a scanned stack's saved activations in the backward loop: the layer's bytes, not
# the stack's (before: the whole stack each time, 64x; a 31M scanned model came out at 1.71x its
# step on the chip).
NESTED = """HloModule nested, num_partitions=1

%inner (q0: f32[64,4096,1024], q1: s32[]) -> f32[1,4096,1024] {
  %q0 = f32[64,4096,1024]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,4096,1024]{2,1,0} dynamic-slice(%q0, %q1, %zero, %zero), dynamic_slice_sizes={1,4096,1024}
}

%outer (p0: f32[64,4096,1024], p1: s32[]) -> f32[1,4096,1024] {
  %p0 = f32[64,4096,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %layer = f32[1,4096,1024]{2,1,0} fusion(%p0, %p1), kind=kLoop, calls=%inner
  ROOT %twice = f32[1,4096,1024]{2,1,0} add(%layer, %layer)
}

ENTRY %main (stack: f32[64,4096,1024], i: s32[]) -> f32[1,4096,1024] {
  %stack = f32[64,4096,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %fusion = f32[1,4096,1024]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%outer
}
"""


def test_a_fusion_that_slices_an_operand_in_a_nested_fusion_reads_the_slice() -> None:
    layer = 4096 * 1024 * 4
    timeline = predict(NESTED, target="v5e")
    (event,) = [e for e in timeline.events if e.name == "fusion"]
    assert event.bytes == layer + layer + 4  # the slice read, the result written, the index
    assert timeline.compute_seconds == pytest.approx(event.bytes / V5E.hbm_bytes_per_s)


def test_a_refused_rows_line_says_the_compiler_refused_it() -> None:
    """Before: "does not fit 28.5 of 15.75 GiB; 0 B of collectives a step (no seconds: estimated on
    the CPU)" for a TinyLlama-shaped model's replicated row the TPU compiler refused."""
    row = dataclasses.replace(
        _row("replicated", None, 0, 16 * 2**30), compiler="tpu (compiled)", bytes={},
        refused="RESOURCE_EXHAUSTED: ... Ran out of memory on HBM", device_bytes=16_909_336_064,
    )  # fmt: skip
    assert str(row) == (
        "explicit replicated, on data=8: does not fit: the TPU compiler refused it, needing ~16 of 15.75 GiB"
    )


def test_plan_predicts_a_compiled_row_on_the_target_it_is_given() -> None:
    """A CPU's program has no target of its own; target= names one (here: the CPU program's
    operations timed at an H100's numbers, as a user overriding the table would)."""
    mesh = create_device_mesh({"data": 8})
    args = (mse, *abstract_mlp(16, 64, 16), abstract_batch(64, 16, 16))
    (cpu,) = substrax.plan(*args, mesh=mesh, layouts=["fsdp"], compiled=True).rows
    assert cpu.compiler.endswith("(compiled)") and cpu.step_seconds is None and cpu.timeline is None
    slow = dataclasses.replace(TARGETS["h100"], links={"nvlink": 1e9, "network": 1e8})
    (row,) = substrax.plan(*args, mesh=mesh, layouts=["fsdp"], compiled=True, target=slow).rows
    assert row.timeline.target is slow and row.communication_seconds > 0 and 0 < row.mfu <= 1
    assert row.communication_seconds == pytest.approx(
        sum(e.seconds for e in row.timeline.events if e.lane == "nvlink")
    )
