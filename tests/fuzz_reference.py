"""The parity fuzzer's one-device reference (``tests/test_fuzz.py``'s docstring says what it
computes, and why): the groups of rows it computes together, its runs (plain, grouped for
BatchNorm, split for the floor, under a precision policy), and the metrics they imply."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from fuzz_space import (
    ROW_PARTS,
    Config,
    build,
    first_gradient_of,
    loss_of,
    metric_name,
    pack,
    per_example,
    unpack,
)

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
    BatchNorm (test_fuzz.py's docstring). A permutation reorders every batch's rows first (within
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
