"""Pipelines (#54 items 1-3, #63 items 1-2): a stack split over ``stage``, GPipe, 1F1B, ZB-H1 and
interleaved 1F1B (the last two explicit mode), both modes, against one device.

The model: an embedding, 8 residual layers stacked by ``nnx.vmap`` (a LayerNorm, then a
column-parallel and a row-parallel linear: split over ``model`` on a mesh with it) applied by
``substrax.nn.scan_layers`` with a gate computed from a parameter (an argument every stage
reads, so its gradient is summed over the stages) and a static keyword, then a head.

Parity: each mode x schedule it runs on four meshes, ``stage=8`` (``data=1``), ``(stage=4, data=2)``,
``(stage=2, data=2, model=2)`` and ``(replica=2, data=2, stage=2)``, with 8, 4, 8 and 4 microbatches
and the layouts replicated, FSDP with each layer a unit, ZeRO-1 and HSDP (24 cases, not the full
product of layouts and microbatches: each case compiles a step; interleaved on a stack of 16, two
chunks a stage); SGD held strictly (float32
round-off), Adam to the noise floor measured by the reference run on permuted rows (two cases, FSDP). Then the
placement, ``compare_gradients`` on the pipelined steps, a checkpoint restored onto a mesh
without ``stage``, the schedules' tables, and every refusal by name.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import PIPELINES
from flax import nnx
from models import Residual, Tower, mse, one_device_params, params_of, sine_batches, stack

import substrax
from substrax import checkpoint
from substrax._shared.schedule import EXPLICIT_ONLY, Schedule, bubble_fraction, chunk_rounds
from substrax.explicit import compare_gradients
from substrax.mesh import create_device_mesh

DEPTH, WIDTH, ROWS = 8, 8, 32
STRICT_RTOL, STRICT_ATOL = 1e-5, 1e-6
SAFETY = 4.0  # Adam: this many times the measured floor (as the mesh fuzzer)
ADAM_EPS = 1e-3  # as the mesh fuzzer: a round-off-sized gradient moves at most lr / eps times it

CASES = {  # name: (mesh, layout, microbatches)
    "stage8": ({"data": 1, "stage": 8}, "replicated", 8),
    "stage4-data2-units": ({"data": 2, "stage": 4}, "units", 4),
    "stage2-data2-model2": ({"data": 2, "stage": 2, "model": 2}, "zero1", 8),
    "replica2-data2-stage2-hsdp": ({"replica": 2, "data": 2, "stage": 2}, "hsdp", 4),
}


class Layer(Residual):
    """One residual layer: LayerNorm, a column-parallel up and a row-parallel down projection."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        super().__init__(width, rngs, norm=True)


class Net(Tower):
    def __init__(self, depth: int = DEPTH, width: int = WIDTH, seed: int = 0) -> None:
        super().__init__(Layer, depth, width, gate=True, scale=0.5, seed=seed)


def _batches(steps: int = 2, rows: int = ROWS, seed: int = 0) -> list[dict]:
    return sine_batches(steps, rows, seed=seed)


def _tx(optimizer: str) -> optax.GradientTransformation:
    return optax.sgd(0.02) if optimizer == "sgd" else optax.adam(1e-2, eps=ADAM_EPS)


def _reference(optimizer: str, batches: list[dict]) -> dict[str, np.ndarray]:
    return one_device_params(Net, _tx(optimizer), batches)


def _chunks(schedule: str) -> int:
    """The chunks a stage runs: two for the interleaved schedule (on a stack of ``2 * DEPTH``), else one."""
    return 2 if schedule == "interleaved-1f1b" else 1


@pytest.fixture(scope="module")
def sgd_reference() -> dict[str, np.ndarray]:
    return _reference("sgd", _batches())


@pytest.fixture(scope="module")
def deep_reference() -> dict[str, np.ndarray]:
    """The interleaved cases' reference: the stack of ``2 * DEPTH`` layers on one device."""
    return one_device_params(lambda: Net(depth=2 * DEPTH), _tx("sgd"), _batches())


