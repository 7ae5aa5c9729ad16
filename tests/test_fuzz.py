"""The parity fuzzer: both modes, every layout, against an independent one-device reference.

Hypothesis draws a ``Config`` (``fuzz_space.py``: model blocks, optimizer, layout, mode,
microbatches, devices, batch tree, metrics, spelling, mixed-precision policy) and
``check(config)`` trains it for a few steps with ``substrax.make_train_step`` and, separately,
with a plain one-device reference (``nnx.value_and_grad`` and ``optimizer.update`` under
``nnx.jit``, no mesh; under a precision policy, the same casts: below). It checks:

- the losses, the metrics (every reduction) and the model's state (parameters and BatchNorm
  statistics) against the reference;
- that the layout is kept (``substrax.layout_of`` and every array's sharding, before == after);
- that the step's census matches its layout's rule (``step.check_communication(...).matches``,
  first named ``step.census``), on the draws that use the plain call (the bound step compiles
  the same program with donated buffers; its census would compile it once more). In explicit
  mode it must match. In implicit mode XLA's partitioner chooses, and with a few rows per
  device it may gather the batch and compute a gradient on every device instead of reducing
  it (found by this fuzzer: ``test_regression_implicit_xla_gathers_a_tiny_batch``); such a
  draw prints ``census xla-chose`` and does not fail;
- ``compare_gradients`` on the trained model, on the draws that ask for it (three more
  compiles) and where it applies (no BatchNorm: below).

What the reference computes, and why (the documented semantics, not bugs):

- **A model without BatchNorm**: the plain reference, one ``nnx.value_and_grad`` of the loss
  on the whole global batch. Microbatches, devices and layouts must not change the result.
- **BatchNorm** normalizes with the statistics of the rows it sees, so the reference sees the
  same groups of rows the step does. With ``microbatches=k`` both modes normalize each
  microbatch on its own, microbatch j being every device's j-th slice of its rows; the
  reference differentiates the mean of the k microbatch losses, one after the other (the
  running statistics updated k times). BatchNorm with ``axis_name="data"`` (explicit mode;
  built without it in implicit mode and in the reference) uses the statistics of the whole
  (micro)batch. BatchNorm *without* ``axis_name`` in **explicit** mode uses each device's shard:
  there the reference ``jax.vmap``s the loss over the devices' shards (``axis_name="data"``,
  so a synchronized BatchNorm in the same model still sees all of them), and averages the
  shards' running statistics, as the step does after it. In implicit mode it sees the global
  (micro)batch. ``compare_gradients`` has no such grouping (its explicit path always normalizes
  per shard, and its reference has no axis to bind): it is skipped for BatchNorm models.
- **Dropout** is off in every draw (rate 0, or ``deterministic=True`` on the dropout layers
  only): active dropout draws different masks in the two modes.
- **Metrics** reduced by ``None`` come back unreduced: the global value in implicit mode
  (with microbatches, one per microbatch), per device in explicit mode (with microbatches,
  per device and microbatch). The reference's per-example losses give each shape.

**Precision draws** (a third of them): the step runs under ``substrax.MixedPrecision(bfloat16,
reduce_dtype=float32 or bfloat16)``, and the reference applies the same policy on one device,
written out (``_low_precision_value_and_grad``): the loss of the parameters and the floating
batch leaves cast to bfloat16, differentiated with respect to the float32 parameters through
the cast, the loss and per-example losses in float32, the gradient rounded to ``reduce_dtype``,
the update in float32. Its split runs (below) round as the step does: a gradient per device and
microbatch in bfloat16, added one after another in ``reduce_dtype``
(``_sliced_low_precision_value_and_grad``). The draw also checks that the loss and the metrics
come back float32 and that the parameters and the optimizer state are float32 after training
(every draw does); the census is the step's own, which takes the policy (explicit mode expects
gathers in ``param_dtype`` and reductions in ``reduce_dtype``, widened to float32 on CPU);
``compare_gradients`` runs under the policy.

Tolerances come from a noise floor measured in every draw: the reference is run again on
``FLOOR_RUNS`` row-permuted batches (rows permuted only within the groups a BatchNorm
normalizes together, so each permuted run is just as valid; the loss is a row mean, invariant
to the order), which sums every batch reduction in another order, and twice more "split": the
same loss computed slice by slice, one slice per device and microbatch as the step cuts the
batch (partial sums added one after the other; with BatchNorm, the slices vmapped over an axis
the statistics are reduced over), which rounds like the step's own partial sums and smaller
matrix products. The floor of a quantity is the largest deviation between any two of those
runs (the reference included), per state leaf, per metric and over the losses.

Under the SGD family a value must be within ``atol 1e-6 + rtol 1e-5``; under the Adam family
(adaptive steps turn a near-zero gradient element's round-off into a visible difference: an
attention key bias, a bias before BatchNorm) within ``max(1e-6, 4 x floor + 1e-7) + rtol
1e-5``. The SGD family is held to the floor rule too where the floor itself is above 1e-6:
BatchNorm over 2-4 rows divides by the square root of a variance that can be tiny, which
amplifies round-off in any implementation (a failing line shows the floor next to the
deviation). A precision draw measures its floor over more split runs (``BF16_SPLIT_RUNS``, on
rows permuted across the slices: in bfloat16 a permutation within a slice rarely changes a
bit) and holds every value to the floor rule, the loss and the metrics with ``rtol BF16_RTOL``
(one bfloat16 unit in the last place) instead of 1e-5; the measurements are at the constants.

**The first step's gradient** (every draw): the optimizer's first transformation
(``fuzz_space.first_gradient``) keeps the gradient it is handed at the first step, before
Adam divides it by its own magnitude, and that gradient is held to the reference's, per
parameter. A tolerance on the parameters after Adam's steps measures what round-off does to
them, and at a leaf where that is a step's worth it cannot see the gradient zeroed or negated
(bfloat16 + BatchNorm + Adam, seed 72: ``blocks/2/scale``'s tolerance 2e-2, its gradient
zeroed 0.48x of it, negated 0.74x). Float32 draws hold the gradient to the floor rule, its
floor measured over the same runs. A precision draw holds it to the float32 one-device
gradient (the same groups of rows, no policy), within ``BF16_GRADIENT_ROUNDINGS x u x
max|g|`` (u = 2**-8, bfloat16's unit round-off; ``max|g|`` the leaf's largest float32
element) plus ``SAFETY x`` its floor, the largest deviation of a bfloat16 reference run from
float32. The first term bounds the rounding of the products and partial sums a gradient
element adds up, each at most u relative, where they do not cancel; the second what
bfloat16 does where they do: a bias before BatchNorm has a float32 gradient of 5e-9 and a
bfloat16 one of 6e-4, the round-off of the terms that cancel. The parameters of a precision
draw are held to their floor as before. A leaf's zeroed gradient fails the check where its
tolerance is below ``max|g|``: ``test_the_check_fails_when_any_leafs_gradient_is_zeroed_or_negated``
zeroes and negates each leaf of two draws (a leaf whose gradient is zero but for round-off
excepted: there the mutation changes nothing a check could see). A draw's line lists the
leaves whose tolerance is at least their gradient as ``blind``: zero but for round-off (an
attention key bias, a bias or scale before BatchNorm: every one in a sample of 36 draws),
or one whose bfloat16 round-off is as large as it (measured: a scanned layer's bias summing
4 rows of a classification, bfloat16 runs 0.13-0.44 x its size off float32).

``make test`` runs a fixed-seed sample (``SUBSTRAX_FUZZ`` unset: profile ``fuzz-ci``);
``make fuzz`` (``SUBSTRAX_FUZZ=full``) a few hundred random draws (``SUBSTRAX_FUZZ_EXAMPLES``),
printing one line per draw. Every failing draw is listed at the end with its ``Config`` as
Python code: ``check(Config(...)).assert_ok()`` is its regression test.
``SUBSTRAX_FUZZ_PIN="scan='prefetch',units='stack',layout='fsdp'"`` holds those fields of
every draw (Python literals), to search one corner of the space.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from fuzz_space import (
    MIN_BATCHNORM_ROWS,
    ROW_PARTS,
    Config,
    batch_parts,
    batch_specs,
    build,
    configs,
    first_gradient_of,
    loss_of,
    make_loss_fn,
    measurable,
    metric_name,
    mutate,
    pack,
    per_example,
    prefetch_of,
    reduce_map,
    units_of,
    unpack,
)
from hypothesis import HealthCheck, example, given, settings
from jax.sharding import NamedSharding, PartitionSpec

import substrax
from substrax.explicit import compare_gradients
from substrax.mesh import create_device_mesh
from substrax.spmd import place_batch_on_shards

P = PartitionSpec
STRICT_RTOL, STRICT_ATOL = 1e-5, 1e-6
SAFETY, FLOOR_EPS = 4.0, 1e-7
FLOOR_RUNS = 3  # permuted reference runs per draw, besides the reference itself
# The bfloat16 tolerance of a precision draw (module docstring, "Precision draws"), measured
# on 76 precision draws with 16 valid one-device runs each (the reference, 3 permuted, 12
# split), holding the runs left out against the tolerance from the first K:
# - the floor: in bfloat16 most permuted runs round to the same bits as the reference, and an
#   adaptive step turns a gradient element at round-off into a whole step either way; with
#   K = 5 (a float32 draw's runs) 62 of 912 held-out valid runs fell outside, with K = 8 6 of
#   684, with K = 14 1 of 228 (the step under test: 0 of 73). So a precision draw has
#   BF16_SPLIT_RUNS more split runs (K = 14), each one run of the compiled reference step.
# - BF16_RTOL, on the loss and the metrics only (computed in bfloat16; the state is float32,
#   held to its floor): one bfloat16 unit in the last place, 2**-7 relative. The largest
#   relative excess of a held-out run's loss or metric over its floor rule was 6.4e-3
#   (1.64 x 2**-8) at K = 5, 7.9e-4 at K = 8, none at K = 14: a per-example loss a unit apart
#   where every run of the floor rounded alike.
BF16_RTOL = 2.0**-7
BF16_SPLIT_RUNS = 9  # permuted split runs in a precision draw, besides the unpermuted one (float32: 1)
BF16_U = 2.0**-8  # bfloat16's unit round-off
# The first gradient's bound under a policy (module docstring, "The first step's gradient"), in
# units of u x max|g|: a gradient element sums products whose factors (a parameter, the batch,
# the activations and cotangents of a dozen layers) and partial sums are each rounded once to
# bfloat16, at most u relative each. Measured on 10 precision draws against float32: kernels
# 0.9-3.2 u; biases whose rows cancel up to 35 u, each within SAFETY x its floor (the worst
# deviation 0.22x its tolerance; in a make fuzz sample of 36 draws, 0.26x). A zeroed gradient
# is 16x the first term.
BF16_GRADIENT_ROUNDINGS = 16

settings.register_profile(
    "fuzz-ci",
    # 4 drawn configurations (CURATED run as tests of their own): there were 6 before the precision axis,
    # which changed which ones are drawn; 6 of the new draws took 48 of the sample's 86 cpu-s, 4 keep it
    # near 70
    max_examples=4,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz-full",
    max_examples=int(os.environ.get("SUBSTRAX_FUZZ_EXAMPLES", "300")),
    derandomize=False,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = "fuzz-full" if os.environ.get("SUBSTRAX_FUZZ") == "full" else "fuzz-ci"

# ----------------------------------------------------------------------------------------- row groups


def row_groups(config: Config, *, split: bool = False) -> np.ndarray:
    """The rows the reference computes together: indices of shape (groups, parts, rows).

    Device d holds global rows ``[d*k*m, (d+1)*k*m)``; its microbatch j is ``m`` rows from
    ``d*k*m + j*m``. Without BatchNorm there is one group, the batch. With it a group is one
    microbatch (every device's j-th slice, in device order), the rows a BatchNorm normalizes
    together; it has one part per device where explicit mode normalizes per shard, else one
    part. ``split``: every group cut into the devices' (and microbatches') slices, as the
    step computes them, for the floor's split runs (a BatchNorm that normalizes the whole
    group then reduces its statistics over the parts).
    """
    n, k, m = config.devices, config.microbatches, config.rows
    rows = np.arange(config.global_rows).reshape(n, k, m)  # [device, microbatch, row]
    if not config.batchnorm:
        return rows.reshape(1, n * k, m) if split else rows.reshape(1, 1, -1)
    by_microbatch = rows.transpose(1, 0, 2)  # [microbatch, device, row]
    if split or per_shard_statistics(config):
        return by_microbatch
    return by_microbatch.reshape(k, 1, n * m)


def per_shard_statistics(config: Config) -> bool:
    """Explicit mode with a BatchNorm that has no axis_name: statistics per device shard."""
    return config.mode == "explicit" and "batchnorm" in config.blocks and config.devices > 1


def within_group_permutation(config: Config, seed: int, *, split: bool = False) -> np.ndarray:
    """A row permutation that keeps every row in its group and part."""
    rng = np.random.default_rng(seed)
    perm = np.arange(config.global_rows)
    groups = row_groups(config, split=split)
    for block in groups.reshape(-1, groups.shape[-1]):
        perm[block] = rng.permutation(block)
    return perm


# ----------------------------------------------------------------------------------------- the reference


@dataclasses.dataclass
class Run:
    """What a training run gave: per step the loss and the metrics, and the final state."""

    losses: list[float]
    metrics: list[dict[str, np.ndarray]]
    state: dict[str, np.ndarray]
    gradient: dict[str, np.ndarray]  # the first step's, as the optimizer was handed it


def state_of(model: nnx.Module) -> dict[str, np.ndarray]:
    """Parameters and BatchNorm statistics, by path."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
    return {"/".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


def _average(x: jax.Array) -> jax.Array:
    """The mean over the parts' leading axis; a non-float leaf (random keys, counts) is equal in all."""
    return jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0]


