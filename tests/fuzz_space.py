"""What the parity fuzzer (``test_fuzz.py``) draws: a ``Config``, one small strategy per axis, and
the builders that turn a ``Config`` into a model, an optimizer, a loss function and batches.

Everything here is deterministic in the ``Config``: the same ``Config`` builds the same model
(same initial parameters), the same optimizer and the same batches, so a failure is reproduced
by pasting the ``Config`` the fuzzer printed into ``check(Config(...))``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from hypothesis import strategies as st
from jax.sharding import PartitionSpec
from models import Dense, stack

import substrax

P = PartitionSpec

# ----------------------------------------------------------------------------------------- the axes
# Each axis lists its values with the one Hypothesis tries first (and shrinks to) first: the
# first draw is the core case, explicit FSDP on 8 devices with Adam and microbatches.

STEMS = ("dense", "conv", "attention")  # Linear on vectors; Conv on 5x5 images; Embed + attention on tokens
# Blocks keep the width. "batchnorm_sync" is nnx.BatchNorm(axis_name="data") in explicit mode (the
# global batch's statistics); the implicit step and the one-device reference build it without
# axis_name, which computes the same statistics. The dropout blocks are off: rate 0, or rate 0.5
# switched off with model.set_attributes(nnx.Dropout, deterministic=True) (model.eval() for dropout only).
BLOCKS = ("linear", "layernorm", "batchnorm", "batchnorm_sync", "dropout_zero", "dropout_eval")
WIDTHS = (8, 16, 32)
TASKS = ("regress", "classify")  # squared error on 2 outputs; cross-entropy over 4 classes, int labels
SGD_FAMILY = ("sgd", "momentum", "clip_sgd")
ADAM_FAMILY = (
    "adam",
    "adamw_masked",
    "clip_adamw",
    "adafactor",
    "lamb",
    "multisteps",
    "muon",
    "multi_transform",
)
OPTIMIZERS = ADAM_FAMILY + SGD_FAMILY
LAYOUTS = ("fsdp", "zero1", "replicated", "hsdp")  # hsdp: on (replica=2, data=devices/2)
MIN_SIZES = (1, None)  # None: shard_state's default (1024)
MODES = ("explicit", "implicit")
MICROBATCHES = (2, 1, 4)
DEVICES = (8, 4, 2, 1)
ROWS = (2, 3, 4)  # rows per device per microbatch
BATCH_TREES = ("flat", "nested", "tuple")
UNITS = (None, "blocks", "linear", "stack")  # none; each block; every nnx.Linear; the scanned stack
# A scanned stack after the blocks (#27.4): two Linear+tanh layers made by nnx.vmap and applied by
# nnx.scan, under nnx.remat or not, or by substrax.nn.scan_layers (with units="stack" on FSDP:
# prefetch=True, the library's loop); none (two draws in five).
SCANS = (None, None, "scan", "remat", "prefetch")
PLACEMENTS = ("batch_spec", "placed")  # host arrays + batch_spec=, or place_batch_on_shards and no batch_spec
# A metric per reduction; "default" is a metric reduce= does not name (it gets "mean").
METRICS = ("mean", "sum", "max", "min", "gather", None, "default")
# step(model, optimizer, batch); step.bind(model, optimizer)(batch); the plain call while the
# caller holds the state's arrays from before each step (as a save in flight does): copied, not deleted
SPELLINGS = ("call", "bind", "held")
# The mixed-precision policy, "param_dtype/reduce_dtype": None (no policy; two draws in three),
# or substrax.MixedPrecision(bfloat16, reduce_dtype=float32 or bfloat16), keep_batch=().
PRECISIONS = (None, "bf16/f32", "bf16/bf16")
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}

LR_SGD = 0.05
LR_ADAPTIVE = 1e-2
CLIP = 1e-3  # far below these models' gradient norms: every step clips
VOCAB, TOKENS, IMAGE, FEATURES, CLASSES, TARGETS = 11, 4, 5, 6, 4, 2


@dataclasses.dataclass(frozen=True)
class Config:
    """One draw. ``repr(config)`` is Python code that rebuilds it."""

    mode: str = "explicit"
    layout: str = "replicated"
    min_size: int | None = None
    devices: int = 8
    microbatches: int = 1
    rows: int = 2
    stem: str = "dense"
    blocks: tuple[str, ...] = ()
    width: int = 8
    task: str = "regress"
    optimizer: str = "sgd"
    batch_tree: str = "flat"
    mask: bool = False
    scale: bool = False
    placement: str = "batch_spec"
    metrics: tuple[str | None, ...] | None = None  # None: has_aux=False
    spelling: str = "call"
    precision: str | None = None  # one of PRECISIONS
    compare_gradients: bool = False  # also run substrax.explicit.compare_gradients (3 more compiles)
    units: str | None = None  # one of UNITS: FSDP units (layout "fsdp" only)
    reshard: bool = True  # the units' reshard_after_forward
    scan: str | None = None  # one of SCANS
    seed: int = 0
    steps: int = 3

    @property
    def adaptive(self) -> bool:
        """An Adam-family optimizer: it divides by a gradient statistic, which can blow up round-off."""
        return self.optimizer in ADAM_FAMILY

    @property
    def global_rows(self) -> int:
        return self.devices * self.microbatches * self.rows

    @property
    def has_aux(self) -> bool:
        return self.metrics is not None

    @property
    def dtypes(self) -> tuple[Any, Any] | None:
        """The policy's (param_dtype, reduce_dtype), or None without one."""
        if self.precision is None:
            return None
        param, reduce = self.precision.split("/")
        return DTYPES[param], DTYPES[reduce]

    def policy(self) -> substrax.MixedPrecision | None:
        """The ``precision=`` the step under test gets."""
        if self.dtypes is None:
            return None
        param, reduce = self.dtypes
        return substrax.MixedPrecision(param_dtype=param, reduce_dtype=reduce)

    @property
    def batchnorm(self) -> bool:
        return any(b.startswith("batchnorm") for b in self.blocks)

    @property
    def batchnorm_rows(self) -> int | None:
        """The fewest rows a BatchNorm normalizes together: one device's microbatch for a
        BatchNorm without ``axis_name`` in explicit mode, else every device's; None without one."""
        if not self.batchnorm:
            return None
        per_shard = self.mode == "explicit" and "batchnorm" in self.blocks and self.devices > 1
        return self.rows * (1 if per_shard else self.devices)

    def short(self) -> str:
        """A one-line summary for the fuzzer's log."""
        layout = self.layout if self.layout == "replicated" else f"{self.layout}/min{self.min_size or 'def'}"
        extras = [self.batch_tree] + ["mask"] * self.mask + ["scale"] * self.scale + [self.placement]
        aux = "" if self.metrics is None else " aux(" + ",".join(str(m) for m in self.metrics) + ")"
        precision = "" if self.precision is None else f" {self.precision}"
        if self.units is not None and self.layout in ("fsdp", "hsdp"):
            precision += f" units={self.units}{'' if self.reshard else '/keep'}"
        if self.scan is not None:
            precision += f" {self.scan}"
        return (
            f"{self.mode:<8} {layout:<12} n{self.devices} k{self.microbatches} r{self.rows} "
            f"{self.stem}[{','.join(self.blocks)}]w{self.width} {self.task} {self.optimizer} "
            f"{' '.join(extras)}{aux} {self.spelling}{precision} s{self.seed}"
        )


