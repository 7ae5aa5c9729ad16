"""The census of a pipelined step (#54 item 4, #63 item 4): each schedule's permutes per tick between
neighbouring stages, the sums over ``stage`` once per step, the gradients over ``data`` once
per step, held against the compiled program.

The model: an embedding, 8 residual layers stacked by ``nnx.vmap`` (a column-parallel and a
row-parallel linear: split over ``model`` on a mesh with it) applied by
``substrax.nn.scan_layers`` with a gate computed from a parameter (an argument that travels
with the carry, its gradient summed over the stages), then a head. Explicit mode: the census
matches, its permutes' bytes are the carry's (computed here from the shapes) times the
ticks, each sent one stage on (forward) or back (backward). Implicit mode: XLA writes the
permutes; the census finds the carry's forward and backward ones in every loop of the
schedule and reports the rest as XLA chose it.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
import pytest
from flax import nnx
from models import Residual, Tower, mse, sine_batches

import substrax
from substrax._shared.schedule import chunk_rounds
from substrax.census import compare
from substrax.census._hlo import pair_shift
from substrax.mesh import create_device_mesh

DEPTH, WIDTH, ROWS = 8, 8, 32
F32 = 4


class Net(Tower):
    def __init__(self, depth: int = DEPTH, width: int = WIDTH) -> None:
        super().__init__(Residual, depth, width, gate=True)


def batch() -> dict:
    return sine_batches(1, ROWS)[0]


@dataclasses.dataclass(frozen=True)
class Case:
    schedule: str
    mesh: tuple[tuple[str, int], ...]
    layout: str
    microbatches: int
    chunks: int = 1  # interleaved: a stack of DEPTH * chunks layers, this many chunks a stage

    def __str__(self) -> str:
        return (
            f"{self.schedule}-{'-'.join(f'{a}{n}' for a, n in self.mesh)}-{self.layout}-k{self.microbatches}"
        )


EXPLICIT = [
    Case("gpipe", (("data", 2), ("stage", 4)), "units", 4),
    Case("1f1b", (("data", 2), ("stage", 4)), "units", 8),
    Case("gpipe", (("data", 2), ("stage", 2), ("model", 2)), "replicated", 8),
    Case("1f1b", (("data", 1), ("stage", 8)), "replicated", 8),
    Case("zb-h1", (("data", 2), ("stage", 4)), "units", 8),
    Case("zb-h1", (("data", 1), ("stage", 8)), "replicated", 4),
]
IMPLICIT = [Case(s, (("data", 2), ("stage", 4)), "replicated", 4) for s in ("gpipe", "1f1b")]
INTERLEAVED = [
    Case("interleaved-1f1b", (("data", 2), ("stage", 4)), "units", 8, 2),
    Case("interleaved-1f1b", (("data", 1), ("stage", 8)), "replicated", 8, 2),
    Case("interleaved-1f1b", (("data", 2), ("stage", 2), ("model", 2)), "replicated", 4, 3),
]
_RESULTS: dict[tuple[str, Case], object] = {}
_MODELS: dict[tuple[str, Case], nnx.Module] = {}


def checked(mode: str, case: Case):  # noqa: ANN201
    """The step's ``check_communication`` for ``case`` (compiled once per module)."""
    if (mode, case) not in _RESULTS:
        mesh = create_device_mesh(dict(case.mesh))
        with jax.set_mesh(mesh):
            model = Net(DEPTH * case.chunks)
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        units = Residual if case.layout == "units" else None
        layout = "fsdp" if units else case.layout
        substrax.shard_state(
            model, optimizer, mesh=mesh, layout=layout, units=units, stages=Residual, min_size=1,
            virtual_stages=case.chunks,
        )  # fmt: skip
        _MODELS[mode, case] = model
        step = substrax.make_train_step(
            mse, mode, mesh=mesh, microbatches=case.microbatches, schedule=case.schedule
        )
        _RESULTS[mode, case] = step.check_communication(model, optimizer, batch())
    return _RESULTS[mode, case]


def loops(schedule: substrax.PipelineSchedule) -> list[tuple[int, int]]:
    """``(ticks, direction)`` per loop and permute: GPipe's forward loop sends on, its transpose back;
    1F1B's (and ZB-H1's) warm-up sends on, its steady state both ways, its cool-down back (ZB-H1's
    weight slots send nothing)."""
    if schedule.name == "gpipe":
        return [(schedule.ticks, 1), (schedule.ticks, -1)]
    out = []
    for start, stop, forward, backward, _ in schedule.phases:
        out += [(stop - start, 1)] * forward + [(stop - start, -1)] * backward
    return out