def _grouped_loss(
    config: Config, groups: np.ndarray
) -> Callable[[nnx.Module, Any], tuple[jax.Array, jax.Array]]:
    """The loss of ``row_groups``: the mean of the groups' losses, the groups one after the other
    (a ``lax.scan``, carrying the BatchNorm statistics). A BatchNorm model's parts are vmapped
    over the axis "data" and their statistics averaged; a model without one adds its parts'
    losses one after the other too (a ``lax.scan``: partial sums, as devices and microbatches do).
    """

    def loss(model: nnx.Module, tree: Any) -> tuple[jax.Array, jax.Array]:
        parts = unpack(config, tree)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        rows = {name: v[groups] for name, v in parts.items() if name in ROW_PARTS}  # (groups, parts, m, ...)
        whole = {name: v for name, v in parts.items() if name not in ROW_PARTS}

        # the parameters travel as arguments, not closed over: a model that runs nnx.scan
        # itself takes only values of the trace it runs in
        def one(rest: Any, params: Any, piece: dict) -> tuple[Any, tuple[jax.Array, jax.Array]]:
            m = nnx.merge(graphdef, params, rest)
            piece = {**piece, **whole}
            pe = per_example(config, m, piece)
            return nnx.state(m, nnx.Not(nnx.Param)), (loss_of(config, pe, piece), pe)

        def group(carry: Any, piece: dict) -> tuple[Any, tuple[jax.Array, jax.Array]]:
            rest, params = carry
            if config.batchnorm:
                rests, out = jax.vmap(one, in_axes=(None, None, 0), out_axes=0, axis_name="data")(
                    rest, params, piece
                )
                rest = jax.tree.map(_average, rests)
            else:

                def next_part(c: Any, part: dict) -> tuple[Any, Any]:
                    rest, out = one(*c, part)
                    return (rest, c[1]), out

                (rest, _), out = jax.lax.scan(next_part, (rest, params), piece)
            losses, pe = out
            return (rest, params), (jnp.mean(losses), pe.reshape(-1))

        (rest, _), (losses, pes) = jax.lax.scan(group, (rest, params), rows)
        nnx.update(model, rest)
        return jnp.mean(losses), pes.reshape(-1)

    return loss