MIN_BATCHNORM_ROWS = 3


def measurable(config: Config) -> Config:
    """``config`` with at least ``MIN_BATCHNORM_ROWS`` rows in every BatchNorm group.

    Two rows have one summation order, so no permutation measures their round-off, and
    flax's fast variance (``E[x**2] - E[x]**2``) over two close rows cancels to a few
    digits: two valid compilations of the same step differed there by 100x their floor
    (``test_regression_a_two_row_batchnorm_group_is_not_drawn``).
    """
    rows = config.batchnorm_rows
    if rows is None or rows >= MIN_BATCHNORM_ROWS:
        return config
    return dataclasses.replace(config, rows=config.rows + 1)


def configs() -> st.SearchStrategy[Config]:
    """Every axis drawn independently."""
    return st.builds(
        Config,
        mode=st.sampled_from(MODES),
        layout=st.sampled_from(LAYOUTS),
        min_size=st.sampled_from(MIN_SIZES),
        devices=st.sampled_from(DEVICES),
        microbatches=st.sampled_from(MICROBATCHES),
        rows=st.sampled_from(ROWS),
        stem=st.sampled_from(STEMS),
        blocks=st.lists(st.sampled_from(BLOCKS), max_size=3).map(tuple),
        width=st.sampled_from(WIDTHS),
        task=st.sampled_from(TASKS),
        optimizer=st.sampled_from(OPTIMIZERS),
        batch_tree=st.sampled_from(BATCH_TREES),
        mask=st.booleans(),
        scale=st.booleans(),
        placement=st.sampled_from(PLACEMENTS),
        metrics=st.none()
        | st.lists(st.sampled_from(METRICS), min_size=1, max_size=4, unique=True).map(tuple),
        spelling=st.sampled_from(SPELLINGS),
        compare_gradients=st.booleans(),
        seed=st.integers(0, 2**16 - 1),
        precision=st.sampled_from((None,) * 4 + PRECISIONS[1:]),  # last: the earlier axes draw as before
        units=st.sampled_from(UNITS),
        reshard=st.booleans(),
        scan=st.sampled_from(SCANS),  # last: the earlier axes draw as before
    ).map(measurable)


