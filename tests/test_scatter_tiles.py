"""The explicit step's reduce-scatters in a TPU's tiles (``substrax._shared.scatter``), run on the CPU.

On a TPU each device's block of a gradient's reduce-scatter goes as whole (8, 128) tiles, padded
(census guide, "On a TPU"); the step with that form forced on the CPU computes the same update as
with one row a device, bit for bit (SGD), for FSDP with and without units and HSDP. The TPU
programs themselves are tests/test_tpu_census.py's (make test-tpu).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import substrax
from substrax._shared import scatter
from substrax._train import pinned
from substrax.mesh import create_device_mesh


@pytest.mark.parametrize(
    ("elements", "itemsize", "block"),
    [
        (34, 4, (8, 128)),  # one tile, padded
        (1024, 4, (8, 128)),
        (1025, 4, (8, 256)),
        (16 * 1024, 4, (8, 2048)),  # sixteen tiles in a row, the most
        (17 * 1024, 4, (24, 1024)),  # then rows of 8 tiles: 24 tiles
        (1000 * 1024 + 1, 4, (1024, 1024)),  # 1,001 tiles padded to 128 rows of 8 (5 significant bits)
        (5_513_216, 4, (5504, 1024)),  # a 1.1B model's unit over 8: 673 rows of tiles (refused), 688
        (100, 2, (16, 128)),  # a 2-byte tile holds 16 rows
        (100, 1, (32, 128)),
    ],
)
def test_a_tpu_block_is_whole_tiles_in_counts_the_tpu_emits(
    elements: int, itemsize: int, block: tuple
) -> None:
    assert scatter.block_shape(elements, itemsize, True) == block
    assert scatter.block_shape(elements, itemsize, False) == (1, elements)
    assert scatter.scattered_elements(elements * 8, 8, itemsize, True) == 8 * block[0] * block[1]


@pytest.mark.parametrize(
    ("elements", "block"),
    [
        ((60, 5), (8, 128)),  # up to 16 tiles: the buffers flat, one after another
        ((9000, 20, 9000), (24, 1024)),  # more: each from the start of a row of 8 tiles (9 + 1 + 9 rows)
        ((8192,) * 40, (320, 1024)),  # 40 rows of tiles: 5 significant bits, even
        ((8193,) * 40, (368, 1024)),  # 9 rows of 1,024 each: 45 rows of tiles, 46
        ((5_513_216,), (5504, 1024)),  # one buffer: block_shape's
    ],
)
def test_a_tpu_block_of_several_buffers_starts_each_on_a_row(elements: tuple, block: tuple) -> None:
    assert scatter.block_of(elements, 4, True) == block
    assert scatter.block_of(elements, 4, False) == (1, sum(elements))


@pytest.mark.parametrize("sizes", [(60, 5), (9000, 20, 9000)])
def test_the_tpu_form_of_several_buffers_sums_each(sizes: tuple) -> None:
    """The step's reduce-scatter of a unit's buffers in the TPU's form, run on the CPU: each
    device's rows of each buffer summed, cut back to their sizes."""
    from substrax._shared.scatter import scatter_rows

    mesh = create_device_mesh({"data": 8})
    rng = np.random.default_rng(0)
    buffers = [rng.normal(size=(8, 8, k)).astype(np.float32) for k in sizes]  # (device, n, k)

    def per_device(*rows: jax.Array) -> tuple:
        with scatter.rows_for("tpu"):
            return tuple(x[None] for x in scatter_rows([r[0] for r in rows], "data", "test"))

    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data")))
    for got, want in zip(run(*buffers), buffers, strict=True):
        np.testing.assert_allclose(np.asarray(got), want.sum(axis=0), rtol=1e-6)


class Net(nnx.Module):
    def __init__(self, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.a = nnx.Linear(12, 40, rngs=rngs)  # 480 + 40 elements: blocks of 60 and 5 over 8, padded
        self.b = nnx.Linear(40, 16, rngs=rngs)
        self.c = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c(jnp.tanh(self.b(jnp.tanh(self.a(x)))))[:, 0]


def _loss(model: Net, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _trained(
    mesh: jax.sharding.Mesh, layout: str, units: object, tiles: bool, monkeypatch
) -> list[np.ndarray]:
    with monkeypatch.context() as patch:
        patch.setattr(scatter, "on_tpu", lambda platform: tiles)
        with jax.set_mesh(mesh):
            model = Net()
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        substrax.shard_state(model, optimizer, mesh=mesh, layout=layout, min_size=2, units=units)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32, 12)).astype(np.float32)
        step = substrax.make_train_step(_loss, "explicit", mesh=mesh)
        for _ in range(2):
            step(model, optimizer, {"x": x, "y": np.sin(x.sum(axis=1))})
        text = step.lower(model, optimizer, {"x": x, "y": x[:, 0]}).as_text()
    # the form asked for is the one traced: a tile a device, 8 devices of 8 rows
    assert ("tensor<8x8x128xf32>" in text or "tensor<4x8x128xf32>" in text) == tiles
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize(
    ("shape", "layout", "units"),
    [
        ({"data": 8}, "fsdp", None),
        ({"data": 8}, "fsdp", nnx.Linear),
        ({"replica": 2, "data": 4}, "hsdp", None),
    ],
)
def test_the_tpu_form_computes_the_one_row_forms_update(shape, layout, units, monkeypatch) -> None:
    mesh = create_device_mesh(shape)
    rows = _trained(mesh, layout, units, False, monkeypatch)
    tiles = _trained(mesh, layout, units, True, monkeypatch)
    for a, b in zip(rows, tiles, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_refused_compile_is_compiled_again_with_the_decomposer_warning(monkeypatch) -> None:
    """Where the TPU compiler refuses a reduce-scatter as written, the step's jit is made again with
    TPU_REFUSED_OPTIONS (here emptied: the CPU compiler takes no TPU option) and called again;
    another error propagates. The compile-only TPU case is tests/test_tpu_census.py's."""
    monkeypatch.setattr(pinned, "TPU_REFUSED_OPTIONS", {})
    step = pinned._StepJit(lambda x: x * 2, pinned.TPU_COMPILER_OPTIONS)
    calls = []

    def refusing(x: jax.Array) -> jax.Array:
        calls.append(x)
        raise jax.errors.JaxRuntimeError(
            "UNIMPLEMENTED: AllReduceScatterFusion not implemented for 2nd-minor compacted shards"
        )

    step._jit = refusing
    with pytest.warns(UserWarning, match="cannot emit a reduce-scatter of this step as written"):
        assert float(step(jnp.float32(3.0))) == 6.0
    assert len(calls) == 1 and float(step(jnp.float32(4.0))) == 8.0 and len(calls) == 1

    def failing(x: jax.Array) -> jax.Array:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")

    step._jit = failing
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        step(jnp.float32(1.0))
    assert not pinned.refused(ValueError("UNIMPLEMENTED: reduce-scatter"))