def _cast(tree: Any, dtype: Any) -> Any:
    """Every floating leaf of ``tree`` in ``dtype``."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _low_precision_value_and_grad(
    loss_fn: Callable[[nnx.Module, Any], tuple[jax.Array, jax.Array]], param_dtype: Any, reduce_dtype: Any
) -> Callable[[nnx.Module, Any], tuple[tuple[jax.Array, jax.Array], nnx.State]]:
    """The mixed-precision policy on one device, written out: the loss of the parameters and
    the floating batch leaves cast to ``param_dtype``, differentiated with respect to the
    float32 parameters through the cast; the loss and per-example losses in float32; the
    gradient rounded to ``reduce_dtype`` (one device has no reduction to run in it) and
    handed to the optimizer in float32. The model's other state (BatchNorm statistics) stays
    in its own dtype and is updated."""

    def cast_loss(model: nnx.Module, tree: Any) -> tuple[jax.Array, jax.Array]:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        low = nnx.merge(graphdef, _cast(params, param_dtype), rest)
        loss, pe = loss_fn(low, _cast(tree, param_dtype))
        nnx.update(model, nnx.state(low, nnx.Not(nnx.Param)))
        return loss.astype(jnp.float32), pe.astype(jnp.float32)

    def value_and_grad(model: nnx.Module, tree: Any) -> tuple[tuple[jax.Array, jax.Array], nnx.State]:
        out, grads = nnx.value_and_grad(cast_loss, has_aux=True)(model, tree)
        return out, _cast(_cast(grads, reduce_dtype), jnp.float32)

    return value_and_grad


def _sliced_low_precision_value_and_grad(
    config: Config, groups: np.ndarray, param_dtype: Any, reduce_dtype: Any, *, by_device: bool = False
) -> Callable[[nnx.Module, Any], tuple[tuple[jax.Array, jax.Array], nnx.State]]:
    """The policy's split run for the floor, rounded as the step rounds: the gradient of each
    part of ``row_groups(split=True)`` (one per device and microbatch) is taken on its own, in
    ``param_dtype``, and the parts' gradients are added one by one in ``reduce_dtype``:
    microbatch after microbatch, each one's devices in order; ``by_device``: each device's
    microbatches first, then the devices' sums (another valid order of the same additions).

    A group's parts run vmapped over "data" (a BatchNorm that normalizes the whole group
    reduces its statistics over it, as in ``_grouped_loss``), each with its own copy of the
    cast parameters; the gradient with respect to part i's copy is part i's share of the
    group's gradient (their sum is the gradient: the chain rule), in ``param_dtype``, as a
    device's gradient is before the step reduces it. The groups run one after the other (a
    ``lax.scan``, carrying the statistics and the gradient's running sum). The loss is the
    float32 mean of the parts' float32 losses. Run on rows permuted across the parts, every
    run rounds a different set of partial sums."""
    f32 = jnp.float32
    count = groups.shape[0] * groups.shape[1]

    def value_and_grad(model: nnx.Module, tree: Any) -> tuple[tuple[jax.Array, jax.Array], nnx.State]:
        parts = unpack(config, tree)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        rows = {name: v[groups] for name, v in parts.items() if name in ROW_PARTS}  # (groups, parts, m, ...)
        whole = {name: v for name, v in parts.items() if name not in ROW_PARTS}

        def group_loss(copies: nnx.State, rest: Any, piece: dict) -> tuple[jax.Array, tuple[jax.Array, Any]]:
            def one(low: nnx.State, rest: Any, part: dict) -> tuple[Any, tuple[jax.Array, jax.Array]]:
                m = nnx.merge(graphdef, low, rest)
                part = _cast({**part, **whole}, param_dtype)
                pe = per_example(config, m, part)
                return nnx.state(m, nnx.Not(nnx.Param)), (
                    loss_of(config, pe, part).astype(f32),
                    pe.astype(f32),
                )

            rests, (losses, pe) = jax.vmap(one, in_axes=(0, None, 0), axis_name="data")(copies, rest, piece)
            return jnp.sum(losses) / count, (pe.reshape(-1), jax.tree.map(_average, rests))

        size = groups.shape[1]

        def group(carry: tuple[Any, Any], piece: dict) -> tuple[tuple[Any, Any], tuple[jax.Array, jax.Array]]:
            rest, total = carry
            copies = jax.tree.map(lambda p: jnp.broadcast_to(p.astype(param_dtype), (size, *p.shape)), params)
            (loss, (pe, rest)), shares = jax.value_and_grad(group_loss, has_aux=True)(copies, rest, piece)
            if by_device:  # every device's running sum, in reduce_dtype
                total = jax.tree.map(lambda t, g: t + g.astype(reduce_dtype), total, shares)
            else:
                for i in range(size):  # one device's gradient after another, in reduce_dtype
                    total = jax.tree.map(lambda t, g, i=i: t + g[i].astype(reduce_dtype), total, shares)
            return (rest, total), (loss, pe)

        shape = (size,) if by_device else ()
        zeros = jax.tree.map(lambda p: jnp.zeros((*shape, *p.shape), reduce_dtype), params)
        (rest, total), (losses, pes) = jax.lax.scan(group, (rest, zeros), rows)
        if by_device:  # the devices' sums, one after another
            total = jax.tree.map(lambda t: functools.reduce(jnp.add, list(t)), total)
        nnx.update(model, rest)
        return (jnp.sum(losses), pes.reshape(-1)), _cast(total, f32)

    return value_and_grad


def reference_runs(
    config: Config,
    batches: list[dict],
    permutations: list[np.ndarray | None],
    *,
    split: bool = False,
    by_device: bool = False,
) -> list[Run]:
    """Train on one device, no mesh, once per permutation: the plain step, or the grouped one for
    BatchNorm (module docstring). A permutation reorders every batch's rows first (within
    groups; ``None``: as drawn); the per-example values come back in the original order.
    ``split``: the loss computed slice by slice (``row_groups(split=True)``), the same function
    summed another way, for the floor. Under a precision policy the step applies it
    (``_low_precision_value_and_grad``; split: ``_sliced_low_precision_value_and_grad``).
    """
    groups = row_groups(config, split=split)
    plain = groups.shape[:2] == (1, 1)
    device = jax.devices()[0]
    # The parts of a group are vmapped over an axis "data": a BatchNorm that normalizes the
    # whole group reduces over it; one that normalizes each device's shard (explicit mode,
    # no axis_name) does not.
    sync_axis = "data" if not plain and (split or per_shard_statistics(config)) else None
    local_axis = "data" if not plain and split and not per_shard_statistics(config) else None

    def plain_loss(model: nnx.Module, tree: Any) -> tuple[jax.Array, jax.Array]:
        parts = unpack(config, tree)
        pe = per_example(config, model, parts)
        return loss_of(config, pe, parts), pe

    loss_fn = plain_loss if plain else _grouped_loss(config, groups)
    if config.dtypes is None:
        value_and_grad = nnx.value_and_grad(loss_fn, has_aux=True)
    elif split:
        value_and_grad = _sliced_low_precision_value_and_grad(
            config, groups, *config.dtypes, by_device=by_device
        )
    else:
        value_and_grad = _low_precision_value_and_grad(loss_fn, *config.dtypes)

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, tree: Any) -> tuple[jax.Array, jax.Array]:
        (loss, pe), grads = value_and_grad(model, tree)
        optimizer.update(model, grads)
        return loss, pe

    order = groups.reshape(-1)  # row i of pe is global row order[i]
    runs = []
    for permutation in permutations:
        rows = np.arange(config.global_rows) if permutation is None else permutation
        with jax.default_device(device):
            model, optimizer = build(config, sync_axis=sync_axis, local_axis=local_axis)
            state = nnx.state((model, optimizer))  # committed to the device, as the step's outputs are:
            nnx.update((model, optimizer), jax.device_put(state, device))  # one compile, not two
            losses, metrics = [], []
            for parts in batches:
                moved = {name: v[rows] if name in ROW_PARTS else v for name, v in parts.items()}
                loss, pe = step(model, optimizer, jax.device_put(pack(config, moved), device))
                back = np.empty(config.global_rows, np.float32)
                back[rows[order]] = np.asarray(pe)
                losses.append(float(loss))
                metrics.append(expected_metrics(config, back))
        runs.append(Run(losses, metrics, state_of(model), first_gradient_of(optimizer)))
    return runs


def expected_metrics(config: Config, pe: np.ndarray) -> dict[str, np.ndarray]:
    """Every drawn metric as the step returns it, from the per-example losses in global order."""
    if config.metrics is None:
        return {}
    n, k, m = config.devices, config.microbatches, config.rows
    out = {}
    value: Any
    for op in config.metrics:
        if op in ("mean", "default"):
            value = pe.mean()
        elif op in ("sum", "max", "min"):
            value = getattr(pe, op)()
        elif op == "gather":
            value = pe
        elif config.mode == "explicit":  # None: per device (and microbatch)
            value = pe.reshape(n, k, m) if k > 1 else pe.reshape(n, k * m)
        else:  # None, implicit: the global value, per microbatch
            value = pe.reshape(n, k, m).transpose(1, 0, 2).reshape(k, n * m) if k > 1 else pe
        out[metric_name(op)] = np.asarray(value, np.float32)
    return out


# ------------------------------------------------------------------------------------- the step under test


@dataclasses.dataclass
class DeviceRun:
    run: Run | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    census: str = "-"
    gradients: str = "-"


def _shardings(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, tuple[Any, int]]:
    flat = nnx.to_flat_state(nnx.state((model, optimizer)))
    return {
        "/".join(map(str, p)): (v.get_value().sharding, v.get_value().ndim)
        for p, v in flat
        if hasattr(v.get_value(), "sharding")
    }


def _layout_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Arrays whose placement changed: a mesh placement must stay equivalent; an unplaced one replicated."""
    changed = []
    for path, (old, ndim) in before.items():
        new, _ = after[path]
        if isinstance(old, NamedSharding):
            same = isinstance(new, NamedSharding) and new.is_equivalent_to(
                NamedSharding(new.mesh, old.spec), ndim
            )
        else:
            same = new.is_fully_replicated
        if not same:
            changed.append(f"{path}: {getattr(old, 'spec', old)} -> {getattr(new, 'spec', new)}")
    return changed


