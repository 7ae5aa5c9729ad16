"""The parity fuzzer's step under test: a draw trained with ``substrax.make_train_step`` on
its mesh, with what the run itself shows (its layout kept, float32 outputs, its census,
``compare_gradients``)."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from fuzz_reference import Run, state_of
from fuzz_space import (
    Config,
    batch_specs,
    build,
    first_gradient_of,
    make_loss_fn,
    mutate,
    pack,
    prefetch_of,
    reduce_map,
    units_of,
)
from jax.sharding import NamedSharding, PartitionSpec

import substrax
from substrax.explicit import compare_gradients
from substrax.mesh import create_device_mesh
from substrax.spmd import place_batch_on_shards

P = PartitionSpec

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


def first_line(e: BaseException) -> str:
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


def _mesh(config: Config) -> jax.sharding.Mesh:
    """The draw's mesh: ``data`` over its devices; under HSDP ``(replica, data)``, 2 replicas where it can."""
    hybrid = config.layout == "hsdp"  # the rows over (replica, data), the state split over data only
    replicas = 2 if hybrid and config.devices >= 2 else 1
    shape = {"replica": replicas, "data": config.devices // replicas} if hybrid else {"data": config.devices}
    return create_device_mesh(shape, devices=jax.devices()[: config.devices])


def _built(config: Config, mutation: tuple[str, float] | None) -> tuple[nnx.Module, nnx.Optimizer]:
    """The draw's model and optimizer, ``mutation`` applied (``fuzz_space.mutate``)."""
    # a synchronized BatchNorm sees the global batch
    sync = ("replica", "data") if config.layout == "hsdp" else "data"
    sync_axis = sync if config.mode == "explicit" else None
    model, optimizer = build(config, sync_axis=sync_axis, mutable=mutation is not None)
    if mutation is not None:
        mutate(optimizer, *mutation)
    return model, optimizer


def _shard(config: Config, mesh: jax.sharding.Mesh, model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """``substrax.shard_state`` in the draw's layout (none for ``replicated``)."""
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


def _feed(config: Config, mesh: jax.sharding.Mesh, batches: list[dict]) -> list[Any]:
    """Every step's batch as the draw passes it: placed on the mesh first (``placed``) or not."""
    if config.placement == "placed":
        specs = batch_specs(config)
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
        return [place_batch_on_shards(pack(config, b), shardings) for b in batches]
    return [pack(config, b) for b in batches]


def _steps(
    config: Config, step: substrax.TrainStep, model: nnx.Module, optimizer: nnx.Optimizer, feed: list[Any]
) -> tuple[list[Any], list[tuple[jax.Array, np.ndarray]]]:
    """The step's outputs over ``feed`` in the draw's spelling, and (``held``) the state's arrays
    the caller held across each call, with their values then."""
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
    return outs, held


def _held_problems(
    config: Config, step: substrax.TrainStep, held: list[tuple[jax.Array, np.ndarray]]
) -> list[str]:
    """What the plain call did wrong with arrays the caller held: one changed, or two programs."""
    problems = []
    if any(a.is_deleted() or not np.array_equal(_host(a), v) for a, v in held):
        problems.append("an array the caller held was deleted or changed by the step")
    programs = sum(f._cache_size() for f in step._pure_steps.values())
    if config.spelling == "held" and programs != 1:
        problems.append(f"the plain call compiled {programs} programs with arrays held (one, donated)")
    return problems


def _float32_problems(
    config: Config, outs: list[Any], metrics: list[dict], model: nnx.Module, optimizer: nnx.Optimizer
) -> list[str]:
    """Under a policy too the loss and the floating metrics come back in float32, and the
    parameters and the optimizer state stay float32 (every model here is built float32)."""
    problems = []
    returned = [o[0] if config.has_aux else o for o in outs] + [v for m in metrics for v in m.values()]
    narrow = {str(np.asarray(v).dtype) for v in returned if np.asarray(v).dtype.kind == "f"} - {"float32"}
    if narrow:
        problems.append(f"the loss or a metric came back in {sorted(narrow)}, not float32")
    changed = [
        f"{'/'.join(map(str, p))} {v.get_value().dtype}"
        for p, v in nnx.to_flat_state(nnx.state((model, optimizer)))
        if hasattr(v.get_value(), "dtype")  # not an optax.MaskedNode
        and jnp.issubdtype(v.get_value().dtype, jnp.floating)
        and v.get_value().dtype != jnp.float32
    ]
    if changed:
        problems.append(f"{len(changed)} state array(s) not float32 after training, e.g. {changed[0]}")
    return problems


def _census(
    config: Config,
    step: substrax.TrainStep,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batch: Any,
    out: DeviceRun,
) -> None:
    """The step's census against its layout's rule, into ``out``."""
    try:
        found = step.check_communication(model, optimizer, batch)
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
        out.problems.append(f"census raised {first_line(e)}")


def _gradients(
    config: Config,
    step: substrax.TrainStep,
    model: nnx.Module,
    batch: dict,
    mesh: jax.sharding.Mesh,
    out: DeviceRun,
) -> None:
    """``compare_gradients`` on the trained model and the first batch, into ``out``."""
    try:
        report = compare_gradients(
            model,
            step.loss_fn,
            pack(config, batch),
            mesh,
            batch_spec=batch_specs(config),
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
        out.problems.append(f"compare_gradients raised {first_line(e)}")


def device_run(config: Config, batches: list[dict], mutation: tuple[str, float] | None = None) -> DeviceRun:
    """Train with ``make_train_step`` on ``config.devices`` devices; check layout, census, gradients.
    ``mutation``: ``(leaf, factor)``, that parameter's gradient multiplied by factor in every
    step (``fuzz_space.mutate``; the mutation test's)."""
    out = DeviceRun()
    mesh = _mesh(config)
    model, optimizer = _built(config, mutation)
    try:
        _shard(config, mesh, model, optimizer)
    except Exception as e:  # noqa: BLE001
        out.problems.append(f"shard_state raised {first_line(e)}")
        return out
    layout_before = substrax.layout_of(model, optimizer, mesh=mesh)
    placed_before = _shardings(model, optimizer)
    # a mutation's step kept for the next: one program for every mutation (fuzz_space.mutate)
    step = (_train_step if mutation is None else _kept_train_step)(config, mesh)
    feed = _feed(config, mesh, batches)
    try:
        outs, held = _steps(config, step, model, optimizer, feed)
    except Exception as e:  # noqa: BLE001
        out.problems.append(f"step raised {first_line(e)}")
        return out
    out.problems += _held_problems(config, step, held)
    losses = [float(o[0] if config.has_aux else o) for o in outs]
    metrics = (
        [{k: np.asarray(v) for k, v in o[1].items()} for o in outs] if config.has_aux else [{}] * len(outs)
    )
    out.run = Run(losses, metrics, state_of(model), first_gradient_of(optimizer))
    out.problems += _float32_problems(config, outs, metrics, model, optimizer)
    layout_after = substrax.layout_of(model, optimizer, mesh=mesh)
    if layout_after != layout_before:
        out.problems.append(f"layout_of changed: {layout_before.kind} -> {layout_after.kind}")
    moved = _layout_changes(placed_before, _shardings(model, optimizer))
    if moved:
        out.problems.append(f"{len(moved)} array(s) moved, e.g. {moved[0]}")
    # The census on plain-call draws: the bound step compiles the same program with donated
    # buffers, and its census would compile it once more.
    if config.spelling == "call" and mutation is None:  # a mutation changes no collective
        _census(config, step, model, optimizer, feed[0], out)
    if config.compare_gradients and not config.batchnorm:
        _gradients(config, step, model, batches[0], mesh, out)
    return out
