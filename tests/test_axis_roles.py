"""Axis roles (#60 item 4): a mesh without the data axis trains as on a data axis of one device; two
roles on one axis are refused by name before anything is lowered; no axis a user names aborts.

The roles: the data axis (``data_axis=``), the replica axis (``replica_axis=``), the pipeline's
``stage`` axis, and the axes the model's layers split over (``substrax.nn``'s ``model_axis``).
The model: ``tests/models.py``'s tower of residual layers (a column- and a row-parallel linear
each, split over ``model`` on a mesh with it), pipelined over ``stage`` on a mesh with that.
Both meshes of one role alone train to the one-device result under SGD (float32 round-off).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models import MLP, Residual, Tower, mse, one_device_params, params_of, regression_batches, sine_batches

import substrax
from substrax.mesh import create_device_mesh
from substrax.nn import ColumnParallelLinear, RowParallelLinear

DEPTH, WIDTH, ROWS, STEPS = 8, 8, 32, 2
STRICT_RTOL, STRICT_ATOL = 1e-5, 1e-6
TESTS = Path(__file__).parent


class Layer(Residual):
    """One residual layer: LayerNorm, a column-parallel up and a row-parallel down projection."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        super().__init__(width, rngs, norm=True)


def _net() -> Tower:
    return Tower(Layer, DEPTH, WIDTH, gate=True, scale=0.5)


def _tx() -> optax.GradientTransformation:
    return optax.sgd(0.02)


def _batches() -> list[dict]:
    return sine_batches(STEPS, ROWS)


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return one_device_params(_net, _tx(), _batches())


def _built(shape: dict[str, int], model: type = _net) -> tuple[jax.sharding.Mesh, nnx.Module, nnx.Optimizer]:
    mesh = create_device_mesh(shape)
    with jax.set_mesh(mesh):
        net = model()
        return mesh, net, nnx.Optimizer(net, _tx(), wrt=nnx.Param)


def _assert_like(model: nnx.Module, reference: dict[str, np.ndarray]) -> None:
    got = params_of(model)
    for key, want in reference.items():
        np.testing.assert_allclose(got[key], want, rtol=STRICT_RTOL, atol=STRICT_ATOL, err_msg=key)


@contextlib.contextmanager
def nothing_lowered() -> Iterator[None]:
    """Fail if jax lowers (or compiles) any program inside: a refusal comes before the step's."""
    seen: list[str] = []

    def note(name: str, _secs: float, **_: object) -> None:
        seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(note)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_duration_listener(note)
    lowered = [e for e in seen if "jaxpr_to_mlir_module" in e or "backend_compile" in e]
    assert not lowered, lowered


# --- a mesh of one role alone ------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_mesh_of_stages_alone_trains_like_one_device(mode: str, schedule: str, reference: dict) -> None:
    """``{"stage": 8}``: the data axis has one device; the default layout (FSDP) splits nothing over it."""
    mesh, model, opt = _built({"stage": 8})
    layout = substrax.shard_state(model, opt, mesh=mesh, min_size=1, stages=Layer)
    assert layout.kind == "replicated" and layout.axis_size == 1, str(layout)
    step = substrax.make_train_step(mse, mode, mesh=mesh, microbatches=8, schedule=schedule)
    for batch in _batches():
        step(model, opt, batch)
    for path, variable in nnx.to_flat_state(nnx.state(model.layers, nnx.Param)):
        assert variable.get_value().sharding.spec[0] == "stage", path  # still a stage's layers
    _assert_like(model, reference)


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_mesh_of_model_alone_trains_like_one_device(mode: str, microbatches: int, reference: dict) -> None:
    """``{"model": 8}``: the tensor-parallel layers split over ``model``, every device sees every row."""
    mesh, model, opt = _built({"model": 8})
    layout = substrax.shard_state(model, opt, mesh=mesh, min_size=1)
    assert layout.kind == "replicated", str(layout)
    up = model.layers.up.kernel.get_value()
    assert up.sharding.spec == P(None, None, "model"), up.sharding  # (layer, in, out): out split
    step = substrax.make_train_step(mse, mode, mesh=mesh, microbatches=microbatches)
    for batch in _batches():
        step(model, opt, batch)
    _assert_like(model, reference)


def test_the_plan_of_a_mesh_without_data_names_no_data_axis() -> None:
    """A collective the rule names no axis for runs over every device there: counted under the mesh's."""
    mesh, model, opt = _built({"model": 8})
    table = substrax.plan(
        mse, model, opt, _batches()[0], mesh=mesh, mode=list(substrax.MODES), layouts=["fsdp"]
    )
    for row in table.rows:
        assert row.bytes and all(axes == "model" for _, axes in row.bytes), (row.mode, row.bytes)


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_mesh_of_replicas_alone_splits_the_rows_over_them(mode: str) -> None:
    """``{"replica": 8}``: the replica axis alone splits the rows (the data axis has one device), so
    ``"hsdp"`` replicates everything and the gradient is summed over ``replica``."""
    batches = regression_batches(STEPS, ROWS)
    want = one_device_params(MLP, _tx(), batches)
    mesh, model, opt = _built({"replica": 8}, MLP)
    assert substrax.shard_state(model, opt, mesh=mesh, layout="hsdp", min_size=1).kind == "replicated"
    step = substrax.make_train_step(mse, mode, mesh=mesh, microbatches=2)
    check = step.check_communication(model, opt, batches[0])
    assert check.matches and ("replica",) in {row.axes for row in check.report.rows}, str(check)
    for batch in batches:
        step(model, opt, batch)
    _assert_like(model, want)