def _placed(
    shape: dict, layout: str, optimizer: str = "sgd", chunks: int = 1
) -> tuple[jax.sharding.Mesh, Net, nnx.Optimizer]:
    mesh = create_device_mesh(shape)
    with jax.set_mesh(mesh):
        model = Net(depth=DEPTH * chunks)
        opt = nnx.Optimizer(model, _tx(optimizer), wrt=nnx.Param)
    units = Layer if layout == "units" else None
    substrax.shard_state(
        model, opt, mesh=mesh, layout="fsdp" if units else layout, min_size=1, units=units, stages=Layer,
        virtual_stages=chunks,
    )  # fmt: skip
    return mesh, model, opt


def _train(mode: str, schedule: str, case: str, optimizer: str = "sgd") -> tuple[Net, nnx.Optimizer, object]:
    shape, layout, k = CASES[case]
    mesh, model, opt = _placed(shape, layout, optimizer, _chunks(schedule))
    step = substrax.make_train_step(mse, mode, mesh=mesh, microbatches=k, schedule=schedule)
    for b in _batches():
        step(model, opt, b)
    return model, opt, step


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("mode", "schedule"), PIPELINES)
def test_a_pipelined_stack_trains_like_one_device(
    mode: str, schedule: str, case: str, sgd_reference: dict, deep_reference: dict
) -> None:
    model, _, _ = _train(mode, schedule, case)
    for path, variable in nnx.to_flat_state(nnx.state(model.layers, nnx.Param)):
        assert variable.get_value().sharding.spec[0] == "stage", path  # still split over the stages
    got, want = params_of(model), deep_reference if _chunks(schedule) > 1 else sgd_reference
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=STRICT_RTOL, atol=STRICT_ATOL, err_msg=key)


@pytest.mark.parametrize(
    ("mode", "schedule"),
    [("explicit", "1f1b"), ("implicit", "gpipe"), ("explicit", "zb-h1"), ("explicit", "interleaved-1f1b")],
)
def test_adam_pipelined_trains_like_one_device_within_the_floor(mode: str, schedule: str) -> None:
    """Adam: the reference run again on the rows permuted three times; the floor is the largest
    difference between any two runs, the tolerance ``SAFETY`` times it (the mesh fuzzer's rule)."""
    net = lambda: Net(depth=DEPTH * _chunks(schedule))  # noqa: E731
    runs = [one_device_params(net, _tx("adam"), _batches())]
    for seed in (1, 2, 3):
        order = np.random.default_rng(seed).permutation(ROWS)
        runs.append(
            one_device_params(net, _tx("adam"), [{k: v[order] for k, v in b.items()} for b in _batches()])
        )
    mesh, model, opt = _placed({"data": 2, "stage": 4}, "fsdp", "adam", _chunks(schedule))
    step = substrax.make_train_step(mse, mode, mesh=mesh, microbatches=4, schedule=schedule)
    for b in _batches():
        step(model, opt, b)
    got = params_of(model)
    for key in runs[0]:
        floor = max(float(np.max(np.abs(a[key] - b[key]))) for a in runs for b in runs)
        tol = max(1e-6, SAFETY * floor + 1e-7)
        np.testing.assert_allclose(
            got[key], runs[0][key], rtol=1e-5, atol=tol, err_msg=f"{key} floor {floor:.2e}"
        )