def _host(array: jax.Array) -> np.ndarray:
    """``array`` on the host; a typed PRNG key array as its raw data (it has no host form)."""
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        array = jax.random.key_data(array)
    return np.asarray(array)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _train_step(config: Config, mesh: jax.sharding.Mesh) -> substrax.TrainStep:
    """The step under test."""
    return substrax.make_train_step(
        make_loss_fn(config),
        config.mode,  # type: ignore[arg-type]
        mesh=mesh,
        batch_spec=batch_specs(config) if config.placement == "batch_spec" else None,
        has_aux=config.has_aux,
        reduce=reduce_map(config),
        microbatches=config.microbatches,
        precision=config.policy(),
    )


_kept_train_step = functools.lru_cache(maxsize=1)(_train_step)


def device_run(config: Config, batches: list[dict], mutation: tuple[str, float] | None = None) -> DeviceRun:
    """Train with ``make_train_step`` on ``config.devices`` devices; check layout, census, gradients.
    ``mutation``: ``(leaf, factor)``, that parameter's gradient multiplied by factor in every
    step (``fuzz_space.mutate``; the mutation test's)."""
    out = DeviceRun()
    devices = jax.devices()[: config.devices]
    hybrid = config.layout == "hsdp"  # the rows over (replica, data), the state split over data only
    replicas = 2 if hybrid and config.devices >= 2 else 1
    shape = {"replica": replicas, "data": config.devices // replicas} if hybrid else {"data": config.devices}
    mesh = create_device_mesh(shape, devices=devices)
    sync = ("replica", "data") if hybrid else "data"  # a synchronized BatchNorm sees the global batch
    sync_axis = sync if config.mode == "explicit" else None
    model, optimizer = build(config, sync_axis=sync_axis, mutable=mutation is not None)
    if mutation is not None:
        mutate(optimizer, *mutation)
    try:
        if config.layout != "replicated":
            size: dict[str, Any] = {} if config.min_size is None else {"min_size": config.min_size}
            substrax.shard_state(
                model,
                optimizer,
                mesh=mesh,
                layout=config.layout,
                units=units_of(config),
                reshard_after_forward=config.reshard,
                prefetch=prefetch_of(config),
                **size,
            )
    except Exception as e:  # noqa: BLE001
        out.problems.append(f"shard_state raised {_first_line(e)}")
        return out
    layout_before = substrax.layout_of(model, optimizer, mesh=mesh)
    placed_before = _shardings(model, optimizer)
    specs = batch_specs(config)
    # a mutation's step kept for the next: one program for every mutation (fuzz_space.mutate)
    step = (_train_step if mutation is None else _kept_train_step)(config, mesh)
    loss_fn = step.loss_fn
    if config.placement == "placed":
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
        feed = [place_batch_on_shards(pack(config, b), shardings) for b in batches]
    else:
        feed = [pack(config, b) for b in batches]
    try:
        held: list[tuple[jax.Array, np.ndarray]] = []
        if config.spelling == "bind":
            with step.bind(model, optimizer) as fast:
                outs = [jax.device_get(fast(b)) for b in feed]
        else:
            outs = []
            for b in feed:
                if config.spelling == "held":
                    held += [(a, _host(a)) for a in jax.tree.leaves(nnx.state((model, optimizer)))]
                outs.append(jax.device_get(step(model, optimizer, b)))
    except Exception as e:  # noqa: BLE001
        out.problems.append(f"step raised {_first_line(e)}")
        return out
    if any(a.is_deleted() or not np.array_equal(_host(a), v) for a, v in held):
        out.problems.append("an array the caller held was deleted or changed by the step")
    programs = sum(f._cache_size() for f in step._pure_steps.values())
    if config.spelling == "held" and programs != 1:
        out.problems.append(f"the plain call compiled {programs} programs with arrays held (one, donated)")
    losses = [float(o[0] if config.has_aux else o) for o in outs]
    metrics = (
        [{k: np.asarray(v) for k, v in o[1].items()} for o in outs] if config.has_aux else [{}] * len(outs)
    )
    out.run = Run(losses, metrics, state_of(model), first_gradient_of(optimizer))
    # Under a policy too the loss and the floating metrics come back in float32, and the
    # parameters and the optimizer state stay float32 (every model here is built float32).
    returned = [o[0] if config.has_aux else o for o in outs] + [v for m in metrics for v in m.values()]
    narrow = {str(np.asarray(v).dtype) for v in returned if np.asarray(v).dtype.kind == "f"} - {"float32"}
    if narrow:
        out.problems.append(f"the loss or a metric came back in {sorted(narrow)}, not float32")
    changed = [
        f"{'/'.join(map(str, p))} {v.get_value().dtype}"
        for p, v in nnx.to_flat_state(nnx.state((model, optimizer)))
        if hasattr(v.get_value(), "dtype")  # not an optax.MaskedNode
        and jnp.issubdtype(v.get_value().dtype, jnp.floating)
        and v.get_value().dtype != jnp.float32
    ]
    if changed:
        out.problems.append(f"{len(changed)} state array(s) not float32 after training, e.g. {changed[0]}")

    layout_after = substrax.layout_of(model, optimizer, mesh=mesh)
    if layout_after != layout_before:
        out.problems.append(f"layout_of changed: {layout_before.kind} -> {layout_after.kind}")
    moved = _layout_changes(placed_before, _shardings(model, optimizer))
    if moved:
        out.problems.append(f"{len(moved)} array(s) moved, e.g. {moved[0]}")
    # The census on plain-call draws: the bound step compiles the same program with donated
    # buffers, and its census would compile it once more.
    if config.spelling == "call" and mutation is None:  # a mutation changes no collective
        try:
            found = step.check_communication(model, optimizer, feed[0])
            out.census = "ok" if found.matches else "MISMATCH"
            if not found.matches and config.mode == "implicit":
                # XLA chooses implicit mode's partition: with a few rows per device it may
                # gather the batch and compute a gradient on every device instead of reducing
                # it (test_regression_implicit_xla_gathers_a_tiny_batch). Shown, not failed.
                out.census = "xla-chose"
            elif not found.matches:
                out.problems.append("census mismatch: " + " | ".join(found.differences)[:600])
                if os.environ.get("SUBSTRAX_FUZZ_CENSUS"):
                    print(found)
        except Exception as e:  # noqa: BLE001
            out.census = "raised"
            out.problems.append(f"census raised {_first_line(e)}")
    if config.compare_gradients and not config.batchnorm:
        try:
            report = compare_gradients(
                model,
                loss_fn,
                pack(config, batches[0]),
                mesh,
                batch_spec=specs,
                has_aux=config.has_aux,
                precision=config.policy(),
            )
            out.gradients = (
                f"ok {report.max_abs_diff:.1e}" if report.ok else f"MISMATCH {report.max_abs_diff:.1e}"
            )
            if not report.ok:
                out.problems.append(f"compare_gradients: {' | '.join(report.diagnosis.values())[:400]}")
        except Exception as e:  # noqa: BLE001
            out.gradients = "raised"
            out.problems.append(f"compare_gradients raised {_first_line(e)}")
    return out


# ----------------------------------------------------------------------------------------- the checks


@dataclasses.dataclass
class Deviation:
    """One quantity's comparison: the largest |got - want| and the worst element's error in
    tolerances, with where it was and that element's floor and tolerance."""

    abs: float = 0.0
    ratio: float = 0.0
    where: str = ""
    floor: float = 0.0
    tol: float = 0.0
    shapes: list[str] = dataclasses.field(default_factory=list)  # values whose shapes differ

    def add(
        self,
        config: Config,
        got: Any,
        want: Any,
        floor: float,
        where: str,
        *,
        computed: bool = True,
        tol: float | None = None,
    ) -> None:
        """Fold in one comparison; ``computed``: a value the loss function computes (the loss, a
        metric), not the float32 state; ``tol``: the tolerance, given (else the floor rule's)."""
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if got.shape != want.shape:
            self.shapes.append(f"{where}: shape {got.shape}, reference {want.shape}")
            return
        diff = np.abs(got - want)
        if tol is None:
            tol = atol_for(config, floor) + rtol_for(config, computed=computed) * np.abs(want)
        tol = np.broadcast_to(np.asarray(tol, np.float64), want.shape)
        ratios = diff / tol
        worst = int(np.argmax(ratios)) if ratios.size else 0
        ratio = float(ratios.flat[worst]) if ratios.size else 0.0
        if not np.all(np.isfinite(got)):
            ratio = float("inf")
        if ratio > self.ratio or not self.where:
            self.ratio, self.where, self.floor = ratio, where, floor
            self.tol = float(tol.flat[worst]) if tol.size else 0.0
        self.abs = max(self.abs, float(np.max(diff, initial=0.0)))

    @property
    def problems(self) -> list[str]:
        if self.ratio <= 1.0:
            return self.shapes
        off = (
            f"off the reference: worst {self.where}, |diff| up to {self.abs:.2e}, {self.ratio:.1f}x its "
            f"tolerance {self.tol:.1e} (measured floor there {self.floor:.1e})"
        )
        return [*self.shapes, off]

    def __str__(self) -> str:
        return f"{self.abs:.1e}({self.ratio:.2f})"


def atol_for(config: Config, floor: float) -> float:
    """The absolute tolerance: the measured floor (x SAFETY) under Adam-like steps and under a
    precision policy; strict under SGD, unless the floor itself is above the strict tolerance
    (BatchNorm on a few rows)."""
    if config.adaptive or config.precision is not None or floor > STRICT_ATOL:
        return max(STRICT_ATOL, SAFETY * floor + FLOOR_EPS)
    return STRICT_ATOL


def rtol_for(config: Config, *, computed: bool) -> float:
    """The relative tolerance: ``BF16_RTOL`` for the loss and the metrics under a precision
    policy (computed in bfloat16), else strict (the parameters and the optimizer state stay
    float32; what bfloat16 does to them, through the gradients, is in their floor)."""
    return BF16_RTOL if computed and config.precision is not None else STRICT_RTOL


@dataclasses.dataclass
class Result:
    config: Config
    problems: list[str]
    deviations: dict[str, Deviation]
    floors: dict[str, float]
    census: str = "-"
    gradients: str = "-"
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time: the machine is shared, wall time says little
    # parameters whose first gradient's tolerance is at least its largest element: their
    # gradient zeroed would pass (zero but for round-off, or below bfloat16's round-off of the
    # terms it sums)
    blind: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        devs = " ".join(f"{name} {d}" for name, d in self.deviations.items())
        floors = "/".join(f"{self.floors.get(k, 0.0):.0e}" for k in ("loss", "gradient", "state", "metrics"))
        return (
            f"{'ok  ' if self.ok else 'FAIL'} {self.seconds:4.1f}s/{self.cpu_seconds:4.1f}cpu "
            f"{self.config.short()} | {devs} | "
            f"floor l/g/s/m {floors} | census {self.census} grads {self.gradients}"
            + ("" if not self.blind else f" | blind {','.join(self.blind)}")
            + ("" if self.ok else f" | {self.problems[0][:160]}")
        )

    def report(self) -> str:
        lines = [f"check({self.config!r}).assert_ok()", *(f"  - {p}" for p in self.problems)]
        devs = ", ".join(f"{name} {d} worst at {d.where or '-'}" for name, d in self.deviations.items())
        floors = ", ".join(f"{name} {v:.1e}" for name, v in self.floors.items())
        lines.append(f"  max |diff| (worst in tolerances): {devs}; largest floors: {floors}")
        return "\n".join(lines)

    def assert_ok(self) -> None:
        assert self.ok, self.report()


def _floors(config: Config, runs: list[Run]) -> tuple[float, dict[str, float], dict[str, float]]:
    """The largest deviation between any two of the reference runs: over the losses, per metric, per leaf."""
    pairs = [(a, b) for i, a in enumerate(runs) for b in runs[i + 1 :]]
    loss = max((abs(x - y) for a, b in pairs for x, y in zip(a.losses, b.losses, strict=True)), default=0.0)
    metrics = {
        name: max(
            _maxdiff(a.metrics[t][name], b.metrics[t][name]) for a, b in pairs for t in range(config.steps)
        )
        for name in runs[0].metrics[0]
    }
    state = {name: max(_maxdiff(a.state[name], b.state[name]) for a, b in pairs) for name in runs[0].state}
    return loss, metrics, state


def _maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b), initial=0.0))


