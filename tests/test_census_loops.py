"""The trip count of a ``while`` loop read from the program (``substrax.census._hlo.trip_count``).

The TPU compiler states no ``known_trip_count``: its scanned stacks and pipeline schedules read
"loop x?" and counted once until the count was read from the loop itself (issue 61, item 1).
The texts below are written as the TPU compiler prints such a loop (measured, jax 0.12.1 and
libtpu: an ``nnx.scan`` over 4 layers): the counter a copy of a constant, stepped in the body
by a sunk constant, compared with a constant in the condition.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP, mse

import substrax
from substrax.census import census
from substrax.census._hlo import parse_module, trip_count
from substrax.mesh import create_device_mesh

F32 = 4


def _loop(
    *,
    start: str = "0",
    step: str = "1",
    bound: str = "4",
    direction: str = "LT",
    stepped: str = "add",
    swapped: bool = False,
    fused: bool = False,
    stated: int | None = None,
) -> str:
    """A TPU-style HLO module whose while loop gathers once per iteration."""
    compare = "%bound, %n" if swapped else "%n, %bound"
    if fused:
        condition = f"""\
%fused_lt (p0: s32[], p1: s32[]) -> pred[] {{
  %p0 = s32[] parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %lt.in = pred[] compare(%{"p1, %p0" if swapped else "p0, %p1"}), direction={direction}
}}

%cond (c: (s32[], f32[2,4])) -> pred[] {{
  %bound = s32[]{{:T(128)}} constant({bound})
  %c = (s32[]{{:T(128)}}, f32[2,4]{{1,0}}) parameter(0)
  %n = s32[]{{:T(128)}} get-tuple-element(%c), index=0
  ROOT %lt = pred[] fusion(%n, %bound), kind=kLoop, calls=%fused_lt
}}
"""
    else:
        condition = f"""\
%cond (c: (s32[], f32[2,4])) -> pred[] {{
  %bound = s32[]{{:T(128)}} constant({bound})
  %c = (s32[]{{:T(128)}}, f32[2,4]{{1,0}}) parameter(0)
  %n = s32[]{{:T(128)}} get-tuple-element(%c), index=0
  ROOT %lt = pred[]{{:T(512)}} compare({compare}), direction={direction}
}}
"""
    config = f', backend_config={{"known_trip_count":{{"n":"{stated}"}}}}' if stated is not None else ""
    return f"""\
HloModule loop, num_partitions=8

%body (t: (s32[], f32[2,4])) -> (s32[], f32[2,4]) {{
  %t = (s32[]{{:T(128)}}, f32[2,4]{{1,0}}) parameter(0)
  %i = s32[]{{:T(128)}} get-tuple-element(%t), index=0
  %i.copy = s32[]{{:T(128)S(6)}} copy(%i)
  %v = f32[2,4]{{1,0}} get-tuple-element(%t), index=1
  %g = f32[16,4]{{1,0}} all-gather(%v), channel_id=1, replica_groups=[1,8]<=[8], dimensions={{0}}
  %s = f32[2,4]{{1,0}} slice(%g), slice={{[0:2], [0:4]}}
  %one.sunk = s32[]{{:T(128)}} constant({step})
  %next = s32[]{{:T(128)}} {stepped}(%i.copy, %one.sunk)
  ROOT %out = (s32[]{{:T(128)}}, f32[2,4]{{1,0}}) tuple(%next, %s)
}}