@pytest.mark.parametrize(("mode", "schedule"), [("explicit", "1f1b"), ("implicit", "gpipe")])
def test_metrics_come_from_the_last_stage_in_the_batchs_order(mode: str, schedule: str) -> None:
    """``has_aux``: each row's error gathered (the batch's order), its mean and largest, and a bool."""

    def with_metrics(model: Net, batch: dict) -> tuple[jax.Array, dict]:
        err = model(batch["x"]) - batch["y"]
        loss = jnp.mean(err**2)
        return loss, {"err": err, "mse": loss, "worst": jnp.max(jnp.abs(err)), "small": loss < 1e3}

    batch = _batches(1)[0]
    with jax.default_device(jax.devices()[0]):
        want = nnx.jit(with_metrics)(Net(), batch)[1]
    mesh, model, opt = _placed({"data": 2, "stage": 4}, "replicated")
    reduce = {"err": "gather", "mse": "mean", "worst": "max", "small": "min"}
    step = substrax.make_train_step(
        with_metrics, mode, mesh=mesh, microbatches=4, schedule=schedule, has_aux=True, reduce=reduce
    )
    loss, got = step(model, opt, batch)
    np.testing.assert_allclose(got["err"], want["err"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["mse"], want["mse"], rtol=1e-5)
    np.testing.assert_allclose(loss, want["mse"], rtol=1e-5)
    np.testing.assert_allclose(got["worst"], want["worst"], rtol=1e-5)
    assert bool(got["small"])


def test_shard_state_splits_the_stack_over_stage_consecutive_layers_a_stage() -> None:
    """(stage=4, data=2), FSDP: each stack parameter and its Adam state split on the layer axis over
    ``stage`` (stage s holding layers 2s, 2s + 1) and on another dimension over ``data``; the rest as
    the layout says (over ``data`` only)."""
    mesh, model, opt = _placed({"data": 2, "stage": 4}, "fsdp", "adam")
    kernel = model.layers.up.kernel.get_value()  # (8, 8, 16)
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("stage", None, "data")
    mu = opt.opt_state[0].mu["layers"]["up"]["kernel"].get_value()
    assert mu.sharding.spec == kernel.sharding.spec
    stage_of = {d: s for s, column in enumerate(mesh.devices.T) for d in column}  # mesh (data, stage)
    for shard in kernel.addressable_shards:
        layers = range(DEPTH)[shard.index[0]]
        assert list(layers) == [2 * stage_of[shard.device], 2 * stage_of[shard.device] + 1]
    assert "stage" not in str(model.embed.kernel.get_value().sharding.spec)
    assert model.layers.norm.scale.get_value().sharding.spec[0] == "stage"


@pytest.mark.parametrize("schedule", substrax.SCHEDULES)
def test_compare_gradients_checks_the_pipelined_steps(schedule: str) -> None:
    mesh, model, _ = _placed({"data": 2, "stage": 4}, "fsdp", chunks=_chunks(schedule))
    report = compare_gradients(model, mse, _batches(1)[0], mesh, microbatches=4, schedule=schedule)
    assert report.ok, str(report)
    assert report.methods == (("explicit",) if schedule in EXPLICIT_ONLY else ("implicit", "explicit"))
    assert report.max_abs_diff < 1e-5


def test_the_explicit_program_permutes_between_stages() -> None:
    """1F1B's three loops: the carry forward (warm-up, steady), its cotangent back (steady, cool-down);
    the carry is two arrays, the stack's input and the gate every layer reads: one permute each."""
    mesh, model, opt = _placed({"data": 2, "stage": 4}, "replicated")
    step = substrax.make_train_step(mse, "explicit", mesh=mesh, microbatches=4, schedule="1f1b")
    text = step.lower(model, opt, _batches(1)[0]).compile().as_text()
    assert len(re.findall(r"= \S+ collective-permute(-start)?\(", text)) == 2 * 4


def test_pipelined_state_restores_onto_a_mesh_without_stage(tmp_path, sgd_reference: dict) -> None:
    """One step pipelined on (stage=4, data=2), saved; restored into FSDP on data=8; one more step there."""
    first, second = _batches()
    mesh, model, opt = _placed({"data": 2, "stage": 4}, "fsdp")
    substrax.make_train_step(mse, "explicit", mesh=mesh, microbatches=4, schedule="1f1b")(model, opt, first)
    checkpoint.save(tmp_path / "ckpt", 1, model, opt)
    flat = create_device_mesh({"data": 8})
    with jax.set_mesh(flat):
        model2 = Net(seed=5)
        opt2 = nnx.Optimizer(model2, _tx("sgd"), wrt=nnx.Param)
    substrax.shard_state(model2, opt2, mesh=flat, layout="fsdp", min_size=1)
    checkpoint.restore(tmp_path / "ckpt", model2, opt2)
    assert model2.layers.up.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(None, None, "data")
    substrax.make_train_step(mse, "implicit", mesh=flat)(model2, opt2, second)
    got = params_of(model2)
    for key in sgd_reference:
        np.testing.assert_allclose(
            got[key], sgd_reference[key], rtol=STRICT_RTOL, atol=STRICT_ATOL, err_msg=key
        )


# --- the schedules -------------------------------------------------------------------------


def _tick(row: list[str], slot: str) -> int:
    return next(i for i, c in enumerate(row) if slot in c.split())


@pytest.mark.parametrize(("stages", "k"), [(2, 3), (4, 4), (4, 8), (1, 2), (4, 2)])
def test_each_stage_runs_each_microbatch_forward_then_backward_once(stages: int, k: int) -> None:
    """Every slot once; a microbatch's backward after its forward (ZB-H1: its weights' slot after
    both, or in the same tick, which runs F, B, W in that order); each forward a tick after the
    previous stage's, each backward a tick after the next stage's (what the permutes carry)."""
    for name in substrax.SCHEDULES:
        schedule = Schedule(name, stages, k)
        table = schedule.table()
        kinds = "FBW" if name == "zb-h1" else "FB"
        for s, row in enumerate(table):
            slots = [x for cell in row for x in cell.split()]
            assert sorted(slots) == sorted(f"{x}{j}" for x in kinds for j in range(k)), (name, s)
            for j in range(k):  # a microbatch's backward after its forward, on every stage
                f, b = _tick(row, f"F{j}"), _tick(row, f"B{j}")
                assert f < b or (name != "gpipe" and f == b and s == stages - 1)
                if name == "zb-h1":
                    assert _tick(row, f"W{j}") >= b
                if s > 0 and name != "gpipe":
                    assert f > _tick(table[s - 1], f"F{j}")
                    assert _tick(table[s - 1], f"B{j}") > b


def test_zb_h1_defers_at_most_its_held_weight_slots() -> None:
    """Stage ``s`` runs a microbatch's weights' slot ``s`` ticks after its input's: it holds at most
    ``s + 1`` microbatches' pullbacks, ``deferred`` (the stages) on stage 0 ... the last."""
    stages, k = 4, 8
    schedule = Schedule("zb-h1", stages, k)
    for s, row in enumerate(schedule.table()):
        live, most = set(), 0
        for cell in row:
            for slot in cell.split():  # in the tick's order: F, then B, then W
                if slot[0] == "B":
                    live.add(slot[1:])
                most = max(most, len(live))
                if slot[0] == "W":
                    live.discard(slot[1:])
        assert most == s + 1 <= schedule.deferred == stages
    assert Schedule("1f1b", stages, k).deferred == Schedule("gpipe", stages, k).deferred == 0


def test_1f1b_keeps_at_most_its_stash_and_gpipe_every_microbatch() -> None:
    stages, k = 4, 8
    schedule = Schedule("1f1b", stages, k)
    for s, row in enumerate(schedule.table()):
        live, most = set(), 0
        for cell in row:
            for slot in cell.split():
                (live.add if slot[0] == "F" else live.discard)(slot[1:])
                most = max(most, len(live))
        assert most <= schedule.stash == 2 * stages - 1
        assert most == 2 * (stages - 1 - s) + 1  # the round trip to the last stage and back
    assert Schedule("gpipe", stages, k).stash == 0  # autodiff keeps every tick's residuals


def test_the_bubble_is_the_idle_share_of_each_stage() -> None:
    """GPipe's table: each stage idles in 2 (S - 1) of its 2 (k + S - 1) slots; 1F1B's phases take
    the same time, ``(S - 1)`` forward-only and backward-only ticks around ``k`` full ones."""
    for stages, k in ((2, 4), (4, 4), (4, 16), (8, 8)):
        table = Schedule("gpipe", stages, k).table()
        idle = sum(c == "" for c in table[0]) / len(table[0])
        assert (
            idle
            == pytest.approx(bubble_fraction(stages, k))
            == pytest.approx((stages - 1) / (k + stages - 1))
        )
        phases = Schedule("1f1b", stages, k).phases
        f = sum(stop - start for start, stop, fwd, _, _ in phases if fwd)
        b = sum(stop - start for start, stop, _, bwd, _ in phases if bwd)
        assert f == b == k + stages - 1


@pytest.mark.parametrize(("stages", "k"), [(2, 4), (4, 4), (4, 8), (4, 2), (8, 8)])
def test_each_schedules_bubble_is_its_idle_share(stages: int, k: int) -> None:
    """A tick costs the slots some stage runs there (in forward passes: F 1; 1F1B's B 3, the forward
    recomputed and both gradients; ZB-H1's B 2 and W 1); the bubble is the share of the step's time
    beyond a stage's own work (``k`` times 4). Each slot run lies in a loop that runs that slot."""
    cost = {"1f1b": {"F": 1, "B": 3}, "zb-h1": {"F": 1, "B": 2, "W": 1}}
    for name, price in cost.items():
        schedule = Schedule(name, stages, k)
        table, total = schedule.table(), 0
        for t in range(schedule.ticks):
            kinds = {w[0] for row in table for w in row[t].split()}
            total += sum(price[x] for x in kinds)
            _, _, fwd, bwd, wgt = next(p for p in schedule.phases if p[0] <= t < p[1])
            assert kinds <= {x for x, on in zip("FBW", (fwd, bwd, wgt)) if on}, (name, t)
        assert 1 - 4 * k / total == pytest.approx(schedule.bubble), name
    assert Schedule("zb-h1", stages, k).bubble < Schedule("1f1b", stages, k).bubble


@pytest.mark.parametrize(
    ("stages", "k", "v"), [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 2), (8, 8, 2)]
)
def test_interleaved_runs_each_chunk_in_turn_around_the_ring(stages: int, k: int, v: int) -> None:
    """Chunk ``c`` on stage ``c % S`` (its chunk ``c // S``): every microbatch forward and backward
    once through each chunk; a forward a tick after the previous chunk's (stage 0's chunk ``u`` after
    the last stage's ``u - 1``: the ring), a backward a tick after the next chunk's, the last chunk's
    backward in its forward's tick; at most ``stash`` inputs held a chunk; the bubble its idle share
    (a tick costs the slots some stage runs, F 1, B 3, in a chunk's forward passes)."""
    schedule = Schedule("interleaved-1f1b", stages, k, v)
    table, chunks = schedule.table(), stages * v
    at = {}  # (F or B, microbatch, chunk) -> tick
    for s, row in enumerate(table):
        live: dict[int, set] = {u: set() for u in range(v)}
        for t, cell in enumerate(row):
            for slot in cell.split():
                j, u = map(int, slot[1:].split("."))
                assert (slot[0], j, u * stages + s) not in at
                at[slot[0], j, u * stages + s] = t
                (live[u].add if slot[0] == "F" else live[u].discard)(j)
                assert len(live[u]) <= schedule.stash, (s, t)
    assert len(at) == 2 * k * chunks
    for j in range(k):
        for c in range(1, chunks):
            assert at["F", j, c] == at["F", j, c - 1] + 1 and at["B", j, c - 1] == at["B", j, c] + 1
        assert at["B", j, chunks - 1] == at["F", j, chunks - 1]
    total = 0
    for t in range(schedule.ticks):
        kinds = {w[0] for row in table for w in row[t].split()}
        total += sum({"F": 1, "B": 3}[x] for x in kinds)
        _, _, fwd, bwd, _ = next(p for p in schedule.phases if p[0] <= t < p[1])
        assert kinds <= {x for x, on in zip("FB", (fwd, bwd)) if on}, t
    assert (
        1 - 4 * k * v / total
        == pytest.approx(schedule.bubble)
        == pytest.approx((stages - 1) / (v * k + stages - 1))
    )
    assert schedule.bubble < Schedule("1f1b", stages, k).bubble