@dataclasses.dataclass
class Reference:
    """What ``check`` holds a draw to: the reference runs (the first as drawn, the rest the
    floor's) and, under a precision policy, the first step's float32 gradient (no policy)."""

    runs: list[Run]
    gradient32: dict[str, np.ndarray] | None = None

    @property
    def gradient(self) -> dict[str, np.ndarray]:
        """The first step's gradient the step's is held to: float32, without a policy too."""
        return self.runs[0].gradient if self.gradient32 is None else self.gradient32


def reference(config: Config, batches: list[dict]) -> Reference:
    """The reference runs of ``config`` (module docstring), and its float32 gradient under a policy."""
    permutations = [within_group_permutation(config, s) for s in range(1, FLOOR_RUNS + 1)]
    runs = reference_runs(config, batches, [None, *permutations])
    if config.precision is None:
        split = [within_group_permutation(config, 0, split=True)]
    else:  # rows moved across the slices: other partial sums (_sliced_low_precision_value_and_grad)
        split = [within_group_permutation(config, 100 + s) for s in range(BF16_SPLIT_RUNS)]
        # and the parts' bfloat16 gradients added in the other order, as devices add them
        # (test_regression_bf16_gradients_added_device_by_device)
        half = BF16_SPLIT_RUNS // 2
        runs += reference_runs(config, batches, [None, *split[half:]], split=True, by_device=True)
        split = split[:half]
    runs += reference_runs(config, batches, [None, *split], split=True)
    if config.precision is None:
        return Reference(runs)
    plain = dataclasses.replace(config, precision=None)  # the same groups of rows, in float32
    return Reference(runs, reference_runs(plain, batches[:1], [None])[0].gradient)