def prefetch_of(config: Config) -> bool:
    """The ``prefetch=`` ``shard_state`` gets: the scanned stack, a unit gathered again for its
    backward pass, run by ``substrax.nn.scan_layers``."""
    return (
        config.scan == "prefetch"
        and config.units == "stack"
        and config.reshard
        and units_of(config) is not None
    )


def units_of(config: Config) -> Any:
    """The ``units=`` ``shard_state`` gets: None, each block, every ``nnx.Linear``, or the scanned stack
    (None where the model has no such module: ``shard_state`` refuses units that match nothing)."""
    if config.layout not in ("fsdp", "hsdp") or config.units is None:
        return None
    if config.units == "linear":
        return nnx.Linear
    if config.units == "stack":
        return Dense if config.scan is not None else None
    return (lambda path, module: len(path) == 2 and path[0] == "blocks") if config.blocks else None


# ----------------------------------------------------------------------------------------- the model


class Model(nnx.Module):
    """A stem, a stack of width-keeping blocks, a pooled linear head."""

    def __init__(self, config: Config, *, sync_axis: str | None, local_axis: str | None = None) -> None:
        rngs = nnx.Rngs(params=config.seed, dropout=config.seed + 1)
        w = config.width
        self.stem_kind = config.stem
        self.stem: nnx.Module
        if config.stem == "dense":
            self.stem = nnx.Linear(FEATURES, w, rngs=rngs)
        elif config.stem == "conv":
            self.stem = nnx.Conv(2, w, kernel_size=(3, 3), rngs=rngs)
        else:
            self.stem = nnx.Embed(VOCAB, w, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                num_heads=2, in_features=w, qkv_features=w, decode=False, rngs=rngs
            )
        layers: list[nnx.Module] = []
        for block in config.blocks:
            if block == "linear":
                layers.append(nnx.Linear(w, w, rngs=rngs))
            elif block == "layernorm":
                layers.append(nnx.LayerNorm(w, rngs=rngs))
            elif block == "batchnorm":
                layers.append(nnx.BatchNorm(w, momentum=0.8, axis_name=local_axis, rngs=rngs))
            elif block == "batchnorm_sync":
                layers.append(nnx.BatchNorm(w, momentum=0.8, axis_name=sync_axis, rngs=rngs))
            elif block == "dropout_zero":
                layers.append(nnx.Dropout(0.0, deterministic=False, rngs=rngs))
            else:
                layers.append(nnx.Dropout(0.5, deterministic=False, rngs=rngs))
        self.blocks = nnx.List(layers)
        self.scan = config.scan
        if config.scan is not None:
            self.stack = stack(lambda rngs: Dense(w, rngs), 2, rngs)
        self.head = nnx.Linear(w, CLASSES if config.task == "classify" else TARGETS, rngs=rngs)
        # model.eval() for the rate-0.5 dropout layers only (BatchNorm keeps training)
        active = lambda _, node: isinstance(node, nnx.Dropout) and node.rate > 0
        self.set_attributes(active, deterministic=True, raise_if_not_found=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.stem(x)
        if self.stem_kind == "attention":
            h = self.attention(h)
        for layer in self.blocks:
            h = layer(h)
            if isinstance(layer, nnx.Linear):
                h = jnp.tanh(h)
        if self.scan is not None:

            def body(h: jax.Array, layer: Dense) -> tuple[jax.Array, None]:
                return layer(h), None

            body = nnx.remat(body) if self.scan == "remat" else body
            if self.scan == "prefetch":
                h = substrax.nn.scan_layers(self.stack, h)
            else:
                h, _ = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(h, self.stack)
        if h.ndim > 2:
            h = jnp.mean(h, axis=tuple(range(1, h.ndim - 1)))
        return self.head(h)


def build_model(config: Config, *, sync_axis: str | None = None, local_axis: str | None = None) -> Model:
    """The model; ``sync_axis`` goes to the "batchnorm_sync" blocks' ``axis_name``, ``local_axis``
    to the "batchnorm" ones' (the one-device reference's split runs: module doc of test_fuzz)."""
    return Model(config, sync_axis=sync_axis, local_axis=local_axis)


# ----------------------------------------------------------------------------------------- the optimizer


def _decay_mask(params: Any) -> Any:
    """Weight decay on kernels and embeddings only, not on biases or norm scales."""
    return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


class FirstGradientState(NamedTuple):
    count: jax.Array  # updates seen, saturating
    gradient: Any  # the first one, as the optimizer was handed it


def first_gradient() -> optax.GradientTransformation:
    """Pass the updates on unchanged, keeping the first step's (the gradient, before the
    optimizer scales it) in the state: the fuzzer holds it to the reference (``test_fuzz``)."""

    def init(params: Any) -> FirstGradientState:
        return FirstGradientState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(updates: Any, state: FirstGradientState, params: Any = None) -> tuple[Any, FirstGradientState]:
        del params
        first = state.count == 0
        kept = jax.tree.map(lambda g, k: jnp.where(first, g, k), updates, state.gradient)
        return updates, FirstGradientState(optax.safe_int32_increment(state.count), kept)

    return optax.GradientTransformation(init, update)


class LeafFactorsState(NamedTuple):
    factors: Any  # one float32 scalar per parameter leaf


def leaf_factors() -> optax.GradientTransformation:
    """Multiply each leaf's updates by its factor in the state (1 unless set): the mutation
    test's injection point, one compiled program for every mutation (``mutate``)."""

    def init(params: Any) -> LeafFactorsState:
        return LeafFactorsState(jax.tree.map(lambda _: jnp.ones([], jnp.float32), params))

    def update(updates: Any, state: LeafFactorsState, params: Any = None) -> tuple[Any, LeafFactorsState]:
        del params
        return jax.tree.map(lambda g, f: g * f.astype(g.dtype), updates, state.factors), state

    return optax.GradientTransformation(init, update)


def first_gradient_of(optimizer: nnx.Optimizer) -> dict[str, np.ndarray]:
    """The first step's gradient the optimizer was handed (``first_gradient``'s state), by path."""
    tapped = optimizer.opt_state[1 if isinstance(optimizer.opt_state[0], LeafFactorsState) else 0]
    flat = nnx.to_flat_state(nnx.state(tapped.gradient))
    return {"/".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


def mutate(optimizer: nnx.Optimizer, leaf: str, factor: float) -> None:
    """Multiply parameter ``leaf``'s gradient by ``factor`` in every step of ``optimizer``
    (built with ``mutable=True``): 0 zeroes it, -1 negates it."""
    factors = dict(nnx.to_flat_state(nnx.state(optimizer.opt_state[0].factors)))
    path = tuple(int(p) if p.isdigit() else p for p in leaf.split("/"))
    if path not in factors:
        raise ValueError(f"no parameter {leaf!r}; one of {sorted('/'.join(map(str, p)) for p in factors)}")
    factors[path].set_value(jnp.asarray(factor, jnp.float32))


@functools.cache
def build_tx(name: str, mutable: bool = False) -> optax.GradientTransformation:
    """One transformation per name, shared: it is part of the optimizer's graph, so a new one
    (new closures) would make ``nnx.jit`` compile every run's step again. The named optimizer
    after ``first_gradient``; ``mutable``: after ``leaf_factors`` too (``mutate``)."""
    taps = (leaf_factors(), first_gradient()) if mutable else (first_gradient(),)
    return optax.chain(*taps, _named_tx(name))


def _named_tx(name: str) -> optax.GradientTransformation:
    if name == "sgd":
        return optax.sgd(LR_SGD)
    if name == "momentum":
        return optax.sgd(LR_SGD, momentum=0.9)
    if name == "clip_sgd":
        return optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(LR_SGD * 100))
    if name == "adam":
        return optax.adam(LR_ADAPTIVE)
    if name == "adamw_masked":
        return optax.adamw(LR_ADAPTIVE, weight_decay=0.1, mask=_decay_mask)
    if name == "clip_adamw":
        return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR_ADAPTIVE, weight_decay=0.1))
    if name == "adafactor":
        return optax.adafactor(LR_ADAPTIVE, min_dim_size_to_factor=4)  # factored: these widths are small
    if name == "lamb":
        return optax.lamb(LR_ADAPTIVE)
    if name == "muon":  # its state holds optax.MaskedNode (#26.1)
        return optax.contrib.muon(LR_ADAPTIVE)
    if name == "multi_transform":  # MaskedNode too: SGD+momentum on matrices, Adam on vectors
        return optax.multi_transform(
            {"matrix": optax.sgd(LR_SGD, momentum=0.9), "vector": optax.adam(LR_ADAPTIVE)},
            lambda params: jax.tree.map(lambda p: "matrix" if jnp.ndim(p) > 1 else "vector", params),
        )
    if name == "multisteps":
        return optax.MultiSteps(optax.adam(LR_ADAPTIVE), every_k_schedule=2)
    raise ValueError(f"unknown optimizer {name!r}")