# --- two roles on one axis, refused before anything is lowered --------------------------

SHARED = r"name the same mesh axis"


class OnStage(nnx.Module):
    """A column- then row-parallel pair whose model axis is named ``stage``: the pipeline's axis."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.up = ColumnParallelLinear(4, 16, model_axis="stage", rngs=rngs)
        self.down = RowParallelLinear(16, 1, model_axis="stage", rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.numpy.tanh(self.up(x)))


@pytest.mark.parametrize("mode", substrax.MODES)
def test_data_and_stage_on_one_axis_are_refused(mode: str) -> None:
    mesh, model, opt = _built({"stage": 8})
    want = rf"data_axis='stage' and the pipeline's stage axis 'stage' {SHARED}"
    with nothing_lowered():
        for keywords in ({"data_axis": "stage"}, {"axis": "stage"}):  # and the older spelling
            with pytest.raises(ValueError, match=want):
                substrax.shard_state(model, opt, mesh=mesh, min_size=1, stages=Layer, **keywords)
        with pytest.raises(ValueError, match=want):
            substrax.make_train_step(
                mse, mode, mesh=mesh, data_axis="stage", microbatches=2, schedule="gpipe"
            )
        with pytest.raises(ValueError, match=want):  # without a mesh: the names alone
            substrax.make_train_step(mse, mode, data_axis="stage")


@pytest.mark.parametrize("mode", substrax.MODES)
def test_data_and_model_on_one_axis_are_refused(mode: str) -> None:
    mesh, model, opt = _built({"model": 8})
    want = rf"data_axis='model' and the axis the model's layers split over, 'model', {SHARED}"
    with nothing_lowered(), pytest.raises(ValueError, match=want):
        substrax.shard_state(model, opt, mesh=mesh, min_size=1, data_axis="model")
    substrax.shard_state(model, opt, mesh=mesh, min_size=1)
    step = substrax.make_train_step(mse, mode, mesh=mesh, data_axis="model")
    with nothing_lowered(), pytest.raises(ValueError, match=want):
        step(model, opt, _batches()[0])
    rows = r"batch_spec splits the rows of batch\['x'\] as P\('model',\), over 'model', the axis the model's"
    step = substrax.make_train_step(mse, mode, mesh=mesh, batch_spec=P("model"))  # the same, by batch_spec
    with nothing_lowered(), pytest.raises(ValueError, match=rows):
        step(model, opt, _batches()[0])


@pytest.mark.parametrize("mode", substrax.MODES)
def test_replica_and_data_on_one_axis_are_refused(mode: str) -> None:
    mesh, model, opt = _built({"replica": 2, "data": 4})
    with nothing_lowered():
        with pytest.raises(ValueError, match=rf"data_axis='data' and replica_axis='data' {SHARED}"):
            substrax.shard_state(model, opt, mesh=mesh, layout="hsdp", replica_axis="data")
        with pytest.raises(ValueError, match=rf"data_axis='data' and replica_axis='data' {SHARED}"):
            substrax.make_train_step(mse, mode, mesh=mesh, replica_axis="data")
        with pytest.raises(ValueError, match=rf"data_axis='replica' and replica_axis='replica' {SHARED}"):
            substrax.make_train_step(mse, mode, mesh=mesh, data_axis="replica")


@pytest.mark.parametrize("mode", substrax.MODES)
def test_replica_and_stage_on_one_axis_are_refused(mode: str) -> None:
    mesh, model, opt = _built({"stage": 8})
    want = rf"replica_axis='stage' and the pipeline's stage axis 'stage' {SHARED}"
    with nothing_lowered():
        with pytest.raises(ValueError, match=want):
            substrax.shard_state(model, opt, mesh=mesh, stages=Layer, replica_axis="stage")
        with pytest.raises(ValueError, match=want):
            substrax.make_train_step(
                mse, mode, mesh=mesh, replica_axis="stage", microbatches=2, schedule="1f1b"
            )


@pytest.mark.parametrize("mode", substrax.MODES)
def test_replica_and_model_on_one_axis_are_refused(mode: str) -> None:
    mesh, model, opt = _built({"model": 8})
    want = rf"replica_axis='model' and the axis the model's layers split over, 'model', {SHARED}"
    with nothing_lowered(), pytest.raises(ValueError, match=want):
        substrax.shard_state(model, opt, mesh=mesh, replica_axis="model")
    substrax.shard_state(model, opt, mesh=mesh, min_size=1)
    step = substrax.make_train_step(mse, mode, mesh=mesh, replica_axis="model")
    with nothing_lowered(), pytest.raises(ValueError, match=want):
        step(model, opt, _batches()[0])


@pytest.mark.parametrize("mode", substrax.MODES)
def test_stage_and_model_on_one_axis_are_refused(mode: str) -> None:
    mesh, model, opt = _built({"stage": 8}, OnStage)
    want = rf"the pipeline's stage axis 'stage' and the axis the model's layers split over, 'stage', {SHARED}"
    with nothing_lowered():
        with pytest.raises(ValueError, match=want):
            substrax.shard_state(model, opt, mesh=mesh)
        with pytest.raises(ValueError, match=want):
            substrax.make_train_step(mse, mode, mesh=mesh)(model, opt, _batches()[0])


# --- a mesh without the data axis, each of whose axes needs a role ------------------------


@pytest.mark.parametrize("mode", substrax.MODES)
def test_an_axis_without_a_role_is_refused_by_name(mode: str) -> None:
    """Without the data axis, an axis no role claims most likely is the data axis misnamed."""
    mesh, model, opt = _built({"batch": 8}, MLP)
    want = (
        r"Axis 'data' is not in the mesh, whose axes are \('batch',\)\. .* its axis 'batch' \(8 devices\) "
        r"has no role.* Pass data_axis='batch'"
    )
    with nothing_lowered():
        with pytest.raises(ValueError, match=want):
            substrax.shard_state(model, opt, mesh=mesh)
        with pytest.raises(ValueError, match=want):
            substrax.make_train_step(mse, mode, mesh=mesh)(model, opt, _batches()[0])


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_batch_split_over_the_stage_axis_is_refused(mode: str) -> None:
    mesh, model, opt = _built({"stage": 8})
    substrax.shard_state(model, opt, mesh=mesh, stages=Layer)
    step = substrax.make_train_step(
        mse, mode, mesh=mesh, microbatches=2, schedule="gpipe", batch_spec=P("stage")
    )
    with (
        nothing_lowered(),
        pytest.raises(ValueError, match=r"batch_spec splits batch\['x'\] as P\('stage',\)"),
    ):
        step(model, opt, _batches()[0])


@pytest.mark.parametrize("mode", substrax.MODES)
def test_an_axis_name_that_is_no_str_is_a_type_error(mode: str) -> None:
    for keywords in ({"data_axis": None}, {"replica_axis": 3}, {"data_axis": ""}):
        name = next(iter(keywords))
        with pytest.raises(TypeError, match=rf"{name} must be a mesh axis name \(a non-empty str\)"):
            substrax.make_train_step(mse, mode, **keywords)


# --- what aborted the process ------------------------------------------------------------

ABORTED = """
import sys
sys.path.insert(0, {tests!r})
import substrax
substrax.mesh.use_cpu_devices(8)
import jax, optax
from flax import nnx
from models import Residual, Tower, mse, sine_batches