def batches_of(config: Config) -> list[dict]:
    """Every step's batch, as named parts (``fuzz_space.batch_parts``)."""
    return [batch_parts(config, s) for s in range(config.steps)]


@functools.lru_cache(maxsize=32)
def kept_reference(config: Config) -> Reference:
    """``reference(config, batches_of(config))``, kept (a few kB a draw): the mutation test
    holds its runs to the reference of a draw another test checks."""
    return reference(config, batches_of(config))


def gradient_floors(config: Config, ref: Reference) -> dict[str, float]:
    """Each parameter's floor on the first step's gradient, by path: the largest deviation
    between any two reference runs; under a policy, of a bfloat16 reference run from float32."""
    if config.precision is None:
        pairs = [(a, b) for i, a in enumerate(ref.runs) for b in ref.runs[i + 1 :]]
        return {
            name: max((_maxdiff(a.gradient[name], b.gradient[name]) for a, b in pairs), default=0.0)
            for name in ref.gradient
        }
    return {name: max(_maxdiff(r.gradient[name], g) for r in ref.runs) for name, g in ref.gradient.items()}


def gradient_tolerance(config: Config, want: np.ndarray, floor: float) -> float | None:
    """A parameter's tolerance on the first step's gradient (module docstring, "The first step's
    gradient"): None (the floor rule) without a policy; under one, ``BF16_GRADIENT_ROUNDINGS``
    units of bfloat16 round-off of the leaf's largest float32 element, plus its floor."""
    if config.precision is None:
        return None
    return BF16_GRADIENT_ROUNDINGS * BF16_U * float(np.max(np.abs(want), initial=0.0)) + SAFETY * floor


def compare(config: Config, ref: Reference, got: DeviceRun) -> Result:
    """Hold the step's run to the reference."""
    runs = ref.runs
    loss_floor, metric_floors, state_floors = _floors(config, runs)
    grad_floors = gradient_floors(config, ref)
    floors = {
        "loss": loss_floor,
        "state": max(state_floors.values(), default=0.0),
        "metrics": max(metric_floors.values(), default=0.0),
        "gradient": max(grad_floors.values(), default=0.0),
    }
    problems = list(got.problems)
    blind = []  # where the gradient's tolerance is as large as the gradient
    for name, g in ref.gradient.items():
        largest = float(np.max(np.abs(g), initial=0.0))
        tol = gradient_tolerance(config, g, grad_floors[name])
        if tol is None:
            tol = atol_for(config, grad_floors[name]) + STRICT_RTOL * largest
        if largest <= tol:
            blind.append(name)
    names = ("loss", "gradient", "state", "metrics")
    deviations = {name: Deviation() for name in names}
    if got.run is not None:
        run, want = got.run, runs[0]
        for t, (a, b) in enumerate(zip(run.losses, want.losses, strict=True)):
            deviations["loss"].add(config, a, b, loss_floor, f"loss[{t}]")
        if run.gradient.keys() != ref.gradient.keys():
            problems.append(f"gradient paths differ: {sorted(run.gradient.keys() ^ ref.gradient.keys())}")
        for name in sorted(run.gradient.keys() & ref.gradient.keys()):
            g, floor = ref.gradient[name], grad_floors[name]
            tol = gradient_tolerance(config, g, floor)
            deviations["gradient"].add(config, run.gradient[name], g, floor, name, computed=False, tol=tol)
        if run.state.keys() != want.state.keys():
            problems.append(f"state paths differ: {sorted(run.state.keys() ^ want.state.keys())}")
        for name in sorted(run.state.keys() & want.state.keys()):
            state = run.state[name], want.state[name]
            deviations["state"].add(config, *state, state_floors[name], name, computed=False)
        for t, (mine, theirs) in enumerate(zip(run.metrics, want.metrics, strict=True)):
            if mine.keys() != theirs.keys():
                problems.append(f"metric names {sorted(mine)}, expected {sorted(theirs)}")
                continue
            for name in theirs:
                floor = metric_floors[name]
                deviations["metrics"].add(config, mine[name], theirs[name], floor, f"{name}[{t}]")
        problems += [f"{name} {p}" for name, d in deviations.items() for p in d.problems]
    return Result(config, problems, deviations, floors, got.census, got.gradients, blind=tuple(blind))