def build(
    config: Config, *, sync_axis: str | None = None, local_axis: str | None = None, mutable: bool = False
) -> tuple[Model, nnx.Optimizer]:
    model = build_model(config, sync_axis=sync_axis, local_axis=local_axis)
    return model, nnx.Optimizer(model, build_tx(config.optimizer, mutable), wrt=nnx.Param)


# ----------------------------------------------------------------------------------------- the batch


def batch_parts(config: Config, step: int) -> dict[str, np.ndarray]:
    """One step's batch as named parts: x, y, and mask / scale when drawn. Rows are global."""
    rng = np.random.default_rng([config.seed, step])
    b = config.global_rows
    if config.stem == "dense":
        x = rng.normal(size=(b, FEATURES)).astype(np.float32)
    elif config.stem == "conv":
        x = rng.normal(size=(b, IMAGE, IMAGE, 2)).astype(np.float32)
    else:
        x = rng.integers(0, VOCAB, size=(b, TOKENS)).astype(np.int32)
    if config.task == "classify":
        y = rng.integers(0, CLASSES, size=(b,)).astype(np.int32)
    else:
        y = rng.normal(size=(b, TARGETS)).astype(np.float32)
    parts: dict[str, Any] = {"x": x, "y": y}
    if config.mask:
        mask = rng.random(b) < 0.7
        mask[0] = True
        parts["mask"] = mask
    if config.scale:
        parts["scale"] = np.float32(rng.uniform(0.5, 2.0))
    return parts