def test_chunk_rounds_move_each_chunk_once_a_round_a_stage() -> None:
    """From where ``shard_state`` places them (stage ``d``: chunks ``d v ... d v + v - 1``) to where
    they run (chunk ``c`` on stage ``c % S``, slot ``c // S``): ``v`` rounds, each a permutation."""
    for stages, v in ((2, 2), (4, 2), (4, 3), (3, 2), (8, 2), (2, 4), (1, 3)):
        moved = set()
        rounds = chunk_rounds(stages, v)
        assert len(rounds) == v
        for moves in rounds:
            assert sorted(m[0] for m in moves) == sorted(m[2] for m in moves) == list(range(stages))
            for d, a, e, b in moves:
                c = d * v + a
                assert (e, b) == (c % stages, c // stages)
                moved.add(c)
        assert moved == set(range(stages * v))


# --- refusals -------------------------------------------------------------------------------


def _unplaced(shape: dict) -> tuple[jax.sharding.Mesh, Net, nnx.Optimizer]:
    mesh = create_device_mesh(shape)
    with jax.set_mesh(mesh):
        model = Net()
        opt = nnx.Optimizer(model, _tx("sgd"), wrt=nnx.Param)
    return mesh, model, opt


def test_stages_that_do_not_divide_the_stack_are_refused() -> None:
    mesh, model, opt = _unplaced({"data": 1, "stage": 3})
    with pytest.raises(
        ValueError, match=r"model\['layers'\] has 8 layers, which the 3 stages of 'stage' do not divide"
    ):
        substrax.shard_state(model, opt, mesh=mesh, stages=Layer)


def test_a_stage_axis_without_stages_is_refused() -> None:
    mesh, model, opt = _unplaced({"data": 2, "stage": 4})
    with pytest.raises(ValueError, match=r"has a 'stage' axis, the pipeline's, but .* Pass stages="):
        substrax.shard_state(model, opt, mesh=mesh)


def test_stages_matching_nothing_or_no_stack_are_refused() -> None:
    mesh, model, opt = _unplaced({"data": 2, "stage": 4})
    with pytest.raises(
        ValueError,
        match=r"stages=BatchNorm matched no submodule of the Net, .* types ColumnParallelLinear, Layer, ",
    ):
        substrax.shard_state(model, opt, mesh=mesh, stages=nnx.BatchNorm)
    with pytest.raises(ValueError, match=r"stages= matched model\['embed'\], which is not a stack of layers"):
        substrax.shard_state(model, opt, mesh=mesh, stages=lambda path, m: path == ("embed",))
    with pytest.raises(ValueError, match=r"stages= matched 2 modules"):
        substrax.shard_state(model, opt, mesh=mesh, stages=nnx.Linear)
    with pytest.raises(TypeError, match="stages must be a module type"):
        substrax.shard_state(model, opt, mesh=mesh, stages="Layer")


def test_stages_on_a_mesh_without_stage_or_with_prefetch_are_refused() -> None:
    mesh, model, opt = _unplaced({"data": 8})
    with pytest.raises(ValueError, match=r"the mesh's 'stage' axis, which the mesh \{'data': 8\} lacks"):
        substrax.shard_state(model, opt, mesh=mesh, stages=Layer)
    mesh, model, opt = _unplaced({"data": 2, "stage": 4})
    with pytest.raises(ValueError, match="prefetch=True .* and stages= runs the stack as a pipeline"):
        substrax.shard_state(model, opt, mesh=mesh, stages=Layer, units=Layer, prefetch=True)


def test_schedule_options_are_refused_by_name() -> None:
    mesh = create_device_mesh({"data": 2, "stage": 4})
    with pytest.raises(
        ValueError,
        match=r"schedule must be one of \('gpipe', '1f1b', 'zb-h1', 'interleaved-1f1b'\) or None .* got 'zb'",
    ):
        substrax.make_train_step(mse, mesh=mesh, microbatches=4, schedule="zb")
    with pytest.raises(
        ValueError,
        match=r"schedule='zb-h1' splits each layer's backward .* only explicit mode .* mode='explicit'",
    ):
        substrax.make_train_step(mse, "implicit", mesh=mesh, microbatches=4, schedule="zb-h1")
    with pytest.raises(ValueError, match=r"schedule='1f1b' runs the stages as a pipeline .* microbatches=1"):
        substrax.make_train_step(mse, mesh=mesh, schedule="1f1b")
    with pytest.raises(
        ValueError, match=r"schedule='gpipe' pipelines .* 'stage' axis, which the mesh \{'data': 8\} lacks"
    ):
        substrax.make_train_step(mse, mesh=create_device_mesh({"data": 8}), microbatches=4, schedule="gpipe")


def test_virtual_stages_are_refused_by_name_where_they_do_not_fit() -> None:
    """Chunks that do not divide the stack, without stages=, not an int; a placement and a schedule
    that disagree (two chunks under 1F1B, one under interleaved); microbatches the stages do not
    divide; interleaved in implicit mode. Nothing runs: the state as it was."""
    mesh, model, opt = _unplaced({"data": 2, "stage": 4})
    with pytest.raises(
        ValueError,
        match=r"8 layers, which 4 stages of 'stage' x virtual_stages=3 .* multiple of 12, or virtual_stages "
        r"among \[1, 2\]",
    ):
        substrax.shard_state(model, opt, mesh=mesh, stages=Layer, virtual_stages=3)
    with pytest.raises(ValueError, match=r"virtual_stages=2: .* only with stages="):
        substrax.shard_state(model, opt, mesh=create_device_mesh({"data": 8}), virtual_stages=2)
    with pytest.raises(TypeError, match=r"virtual_stages must be an int .* got 2.0"):
        substrax.shard_state(model, opt, mesh=mesh, stages=Layer, virtual_stages=2.0)
    batch = _batches(1)[0]
    _, two, opt2 = _placed({"data": 2, "stage": 4}, "replicated", chunks=2)
    _, one, opt1 = _placed({"data": 2, "stage": 4}, "replicated")
    before = params_of(two)
    with pytest.raises(
        ValueError, match=r"virtual_stages=2 chunks a stage, which only schedule='interleaved-1f1b'"
    ):
        substrax.make_train_step(mse, "explicit", mesh=mesh, microbatches=4, schedule="1f1b")(
            two, opt2, batch
        )
    with pytest.raises(ValueError, match=r"placed it with one \(virtual_stages=1: that is schedule='1f1b'\)"):
        substrax.make_train_step(mse, "explicit", mesh=mesh, microbatches=4, schedule="interleaved-1f1b")(
            one, opt1, batch
        )
    with pytest.raises(ValueError, match=r"groups of the 4 stages; microbatches=2 is not a multiple of 4"):
        substrax.make_train_step(mse, "explicit", mesh=mesh, microbatches=2, schedule="interleaved-1f1b")(
            two, opt2, batch
        )
    with pytest.raises(
        ValueError, match=r"schedule='interleaved-1f1b' runs each stage's chunks .* mode='explicit'"
    ):
        substrax.make_train_step(mse, "implicit", mesh=mesh, microbatches=4, schedule="interleaved-1f1b")
    after = params_of(two)
    assert all(np.array_equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_staged_model_and_a_step_must_agree(mode: str) -> None:
    mesh, model, opt = _placed({"data": 2, "stage": 4}, "replicated")
    with pytest.raises(
        ValueError, match=r"model\['layers'\] is split over the 'stage' axis .* must run it as a pipeline"
    ):
        substrax.make_train_step(mse, mode, mesh=mesh)(model, opt, _batches(1)[0])
    mesh, model, opt = _unplaced({"data": 2, "stage": 4})
    with pytest.raises(ValueError, match=r"no parameter of the model is placed so"):
        substrax.make_train_step(mse, mode, mesh=mesh, microbatches=4, schedule="1f1b")(
            model, opt, _batches(1)[0]
        )


def test_a_loss_that_never_runs_the_stack_through_scan_layers_is_refused() -> None:
    mesh, model, opt = _placed({"data": 2, "stage": 4}, "replicated")

    def by_hand(model: Net, batch: dict) -> jax.Array:
        h = model.embed(batch["x"])
        return jnp.mean((model.head(h)[:, 0] - batch["y"]) ** 2)

    with pytest.raises(
        ValueError, match=r"never ran the staged stack model\['layers'\] through substrax.nn.scan_layers"
    ):
        substrax.make_train_step(by_hand, "explicit", mesh=mesh, microbatches=4, schedule="gpipe")(
            model, opt, _batches(1)[0]
        )


def test_state_the_loss_changes_is_refused() -> None:
    """A pipeline keeps only the parameters: a loss that counts its calls in a variable is refused."""

    class Counter(nnx.Variable):
        pass

    mesh, model, opt = _unplaced({"data": 2, "stage": 4})
    model.calls = Counter(jnp.zeros((), jnp.int32))
    substrax.shard_state(model, opt, mesh=mesh, stages=Layer)

    def counting(model: Net, batch: dict) -> jax.Array:
        model.calls.set_value(model.calls.get_value() + 1)
        return mse(model, batch)

    with pytest.raises(
        ValueError, match=r"loss_fn changed model\['calls'\] \(Counter\) before the staged stack"
    ):
        substrax.make_train_step(counting, "implicit", mesh=mesh, microbatches=4, schedule="1f1b")(
            model, opt, _batches(1)[0]
        )


def test_a_stack_holding_state_other_than_parameters_is_refused() -> None:
    """A stage's layers are functions of their parameters: BatchNorm's statistics in the stack are refused."""

    class NormedResidual(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.norm = nnx.BatchNorm(WIDTH, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + self.norm(self.linear(x))

    class Stacked(nnx.Module):
        def __init__(self) -> None:
            rngs = nnx.Rngs(0)
            self.embed = nnx.Linear(4, WIDTH, rngs=rngs)
            self.layers = stack(NormedResidual, 4, rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return substrax.nn.scan_layers(self.layers, self.embed(x)).sum(axis=1)

    mesh = create_device_mesh({"data": 2, "stage": 4})
    with jax.set_mesh(mesh):
        model = Stacked()
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    substrax.shard_state(model, opt, mesh=mesh, stages=NormedResidual)
    step = substrax.make_train_step(mse, "explicit", mesh=mesh, microbatches=4, schedule="gpipe")
    with pytest.raises(
        ValueError, match=r"The staged stack model\['layers'\] holds stack\['norm'\]\['mean'\] \(BatchStat\)"
    ):
        step(model, opt, _batches(1)[0])


def test_precision_with_a_schedule_is_refused() -> None:
    mesh, model, opt = _placed({"data": 2, "stage": 4}, "replicated")
    step = substrax.make_train_step(
        mse, mesh=mesh, microbatches=4, schedule="1f1b", precision=substrax.MixedPrecision(jnp.bfloat16)
    )
    with pytest.raises(
        ValueError,
        match=r"schedule='1f1b' with precision=: a pipelined step runs in the parameters' own dtype",
    ):
        step(model, opt, _batches(1)[0])