def check(config: Config) -> Result:
    """Train ``config`` both ways (the step under test and the reference) and hold one against the other."""
    start, cpu = time.perf_counter(), time.process_time()
    batches = batches_of(config)
    try:
        ref = kept_reference(config)
    except Exception as e:  # noqa: BLE001  (the fuzzer's own bug: reported with the draw, not fatal)
        problem = f"the reference raised {_first_line(e)}"
        return Result(config, [problem], {}, {}, seconds=time.perf_counter() - start)
    result = compare(config, ref, device_run(config, batches))
    return dataclasses.replace(
        result, seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu
    )


# ----------------------------------------------------------------------------------------- the fuzzer


# Run first in every profile, before the drawn ones: the core cases and the neighbourhoods of
# the bugs found so far, so that the fixed sample of `make test` always covers them.
CURATED = (
    # explicit FSDP, 8 devices, Adam, microbatches, every metric reduction
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=8,
        microbatches=2,
        blocks=("linear", "layernorm"),
        width=16,
        optimizer="adam",
        batch_tree="nested",
        mask=True,
        scale=True,
        metrics=("mean", "sum", "max", "min", "gather", None, "default"),
        seed=1,
    ),
    # implicit ZeRO-1, attention and BatchNorm, masked classification, a placed batch
    Config(
        mode="implicit",
        layout="zero1",
        min_size=1,
        devices=4,
        stem="attention",
        blocks=("batchnorm",),
        task="classify",
        optimizer="adamw_masked",
        batch_tree="tuple",
        mask=True,
        scale=True,
        placement="placed",
        metrics=("gather", "max"),
        seed=2,
    ),
    # explicit, synchronized and per-shard BatchNorm on a conv stem, the bound spelling
    Config(
        mode="explicit",
        layout="replicated",
        devices=4,
        rows=3,
        stem="conv",
        blocks=("batchnorm_sync", "batchnorm"),
        optimizer="momentum",
        spelling="bind",
        seed=3,
    ),
    # a whole-gradient optimizer on split state
    Config(mode="explicit", layout="zero1", min_size=1, devices=8, optimizer="clip_sgd", width=16, seed=4),
    # explicit microbatches with per-shard BatchNorm (3 rows: measurable)
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=2,
        microbatches=2,
        rows=3,
        blocks=("batchnorm",),
        optimizer="sgd",
        seed=5,
    ),
    # factored optimizer state
    Config(mode="implicit", layout="fsdp", min_size=1, devices=2, optimizer="adafactor", width=16, seed=6),
    # masked optimizer state (optax.MaskedNode, #26.1): muon under explicit FSDP, bound
    Config(mode="explicit", layout="fsdp", min_size=1, devices=8, optimizer="muon", spelling="bind", seed=8),
    # FSDP units (#27): each block a unit, kept from the forward pass, BatchNorm inside, microbatches
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=4,
        microbatches=2,
        blocks=("linear", "batchnorm_sync", "dropout_zero"),
        width=16,
        optimizer="adam",
        units="blocks",
        reshard=False,
        seed=9,
    ),
    # a scanned stack under remat, its block the unit (#27.4): gathered one layer at a time in the loop
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=8,
        units="stack",
        scan="remat",
        optimizer="adam",
        seed=11,
    ),
    # the scanned stack a unit with prefetch (#27.4): the library's loop, a layer gathered ahead, bfloat16
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=4,
        microbatches=2,
        units="stack",
        scan="prefetch",
        precision="bf16/f32",
        optimizer="adam",
        seed=13,
    ),  # fmt: skip
    # hybrid sharding (#28): FSDP within each of 2 replicas, units, microbatches, synchronized BatchNorm
    Config(
        mode="explicit",
        layout="hsdp",
        min_size=1,
        devices=8,
        microbatches=2,
        blocks=("linear", "batchnorm_sync"),
        units="blocks",
        optimizer="adam",
        seed=12,
    ),  # fmt: skip
    # the plain call while the caller holds the state (a save in flight): a copy donated, one program
    Config(mode="implicit", layout="fsdp", min_size=1, devices=4, optimizer="adam", spelling="held", seed=14),
    # found by make fuzz: HSDP on (replica=2, data=1) compiled 2 programs (state placed over the size-1
    # axis, written without it); a held dropout key has no host form (the check raised)
    Config(mode="explicit", layout="hsdp", min_size=1, devices=2, spelling="held", seed=15),
    Config(mode="explicit", layout="zero1", stem="conv", blocks=("dropout_eval",), spelling="held", seed=16),
    # every Linear a unit (stem, blocks, head), gathered again for the backward pass
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=8,
        blocks=("linear", "linear"),
        units="linear",
        seed=10,
    ),
    # bfloat16 gathers, reductions and microbatch sums: explicit FSDP under MixedPrecision(bf16, bf16)
    Config(
        mode="explicit",
        layout="fsdp",
        min_size=1,
        devices=4,
        microbatches=2,
        optimizer="adam",
        precision="bf16/bf16",
        seed=7,
    ),
)


@pytest.mark.parametrize("config", CURATED, ids=str)
def test_curated_configs(config: Config) -> None:
    """The corners of the space (``CURATED``), each its own test, in ``make test``."""
    result = check(config)
    assert result.ok, result.report()


def test_every_curated_batchnorm_group_has_rows_enough_to_measure_its_floor() -> None:
    assert all(c == measurable(c) for c in CURATED)