ROW_PARTS = ("x", "y", "mask")


def pack(config: Config, parts: dict[str, Any]) -> Any:
    """The batch tree the loss function reads, of ``config.batch_tree``'s shape."""
    mask, scale = parts.get("mask"), parts.get("scale")
    if config.batch_tree == "flat":
        return dict(parts)
    if config.batch_tree == "nested":
        tree: dict[str, Any] = {
            "inputs": {"x": parts["x"]},
            "targets": (parts["y"],) + ((mask,) if config.mask else ()),
        }
        if config.scale:
            tree["meta"] = {"scale": scale}
        return tree
    return (parts["x"], (parts["y"],) + ((mask,) if config.mask else ())) + ((scale,) if config.scale else ())


def unpack(config: Config, tree: Any) -> dict[str, Any]:
    """``pack``'s inverse."""
    if config.batch_tree == "flat":
        return dict(tree)
    if config.batch_tree == "nested":
        parts = {"x": tree["inputs"]["x"], "y": tree["targets"][0]}
        if config.mask:
            parts["mask"] = tree["targets"][1]
        if config.scale:
            parts["scale"] = tree["meta"]["scale"]
        return parts
    parts = {"x": tree[0], "y": tree[1][0]}
    if config.mask:
        parts["mask"] = tree[1][1]
    if config.scale:
        parts["scale"] = tree[2]
    return parts


