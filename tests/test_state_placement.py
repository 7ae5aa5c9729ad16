"""Where ``shard_state`` puts every leaf of the model's and optimizer's state, for optimizers
whose state does not all mirror a parameter (adafactor, MultiSteps, a chain with
clipping), and what the steps do with batch leaves jax would misread (a Python list,
float64).

The expected placement is written out here from the rule, leaf by leaf, and read back
from each array's ``.sharding``; training is checked against plain nnx on one device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import MLP, assert_params_close, mse, params_of, reference_training, regression_batches
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import substrax
from substrax._base.trees import path_str
from substrax._layout import follow_dim, optimizer_followers, optimizer_mirrors
from substrax.explicit import batch_partition_specs
from substrax.spmd import create_data_parallel_sharding, place_batch_on_shards, spmd_train_step

P = PartitionSpec
LR = 1e-2

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adafactor": lambda: optax.adafactor(LR),  # nothing factored on the small MLP: (1,) placeholders
    "adafactor_factored": lambda: optax.adafactor(LR, min_dim_size_to_factor=4),  # v_row / v_col
    "multisteps_adam": lambda: optax.MultiSteps(optax.adam(LR), every_k_schedule=2),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR)),
}
# (din, width): MLP() has hidden kernel (4, 16), split on dim 1; MLP(32, 8) has (32, 8), split on dim 0.
SHAPES = {"4x16": (4, 16), "32x8": (32, 8)}


def _spec_of(value: jax.Array) -> tuple[int | None, int]:
    """(the dimension split over the 8 devices, or None; how many devices hold it)."""
    sharding = value.sharding
    assert isinstance(sharding, NamedSharding), sharding
    dims = [d for d, e in enumerate(sharding.spec) if e is not None]
    return (None if sharding.is_fully_replicated else dims[0]), len(sharding.device_set)


def _param_split(shape: tuple[int, ...]) -> int | None:
    """The split rule with min_size=1 on 8 devices: the largest dimension 8 divides, first on a tie."""
    fits = [d for d, n in enumerate(shape) if n % 8 == 0]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def _expected_opt_dim(
    path: tuple, shape: tuple[int, ...], params: dict[tuple, tuple[int, ...]]
) -> int | None:
    """Where the rule puts one optimizer leaf, written out case by case."""
    if not shape:
        return None  # counters, the step: replicated
    owner = path[-2:]  # the MLP's parameter paths are (layer, name)
    pshape = params[owner]
    dim = _param_split(pshape)
    if shape == pshape:
        return dim  # mu, nu, v of an unfactored parameter, MultiSteps' acc_grads: split with it
    if path[-3] in ("v_row", "v_col") and shape != (1,) and dim is not None:
        # adafactor's factored statistics of a kernel (a, b), a != b: (a,) or (b,). The one
        # that kept the split dimension is split on it; the one that dropped it is replicated.
        assert len(pshape) == 2 and pshape[0] != pshape[1] and shape in ((pshape[0],), (pshape[1],))
        return 0 if shape == (pshape[dim],) else None
    return None  # (1,) placeholders


def _placed(din_width: tuple[int, int], name: str, fsdp: bool, mesh: jax.sharding.Mesh):
    model = MLP(din=din_width[0], width=din_width[1])
    optimizer = nnx.Optimizer(model, OPTIMIZERS[name](), wrt=nnx.Param)
    layout = substrax.shard_state(model, optimizer, mesh=mesh, params=fsdp, min_size=1)
    return model, optimizer, layout


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "zero1"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_leaf_is_placed_by_the_rule(
    mesh8: jax.sharding.Mesh, name: str, fsdp: bool, shape: str
) -> None:
    model, optimizer, layout = _placed(SHAPES[shape], name, fsdp, mesh8)
    params = {tuple(p): tuple(v.get_value().shape) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    rows = {r.path: r for r in layout.rows}
    checked = 0
    for owner, tree in (("model", model), ("optimizer", optimizer)):
        for path, variable in nnx.to_flat_state(nnx.state(tree)):
            value = variable.get_value()
            path = tuple(path)
            if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
                continue
            shape_ = tuple(value.shape)
            if owner == "model":
                want = _param_split(shape_) if fsdp and path in params else None
            else:
                want = _expected_opt_dim(path, shape_, params)
            got, devices = _spec_of(value)
            name_ = f"{owner} {path} {shape_}"
            assert devices == 8, name_
            assert got == want, f"{name_}: split on {got}, want {want}"
            # layout_of reports the same placement, and what one device holds
            row = rows[path_str(path, owner)]
            assert row.split_dim == want, name_
            held = value.addressable_shards[0].data.nbytes
            assert row.bytes_per_device == held, name_
            checked += 1
    assert checked == len(layout.rows)
    assert layout.kind == ("fsdp" if fsdp else "zero1")
    assert layout.bytes_per_device == sum(
        v.get_value().addressable_shards[0].data.nbytes
        for _, v in nnx.to_flat_state(nnx.state((model, optimizer)))
        if not jnp.issubdtype(v.get_value().dtype, jax.dtypes.prng_key)
    )


def test_factored_statistics_follow_the_split_dimension(mesh8: jax.sharding.Mesh) -> None:
    # The cases spelled out: hidden kernel (4, 16) split on dim 1 -> v_col (16,) split, v_row (4,) not;
    # hidden kernel (32, 8) split on dim 0 -> v_col (32,) split, v_row (8,) not.
    for din_width, split, whole in (((4, 16), "v_col", "v_row"), ((32, 8), "v_col", "v_row")):
        _, optimizer, layout = _placed(din_width, "adafactor_factored", True, mesh8)
        state = optimizer.opt_state[0]
        assert getattr(state, split)["hidden"]["kernel"].get_value().sharding.spec == P("data")
        assert getattr(state, whole)["hidden"]["kernel"].get_value().sharding.is_fully_replicated
        assert state.v["hidden"]["kernel"].get_value().shape == (1,)  # the placeholder: replicated
        assert state.v["hidden"]["kernel"].get_value().sharding.is_fully_replicated
        assert f"optimizer['opt_state'][0]['{split}']['hidden']['kernel']" in str(layout)


def test_mirrors_and_followers(mesh8: jax.sharding.Mesh) -> None:
    model = MLP()
    optimizer = nnx.Optimizer(model, OPTIMIZERS["adafactor_factored"](), wrt=nnx.Param)
    mirrors = optimizer_mirrors(model, optimizer)
    followers = optimizer_followers(model, optimizer)
    kernel = ("hidden", "kernel")
    assert mirrors[kernel] == ()  # adafactor keeps nothing of the kernel's shape
    assert set(followers[kernel]) == {
        ("opt_state", 0, "v", "hidden", "kernel"),
        ("opt_state", 0, "v_col", "hidden", "kernel"),
        ("opt_state", 0, "v_row", "hidden", "kernel"),
    }
    assert mirrors[("hidden", "bias")] == (("opt_state", 0, "v", "hidden", "bias"),)


@pytest.mark.parametrize(
    ("param", "leaf", "dim", "want"),
    [
        ((4, 16), (4, 16), 1, 1),  # the same shape
        ((4, 16), (16,), 1, 0),  # dim 0 dropped: dim 1 moves to 0
        ((4, 16), (4,), 1, None),  # the split dim dropped
        ((32, 8), (32,), 0, 0),  # dim 1 dropped
        ((16, 16), (16,), 0, None),  # either could have been dropped: ambiguous, replicated
        ((4, 16), (1,), 1, None),  # a placeholder
        ((4, 16), (4, 1), 1, None),  # kept dims, size 1 on the split one
        ((4, 16), (1, 16), 1, 1),  # kept dims, the split one whole
        ((4, 16), (10, 4, 16), 1, 2),  # a history axis in front (lbfgs)
        ((4, 16), (4, 16), None, None),  # the parameter is not split
    ],
)
def test_follow_dim(param: tuple, leaf: tuple, dim: int | None, want: int | None) -> None:
    assert follow_dim(param, leaf, dim) == want


def test_state_of_no_parameter_is_replicated_not_refused(mesh8: jax.sharding.Mesh) -> None:
    # muon keeps its Newton-Schulz coefficients, shape (3,), under no parameter's path.
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.contrib.muon(LR), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh8, min_size=1)
    flat = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(optimizer))}
    coeffs = [v for p, v in flat.items() if p[-1] == "ns_coeffs"]
    assert coeffs and all(v.sharding.is_fully_replicated and len(v.sharding.device_set) == 8 for v in coeffs)


def test_lbfgs_history_follows_the_split_dimension(mesh8: jax.sharding.Mesh) -> None:
    # lbfgs keeps a history of each parameter, (10, *shape), and weights (10,) of no parameter.
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.lbfgs(), wrt=nnx.Param)
    substrax.shard_state(model, optimizer, mesh=mesh8, min_size=1)
    state = optimizer.opt_state[0]
    history = state.diff_params_memory["hidden"]["kernel"].get_value()
    assert history.shape == (10, 4, 16) and history.sharding.spec == P(None, None, "data")
    assert state.weights_memory.get_value().sharding.is_fully_replicated


class Renamed(nnx.Module):
    """The MLP's shapes under other names: its optimizer is not the MLP's."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.first = nnx.Linear(4, 16, rngs=rngs)
        self.second = nnx.Linear(16, 1, rngs=rngs)