@pytest.mark.parametrize("case", EXPLICIT, ids=str)
def test_explicit_census_matches_each_schedule(case: Case) -> None:
    found = checked("explicit", case)
    assert found.matches, str(found)
    sizes = dict(case.mesh)
    schedule = substrax.PipelineSchedule(case.schedule, sizes["stage"], case.microbatches)
    rows = ROWS // case.microbatches // sizes["data"]  # one microbatch's rows on one device
    carry = rows * WIDTH * F32  # the stack's input; the gate (WIDTH floats) travels with it
    permutes = [r for r in found.report.rows if r.kind == "collective-permute"]
    assert {r.axes for r in permutes} == {("stage",)}
    assert {r.shift for r in permutes} == {1, -1}
    # per loop and direction: the carry's permute, as often as the loop has ticks (1F1B's
    # cool-down of one tick sends a cotangent nothing reads: XLA may drop it)
    want = sorted((n, shift, carry) for n, shift in loops(schedule) if not (n == 1 and shift == -1))
    got = sorted((r.trip_count or 1, r.shift, r.bytes) for r in permutes if r.bytes == carry)
    assert [w for w in want if w not in got] == [], (want, got)
    assert {r.bytes for r in permutes} <= {carry, WIDTH * F32}
    # the gradients' reductions over data and the sums over stage: outside every loop, once per step
    once = [r for r in found.report.rows if r.kind != "collective-permute" and "model" not in (r.axes or ())]
    assert all(not r.in_loop or "substrax.unit" in r.op_name for r in once), [
        str(r) for r in once if r.in_loop
    ]
    pipeline = [i for i, _ in found.matched if i.category == "pipeline" and i.kind == "all-reduce"]
    outside = (
        4 * WIDTH + WIDTH + WIDTH + WIDTH + 1
    ) * F32  # embed, gate, head: the parameters outside the stack
    assert sum(i.bytes for i in pipeline) == outside
    assert any(n.startswith(f"pipeline: {case.schedule} over {sizes['stage']} stages") for n in found.notes)


@pytest.mark.parametrize("case", IMPLICIT, ids=str)
def test_implicit_census_finds_the_permutes_xla_wrote(case: Case) -> None:
    found = checked("implicit", case)
    schedule = substrax.PipelineSchedule(case.schedule, 4, case.microbatches)
    carry = ROWS // case.microbatches // 2 * WIDTH * F32
    rows = [r for r in found.report.rows if r.kind == "collective-permute"]
    assert {r.axes for r in rows} == {("stage",)}
    runs = sorted((r.trip_count or 1) for r in rows if r.bytes == carry)
    for n, _ in loops(schedule):  # each loop's carry (on) and cotangent (back) moves every tick
        assert n in runs, (n, runs)
        runs.remove(n)
    permutes = [(i, parts) for i, parts in found.matched if i.category == "pipeline"]
    assert permutes and all(parts for i, parts in permutes if not i.optional), str(found)


def test_a_permute_the_other_way_does_not_match() -> None:
    found = checked("explicit", EXPLICIT[0])
    # every permute expected one stage back: the forward ones (one stage on) are then nobody's
    flipped = [dataclasses.replace(i, shift=-1) if i.shift else i for i in found.expected.items]
    again = compare(
        found.report, dataclasses.replace(found.expected, items=tuple(flipped)), attribute_model=True
    )
    assert found.matches and not again.matches
    assert any("collective-permute" in d for d in again.differences), again.differences


def test_pair_shift() -> None:
    mesh = (("data", 2), ("stage", 4))  # device d sits at (d // 4, d % 4)
    assert pair_shift(((0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)), mesh) == 1
    assert pair_shift(((1, 0), (2, 1), (7, 6)), mesh) == -1
    assert pair_shift(((0, 1), (3, 0)), mesh) is None  # a ring's wrap-around
    assert pair_shift(((0, 4),), mesh) == 1  # one step along data
    assert pair_shift(((0, 5),), mesh) is None  # two axes at once
    assert pair_shift(((0, 1),), None) is None and pair_shift((), mesh) is None


@pytest.mark.parametrize("case", INTERLEAVED, ids=str)
def test_interleaved_census_permutes_around_the_ring_and_moves_the_chunks(case: Case) -> None:
    """Interleaved 1F1B: each loop's permute of the carry (forward) and its cotangent (backward) around
    the ring of stages, a tick each; before the loops each chunk moved to the stage that runs it, after
    them its gradient home: ``chunk_rounds``' rounds that move anything, each a piece of every stack
    leaf (this stage's share of it over ``chunks``), both ways."""
    found = checked("explicit", case)
    assert found.matches, str(found)
    sizes = dict(case.mesh)
    schedule = substrax.PipelineSchedule(case.schedule, sizes["stage"], case.microbatches, case.chunks)
    carry = ROWS // case.microbatches // sizes["data"] * WIDTH * F32
    permutes = [r for r in found.report.rows if r.kind == "collective-permute"]
    assert {r.axes for r in permutes} == {("stage",)}
    ring = sorted((r.trip_count or 1, r.bytes) for r in permutes if r.in_loop and r.bytes == carry)
    assert ring == sorted((n, carry) for n, _ in loops(schedule) if n > 1), ring
    model = _MODELS["explicit", case]
    local = [
        v.get_value().addressable_shards[0].data
        for _, v in nnx.to_flat_state(nnx.state(model.layers, nnx.Param))
    ]
    rounds = [m for m in chunk_rounds(sizes["stage"], case.chunks) if any(d != e for d, _, e, _ in m)]
    want = sorted(x.nbytes // case.chunks for x in local for _ in rounds) * 2  # out and home
    moved = sorted(
        r.bytes for r in permutes if not r.in_loop and r.trip_count in (None, 1) and r.shift is None
    )
    assert sorted(want) == moved, (sorted(want), moved)
    assert any(n.startswith(f"pipeline: interleaved-1f1b over {sizes['stage']} stages") for n in found.notes)