def batch_specs(config: Config) -> Any:
    """The batch's PartitionSpec tree: rows over "data" (hsdp: over "replica" and "data"), the
    batch-level scalar replicated."""
    rows = P(("replica", "data")) if config.layout == "hsdp" else P("data")
    specs = {"x": rows, "y": rows}
    if config.mask:
        specs["mask"] = rows
    if config.scale:
        specs["scale"] = P()
    return pack(config, specs)


# ----------------------------------------------------------------------------------------- the loss


def per_example(config: Config, model: nnx.Module, parts: dict[str, Any]) -> jax.Array:
    """Each row's (masked) loss."""
    out = model(parts["x"])
    if config.task == "classify":
        pe = optax.softmax_cross_entropy_with_integer_labels(out, parts["y"])
    else:
        pe = jnp.mean((out - parts["y"]) ** 2, axis=-1)
    if config.mask:
        pe = jnp.where(parts["mask"], pe, 0.0)
    return pe


def loss_of(config: Config, pe: jax.Array, parts: dict[str, Any]) -> jax.Array:
    """The loss: a mean over the rows (masked rows count as 0), times the batch-level scalar."""
    loss = jnp.mean(pe)
    return loss * parts["scale"] if config.scale else loss


def metric_name(op: str | None) -> str:
    return f"pe_{op}"


def reduce_map(config: Config) -> dict[str, str | None] | None:
    """``reduce=`` for the step: each drawn metric's reduction ("default" left out: it gets "mean")."""
    if config.metrics is None:
        return None
    return {metric_name(op): op for op in config.metrics if op != "default"}


def make_loss_fn(config: Config) -> Callable[[nnx.Module, Any], Any]:
    """The ``loss_fn`` both modes train: every metric is the per-example losses, reduced by its name."""

    def loss_fn(model: nnx.Module, batch: Any) -> Any:
        parts = unpack(config, batch)
        pe = per_example(config, model, parts)
        loss = loss_of(config, pe, parts)
        if config.metrics is None:
            return loss
        return loss, {metric_name(op): pe for op in config.metrics}

    return loss_fn