def test_an_optimizer_built_for_another_model_is_refused(mesh8: jax.sharding.Mesh) -> None:
    model = MLP()
    other = nnx.Optimizer(Renamed(), optax.adafactor(LR), wrt=nnx.Param)
    with pytest.raises(
        ValueError,
        match=r"optimizer\['opt_state'\]\[0\]\['v_row'\]\['first'\]\['bias'\] \(shape \(1,\)\) mirrors "
        r"no parameter of the MLP given \(the optimizer's transformation gives this model no such leaf\): "
        r"is the optimizer the model's\? Pass the model the optimizer was built for",
    ):
        substrax.shard_state(model, other, mesh=mesh8)
    # also once both are placed: the check reads shapes, not the variables' sharding metadata
    substrax.shard_state(model, nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param), mesh=mesh8, min_size=1)
    wider_model = MLP(width=32)
    wider = nnx.Optimizer(wider_model, optax.adafactor(LR, min_dim_size_to_factor=4), wrt=nnx.Param)
    substrax.shard_state(wider_model, wider, mesh=mesh8, min_size=1)
    with pytest.raises(
        ValueError, match=r"\(shape \(32,\)\) mirrors no parameter .*would have shape \(16,\)"
    ):
        substrax.shard_state(model, wider, mesh=mesh8)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "zero1"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_implicit_mode_trains_placed_state_like_one_device(
    mesh8: jax.sharding.Mesh, name: str, fsdp: bool
) -> None:
    batches = regression_batches(4, rows=32)
    want_losses, want_params = reference_training(batches, tx=OPTIMIZERS[name]())
    model, optimizer, _ = _placed((4, 16), name, fsdp, mesh8)
    step = substrax.make_train_step(mse, "implicit", mesh=mesh8)
    sharding = create_data_parallel_sharding(mesh8)
    losses = [float(step(model, optimizer, place_batch_on_shards(b, sharding))) for b in batches]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_params_close(params_of(model), want_params, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------- batch leaves


LIST_MESSAGE = (
    r"batch\['x'\] is a Python list \(of 64 numbers\), which jax takes as a tree of 64 separate "
    r"scalars.*np\.asarray\(\.\.\.\).*jnp\.asarray\(\.\.\.\)"
)


def _list_batch() -> dict:
    x = np.arange(64, dtype=np.float32).reshape(16, 4) / 64
    return {"x": x.tolist(), "y": np.zeros((16, 1), np.float32)}


@pytest.mark.parametrize("mode", substrax.MODES)
def test_a_python_list_in_the_batch_is_named(mesh8: jax.sharding.Mesh, mode: str) -> None:
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    with pytest.raises(TypeError, match=LIST_MESSAGE):
        substrax.make_train_step(mse, mode, mesh=mesh8)(model, optimizer, _list_batch())


def test_a_python_list_is_named_inside_nnx_jit_too(mesh8: jax.sharding.Mesh) -> None:
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)

    @nnx.jit
    def train_step(model: MLP, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
        return spmd_train_step(model, optimizer, mse, batch)

    with jax.set_mesh(mesh8), pytest.raises(TypeError, match=LIST_MESSAGE):
        train_step(model, optimizer, _list_batch())
    with pytest.raises(TypeError, match=LIST_MESSAGE):
        batch_partition_specs(_list_batch(), None, mesh8, "data")


def test_scalars_and_lists_of_arrays_are_not_python_lists(mesh8: jax.sharding.Mesh) -> None:
    x = np.ones((16, 4), np.float32)
    specs = batch_partition_specs({"rows": [x, x], "lam": 0.5, "n": np.float32(2)}, None, mesh8, "data")
    assert specs == {"rows": [P("data"), P("data")], "lam": P(), "n": P()}


def test_float64_leaves_are_named_when_jax_casts_them(mesh8: jax.sharding.Mesh) -> None:
    assert not jax.config.read("jax_enable_x64")
    batch = {"x": np.ones((16, 4)), "y": np.ones((16, 1), np.float32)}
    message = r"batch\['x'\] is float64, but jax's 64-bit mode is off .*cast to float32 silently"
    with pytest.warns(UserWarning, match=message) as record:
        placed = place_batch_on_shards(batch, create_data_parallel_sharding(mesh8))
    assert placed["x"].dtype == jnp.float32
    assert not any("batch['y']" in str(w.message) for w in record)
    with pytest.warns(UserWarning, match=message):
        batch_partition_specs(batch, None, mesh8, "data")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32 alone: no warning
        place_batch_on_shards({"y": batch["y"]}, create_data_parallel_sharding(mesh8))


@pytest.mark.parametrize(("layout", "params"), [("fsdp", True), ("zero1", False)])
def test_layout_keyword_is_the_params_keyword(mesh8: jax.sharding.Mesh, layout: str, params: bool) -> None:
    placed = []
    for kwargs in ({"layout": layout}, {"params": params}):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        placed.append(
            substrax.shard_state(model, optimizer, mesh=mesh8, data_axis="data", min_size=1, **kwargs)
        )
    assert placed[0] == placed[1] and placed[0].kind == layout


def test_layout_replicated_splits_nothing(mesh8: jax.sharding.Mesh) -> None:
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    found = substrax.shard_state(model, optimizer, mesh=mesh8, layout="replicated", min_size=1)
    assert found.kind == "replicated" and not found.split()
    assert all(v.get_value().sharding.is_fully_replicated for _, v in nnx.to_flat_state(nnx.state(model)))


def test_layout_keyword_errors(mesh8: jax.sharding.Mesh) -> None:
    model = MLP()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(
        ValueError, match=r"layout must be one of \('replicated', 'zero1', 'fsdp', 'hsdp'\); got 'zero3'"
    ):
        substrax.shard_state(model, optimizer, mesh=mesh8, layout="zero3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layout='fsdp' and params=False disagree"):
        substrax.shard_state(model, optimizer, mesh=mesh8, layout="fsdp", params=False)