{condition}
ENTRY %main (w: f32[2,4]) -> f32[2,4] {{
  %w = f32[2,4]{{1,0}} parameter(0)
  %zero = s32[]{{:T(128)}} constant({start})
  %zero.copy = s32[]{{:T(128)}} copy(%zero)
  %init = (s32[]{{:T(128)}}, f32[2,4]{{1,0}}) tuple(%zero.copy, %w)
  %loop = (s32[]{{:T(128)}}, f32[2,4]{{1,0}}) while(%init), condition=%cond, body=%body{config}
  ROOT %r = f32[2,4]{{1,0}} get-tuple-element(%loop), index=1
}}
"""


def _count(text: str) -> int | None:
    module = parse_module(text)
    (loop,) = [i for c in module.computations.values() for i in c.instructions if i.opcode == "while"]
    return trip_count(module, loop)


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        ({}, 4),  # the TPU's scan: 0, 1, 2, 3 < 4
        ({"fused": True}, 4),  # the compare inside a fusion the condition calls
        ({"swapped": True, "direction": "GT"}, 4),  # 4 > n
        ({"start": "3", "step": "-1", "bound": "0", "direction": "GE"}, 4),  # 3, 2, 1, 0 >= 0
        ({"start": "3", "step": "1", "bound": "0", "direction": "GE", "stepped": "subtract"}, 4),
        ({"step": "2", "bound": "7"}, 4),  # 0, 2, 4, 6 < 7
        ({"bound": "3", "direction": "LE"}, 4),  # 0, 1, 2, 3 <= 3
        ({"bound": "4", "direction": "NE"}, 4),
        ({"start": "5"}, 0),  # never entered
        ({"stated": 7}, 7),  # the compiler's own count, where stated, is taken as it is
        ({"step": "-1"}, None),  # counting away from its bound: not a count
        ({"bound": "5", "step": "2", "direction": "NE"}, None),  # steps over its bound
        ({"direction": "EQ"}, None),
    ],
)
def test_the_trip_count_is_read_from_the_loop(kwargs: dict, want: int | None) -> None:
    assert _count(_loop(**kwargs)) == want


def test_a_census_multiplies_a_loop_the_tpu_states_no_count_for() -> None:
    """Before: ``trip_counts == (None,)``, "loop x?", its bytes counted once."""
    (row,) = census(_loop()).rows
    assert row.trip_counts == (4,) and row.bytes_per_step == 4 * 16 * 4 * F32
    assert "loop x4" in str(census(_loop()))


def test_a_bound_carried_in_the_loop_is_read_from_its_start() -> None:
    """``fori_loop`` with its bound in the tuple: the body passes it on, the while's operand starts it."""
    text = (
        _loop()
        .replace("(s32[], f32[2,4])", "(s32[], f32[2,4], s32[])")
        .replace("(s32[]{:T(128)}, f32[2,4]{1,0})", "(s32[]{:T(128)}, f32[2,4]{1,0}, s32[])")
        .replace("  %bound = s32[]{:T(128)} constant(4)\n", "")
        .replace(
            "  %n = s32[]{:T(128)} get-tuple-element(%c), index=0\n",
            "  %n = s32[]{:T(128)} get-tuple-element(%c), index=0\n"
            "  %bound = s32[] get-tuple-element(%c), index=2\n",
        )
        .replace("tuple(%next, %s)", "tuple(%next, %s, %b)")
        .replace(
            "  %v = f32[2,4]{1,0} get-tuple-element(%t), index=1\n",
            "  %v = f32[2,4]{1,0} get-tuple-element(%t), index=1\n"
            "  %b = s32[] get-tuple-element(%t), index=2\n",
        )
        .replace("tuple(%zero.copy, %w)", "tuple(%zero.copy, %w, %six)")
        .replace("  %zero.copy", "  %six = s32[] constant(6)\n  %zero.copy")
    )
    assert _count(text) == 6
    changed = text.replace("tuple(%next, %s, %b)", "tuple(%next, %s, %next)")  # the bound moves
    assert _count(changed) is None


def test_trip_count_takes_a_while() -> None:
    module = parse_module(_loop())
    with pytest.raises(ValueError, match="takes a while instruction, not parameter"):
        trip_count(module, module.computations[module.entry].instructions[0])


def _looping(model: MLP, batch: dict) -> jax.Array:
    """``mse`` and a psum over ``data`` in a loop whose trip count depends on the batch."""
    loss = mse(model, batch)
    n = 2 + (jnp.sum(batch["x"]) > 1e9).astype(jnp.int32)
    body = lambda c: (c[0] + 1, c[1] + jax.lax.psum(c[1], "data"))  # noqa: E731
    _, summed = jax.lax.while_loop(lambda c: c[0] < n, body, (0, jax.lax.stop_gradient(loss)))
    return loss + 0.0 * summed


def test_a_loop_of_unknown_trip_count_is_never_counted_once_in_silence() -> None:
    """The census names it (``uncounted``, "at least"), the comparison notes it, the plan notes and warns."""
    mesh = create_device_mesh({"data": 8})
    model = MLP(4, 8, 1)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 4)).astype(np.float32), "y": np.zeros((16, 1), np.float32)}
    with pytest.warns(UserWarning, match="inside loops whose trip count the program does not show"):
        (row,) = substrax.plan(
            _looping, model, optimizer, batch, mesh=mesh, layouts=["replicated"], compiled=True
        ).rows
    assert any("total_bytes is a lower bound" in n for n in row.notes)
    substrax.shard_state(model, optimizer, mesh=mesh, layout="replicated")
    found = substrax.make_train_step(_looping, "explicit", mesh=mesh).check_communication(
        model, optimizer, batch
    )
    (loop,) = found.report.uncounted()
    assert loop.kind == "all-reduce" and loop.trip_counts == (None,)
    assert "at least: 1 of them inside loops" in str(found.report) and "loop x? (counted once)" in str(
        found.report
    )
    # the model's own psum: accepted (the model's communication is its own), and noted
    assert any("inside a loop whose trip count the program does not show" in n for n in found.notes)


def test_the_cpu_compilers_stated_counts_are_read_back_from_its_loops() -> None:
    """One reader for all three compilers: a CPU program's loops (a scan of 5, inside it one of 3)
    read the same with their ``known_trip_count`` taken out of the text."""
    mesh = create_device_mesh({"data": 8})

    def inner(x: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, 3, lambda i, v: v + jax.lax.psum(v, "data"), x)

    def f(x: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=5)[0]

    mapped = jax.shard_map(f, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))
    text = jax.jit(mapped).lower(jnp.ones((8, 4))).compile().as_text()
    stripped = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
    assert "known_trip_count" in text and "known_trip_count" not in stripped
    stated, read = (census(t).rows for t in (text, stripped))
    assert [r.trip_counts for r in read] == [r.trip_counts for r in stated] == [(5, 3)]