class Layer(Residual):
    def __init__(self, width, rngs):
        super().__init__(width, rngs, norm=True)

mesh = substrax.mesh.create_device_mesh({{"stage": 8}})
with jax.set_mesh(mesh):
    model = Tower(Layer, 8, 8, gate=True, scale=0.5)
    opt = nnx.Optimizer(model, optax.sgd(0.02), wrt=nnx.Param)
placed = False
for layout in ("fsdp", "replicated"):  # the hint followed: shard_state and the step told data_axis="stage"
    try:
        substrax.shard_state(model, opt, mesh=mesh, layout=layout, data_axis="stage", stages=Layer)
        placed = True
        print("placed", layout)
    except Exception as e:  # which error, the test reads
        print(f"refused: {{type(e).__name__}}: {{e}}")
if not placed:
    substrax.shard_state(model, opt, mesh=mesh, layout="replicated", stages=Layer)
try:
    step = substrax.make_train_step(
        mse, {mode!r}, mesh=mesh, data_axis="stage", microbatches=2, schedule="gpipe"
    )
    print("loss", step(model, opt, sine_batches(1, 32)[0]))
except Exception as e:
    print(f"refused: {{type(e).__name__}}: {{e}}")
"""


@pytest.mark.parametrize("mode", substrax.MODES)
def test_the_spelling_that_aborted_is_refused_and_the_process_lives(mode: str) -> None:
    """``data_axis="stage"`` on ``{"stage": 8}`` aborted explicit mode in XLA (SIGABRT): run in a process
    of its own, so that a regression fails this test rather than killing pytest."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", ABORTED.format(tests=str(TESTS), mode=mode)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    lines = done.stdout.splitlines()
    refused = "refused: ValueError: data_axis='stage' and the pipeline's stage axis"
    assert len(lines) == 3 and all(line.startswith(refused) for line in lines), lines