def test_regression_a_two_row_batchnorm_group_is_not_drawn() -> None:
    """Found by the curated draw below at rows=2 (jax 0.12.0.1): explicit per-shard BatchNorm on
    two rows per device ended 18x its tolerance off the reference, 100x its floor, and within
    tolerance at 3 rows or with exact variance; two rows have one summation order, so the floor
    could not see the cancellation in flax's fast variance (``fuzz_space.measurable``)."""
    found = Config(
        mode="explicit", layout="fsdp", min_size=1, devices=2, microbatches=2, blocks=("batchnorm",), seed=5
    )
    assert found.batchnorm_rows == 2
    assert measurable(found).batchnorm_rows == MIN_BATCHNORM_ROWS
    assert measurable(dataclasses.replace(found, mode="implicit")).rows == 2  # 4 rows together already
    drawn = []
    # hypothesis's defaults here would be random draws, an on-disk database and the too_slow
    # health check on generation time (which a loaded machine can fail): fixed draws, no clock
    quiet = settings(
        max_examples=100,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    quiet(given(configs())(lambda c: drawn.append(c)))()
    assert all((c.batchnorm_rows or MIN_BATCHNORM_ROWS) >= MIN_BATCHNORM_ROWS for c in drawn)
    assert any(c.batchnorm for c in drawn)


def pinned(config: Config, pins: str | None = None) -> Config:
    """``config`` with the fields ``pins`` (default ``$SUBSTRAX_FUZZ_PIN``) names set:
    ``"field=literal,..."``, each value a Python literal."""
    pins = os.environ.get("SUBSTRAX_FUZZ_PIN", "") if pins is None else pins
    fields = {f.name for f in dataclasses.fields(Config)}
    values = {}
    for pin in filter(None, (p.strip() for p in pins.split(","))):
        name, _, literal = pin.partition("=")
        if name.strip() not in fields:
            raise ValueError(
                f"SUBSTRAX_FUZZ_PIN: {name.strip()!r} is not a Config field; one of {sorted(fields)}."
            )
        values[name.strip()] = ast.literal_eval(literal.strip())
    return dataclasses.replace(config, **values)


def test_a_pin_holds_named_fields_and_refuses_an_unknown_one() -> None:
    config = pinned(Config(), "scan='prefetch', units='stack', microbatches=2")
    assert (config.scan, config.units, config.microbatches, config.layout) == (
        "prefetch",
        "stack",
        2,
        "replicated",
    )
    with pytest.raises(ValueError, match="'units_' is not a Config field"):
        pinned(Config(), "units_='stack'")


@pytest.mark.slow  # make test-slow (in .ci/run); make fuzz draws more
def test_parity_fuzz() -> None:
    """Draws (profile ``fuzz-ci``, or ``fuzz-full`` with ``SUBSTRAX_FUZZ=full``, the
    ``CURATED`` configurations first); every draw is checked and printed, the failing ones
    listed at the end."""
    results: list[Result] = []

    def draw(config: Config) -> None:
        result = check(config)
        results.append(result)
        print(f"#{len(results):<3} {result.line()}", flush=True)

    run = given(configs().map(pinned))(draw)
    if PROFILE == "fuzz-full":
        for config in reversed(CURATED):
            run = example(config)(run)
    settings(settings.get_profile(PROFILE))(run)()

    failed = [r for r in results if not r.ok]
    floors: dict[tuple[str, str], float] = {}
    for r in results:
        family = ("adam" if r.config.adaptive else "sgd") + ("" if r.config.precision is None else "+bf16")
        for k, v in r.floors.items():
            floors[(family, k)] = max(floors.get((family, k), 0.0), v)
    print(
        f"\n{len(results)} draws ({sum(r.cpu_seconds for r in results):.0f} cpu-s), "
        f"{sum(r.config.precision is not None for r in results)} with a precision policy, "
        f"{len(failed)} failed, "
        f"{sum(r.census == 'xla-chose' for r in results)} implicit census mismatches shown, "
        f"{sum(len(r.blind) for r in results)} leaves in {sum(bool(r.blind) for r in results)} draws blind "
        "to a zeroed gradient (shown); largest floors: "
        + ", ".join(f"{f}/{k} {v:.1e}" for (f, k), v in sorted(floors.items())),
        flush=True,
    )
    assert not failed, f"{len(failed)} of {len(results)} draws failed:\n\n" + "\n\n".join(
        r.report() for r in failed
    )


def test_regression_implicit_xla_gathers_a_tiny_batch() -> None:
    """Found by the fuzzer: implicit ZeRO-1, 4 devices, 2 rows each, an embedding stem.

    XLA all-gathers the batch's mask (``pred[8]``) and computes the embedding's and the
    value kernel's gradients on every device instead of reduce-scattering them. The values
    are right; the census names exactly the buffers XLA chose not to reduce.
    """
    config = Config(
        mode="implicit", layout="zero1", min_size=1, devices=4, microbatches=1, rows=2,
        stem="attention", blocks=("batchnorm",), width=8, task="classify",
        optimizer="adamw_masked", batch_tree="tuple", mask=True, scale=True, placement="placed",
        metrics=("gather", "max"), spelling="call", compare_gradients=False, seed=2, steps=3,
    )  # fmt: skip
    result = check(config)
    result.assert_ok()  # losses, state and metrics to the floor; the layout kept
    assert result.census == "xla-chose"


SEED_72 = Config(
    mode="explicit", layout="hsdp", min_size=None, devices=2, microbatches=2, rows=3, stem="conv",
    blocks=("dropout_zero", "batchnorm", "batchnorm"), width=16, task="classify", optimizer="adam",
    batch_tree="nested", scale=True, placement="batch_spec", metrics=("mean", "gather", None, "max"),
    precision="bf16/bf16", scan="scan", seed=72, steps=3,
)  # fmt: skip


def test_regression_bf16_gradients_added_device_by_device() -> None:
    """Found by ``make fuzz`` (2026-12-06): explicit HSDP, bfloat16 gradients (``bf16/bf16``), 2
    devices x 2 microbatches, per-shard BatchNorm, Adam. ``blocks/2/scale`` ended 32x its
    tolerance off the reference. One element of its first gradient is 3.5e-5 exactly, the sum
    of four parts' bfloat16 gradients near 1e-3 (one unit in the last place: 7.6e-6): the step,
    which adds each device's microbatches first, got -1.5e-5, every split run of the floor,
    which added microbatch by microbatch, +7.6e-6, and Adam made the two signs a whole step
    apart. Rounding, not a wrong sum: split runs that add device by device
    (``by_device=True``) give the step's bits. The floor now has split runs in both orders."""
    config = SEED_72
    batches = batches_of(config)
    by_microbatch, by_device = (
        reference_runs(config, batches, [None], split=True, by_device=d)[0].state["blocks/2/scale"]
        for d in (False, True)
    )
    assert _maxdiff(by_microbatch, by_device) > 1e-2  # the order alone: about two Adam steps of 1e-2
    check(config).assert_ok()


@pytest.mark.parametrize("microbatches", [1, 2])
def test_regression_one_device_census_attributes_batchnorms_own_psum(microbatches: int) -> None:
    """Found by the fuzzer: explicit mode on 1 device, BatchNorm with ``axis_name``. The
    layer's own psum over the size-1 axis was reported as an unexpected all-reduce (or one
    inside the microbatch loop); it is the model's, and is attributed to it."""
    config = Config(
        mode="explicit", layout="fsdp", min_size=1, devices=1, microbatches=microbatches, rows=3,
        stem="attention", blocks=("batchnorm_sync", "dropout_zero", "dropout_eval"), width=8,
        optimizer="adafactor", batch_tree="nested", scale=True, placement="placed", seed=2005,
    )  # fmt: skip
    result = check(config)
    result.assert_ok()
    assert result.census == "ok"


# A leaf whose float32 gradient is below this fraction of the largest leaf's is zero but for
# round-off: a check may be blind to it zeroed or negated (its bfloat16 round-off is larger).
ROUND_OFF = 1e-5


@pytest.mark.parametrize(
    ("config", "blind"),
    [
        # BatchNorm normalizes away a shift of what it reads: the conv stem's bias (before the
        # first BatchNorm) and the first BatchNorm's bias (before the second) have a gradient
        # of zero but for round-off (5e-9, 9e-9), bfloat16's round-off of it 6e-4 and 1e-8
        (SEED_72, {"stem/bias", "blocks/1/bias"}),
        (CURATED[0], set()),  # float32, explicit FSDP, Adam, microbatches, Linear and LayerNorm
    ],
    ids=["bf16-batchnorm-adam-seed72", "f32-fsdp-adam"],
)
def test_the_check_fails_when_any_leafs_gradient_is_zeroed_or_negated(config: Config, blind: set) -> None:
    """The mutation test: the step under test with one parameter's gradient multiplied by 0 or
    -1 in every step (``fuzz_space.mutate``: the optimizer's first transformation) fails
    ``check``'s comparison on that leaf's first gradient, for every leaf the check does not
    report blind, and those are zero but for round-off; unmutated, the same program passes."""
    ref, batches = kept_reference(config), batches_of(config)
    result = compare(config, ref, device_run(config, batches, mutation=(next(iter(ref.gradient)), 1.0)))
    result.assert_ok()
    assert set(result.blind) == blind
    top = max(float(np.max(np.abs(g))) for g in ref.gradient.values())
    assert all(np.max(np.abs(ref.gradient[leaf])) < ROUND_OFF * top for leaf in blind)
    for leaf in sorted(set(ref.gradient) - blind):
        for factor in (0.0, -1.0):
            result = compare(config, ref, device_run(config, batches, mutation=(leaf, factor)))
            assert result.deviations["gradient"].where == leaf, (leaf, factor, result.report())
            assert any(p.startswith(f"gradient off the reference: worst {leaf},") for p in result.problems), (
                leaf, factor, result.report(),
            )  # fmt: skip
