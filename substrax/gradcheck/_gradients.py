"""Each method's gradient for ``compare_gradients``: the reference, implicit, explicit, a candidate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax import explicit, spmd
from substrax._base.trees import PyTree, broadcast_prefix, map_arrays
from substrax._batch.leaves import BatchSpec
from substrax._batch.placement import place_batch_on_shards
from substrax._shared.options import StepOptions
from substrax._shared.precision import MixedPrecision
from substrax._shared.schedule import EXPLICIT_ONLY


def _rng_counts(state: nnx.State) -> dict[str, int]:
    """Every random stream's count in ``state``, by path."""
    return {
        ".".join(map(str, path)).removesuffix(".count"): int(np.asarray(var.get_value()))
        for path, var in nnx.to_flat_state(state)
        if isinstance(var, nnx.RngCount)
    }


def _refuse_random_draws(before: dict[str, int], after: dict[str, int]) -> None:
    """Raise a ValueError if the loss drew random numbers (dropout) from the model's streams."""
    drawn = [path for path, count in before.items() if after.get(path) != count]
    if drawn:
        raise ValueError(
            f"loss_fn draws random numbers from the model's nnx.Rngs (stream(s) "
            f"{', '.join(drawn)} advanced): dropout or another random layer is active, and "
            f"each path would draw its own masks (explicit mode one per device), so the "
            f"gradients cannot agree. Compare with the randomness off: call "
            f"model.set_attributes(deterministic=True) (or model.eval()) before "
            f"compare_gradients, and model.set_attributes(deterministic=False) after it."
        )


def _bound_axes(fn: Callable[..., Any], axes: Sequence[str]) -> Callable[..., Any]:
    """``fn`` with each of ``axes`` bound with size 1, so a collective over it is the identity."""

    def bound(*args: Any) -> Any:
        run = fn
        for axis in axes:
            run = jax.vmap(run, in_axes=None, out_axes=0, axis_size=1, axis_name=axis)
        return jax.tree.map(lambda x: x.reshape(x.shape[len(axes) :]), run(*args))

    return bound


def _grad_and_state(
    graphdef: nnx.GraphDef,
    loss_fn: Callable[[Any, PyTree], jax.Array],
    axes: Sequence[str],
    precision: MixedPrecision | None = None,
) -> Callable[[nnx.State, PyTree], tuple[nnx.State, nnx.State]]:
    """``(state, batch) -> (grads, state after)``, ``axes`` bound, under ``precision``."""

    def grad_and_state(state: nnx.State, batch: PyTree) -> tuple[nnx.State, nnx.State]:
        model = nnx.merge(graphdef, state)
        if precision is None:
            grads = nnx.grad(loss_fn)(model, batch)
        else:
            run_loss = precision.loss_fn(loss_fn, False)
            _, grads = precision.value_and_grad(lambda m, b: (run_loss(m, b), None))(model, batch)
        return grads, nnx.state(model)

    return _bound_axes(grad_and_state, axes)


def reference_gradient(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    loss_fn: Callable[[Any, PyTree], jax.Array],
    host_batch: PyTree,
    axes: Sequence[str],
    precision: MixedPrecision | None = None,
) -> tuple[nnx.State, nnx.State]:
    """The gradient on the whole batch on one device, and the state after the loss ran.

    Under ``precision``, with the policy's casts on that one device (the gradient still
    with respect to the parameters as stored). Refuses a loss that draws random numbers.
    Jitted on that one device, no mesh: one program (op by op, each operation would compile alone).
    """
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    grads, after = jax.jit(_grad_and_state(graphdef, loss_fn, axes, precision))(
        jax.device_put(state, one_device), map_arrays(lambda x: jax.device_put(x, one_device), host_batch)
    )
    _refuse_random_draws(_rng_counts(state), _rng_counts(after))
    return grads, after


def _batch_shardings(host_batch: PyTree, mesh: Mesh, data_axis: str, batch_spec: BatchSpec | None) -> PyTree:
    """One NamedSharding per batch leaf, from ``batch_spec`` (default: every leaf on ``data_axis``;
    whole on a mesh without it, a data axis of one device)."""
    rows = data_axis if data_axis in mesh.axis_names else None
    spec = PartitionSpec(rows) if batch_spec is None else batch_spec
    _, specs, treedef = broadcast_prefix(
        spec, host_batch, lambda s: isinstance(s, (PartitionSpec, NamedSharding)), what="batch_spec"
    )
    return jax.tree.unflatten(
        treedef, [s if isinstance(s, NamedSharding) else NamedSharding(mesh, s) for s in specs]
    )


def data_parallel_gradients(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    loss_fn: Callable[[Any, PyTree], jax.Array],
    host_batch: PyTree,
    mesh: Mesh,
    *,
    data_axis: str,
    batch_spec: BatchSpec | None,
    candidate: Callable[[Any, PyTree], nnx.State] | None,
    axes: Sequence[str],
    precision: MixedPrecision | None = None,
) -> dict[str, Any]:
    """The gradient by the implicit path, the explicit path and ``candidate``, by method.

    The implicit path runs with ``axes`` bound (``_bound_axes``); the explicit one
    under ``shard_map``, which binds every mesh axis.
    """
    shardings = _batch_shardings(host_batch, mesh, data_axis, batch_spec)
    with jax.set_mesh(mesh):
        model = nnx.merge(graphdef, jax.device_put(state, NamedSharding(mesh, PartitionSpec())))
        placed = place_batch_on_shards(host_batch, shardings)
        grads = {
            "implicit": jax.jit(_grad_and_state(graphdef, loss_fn, axes, precision))(
                nnx.state(model), placed
            )[0],
            "explicit": nnx.jit(
                lambda m, b: explicit.explicit_value_and_grad(
                    m, loss_fn, b, mesh=mesh, data_axis=data_axis, batch_spec=batch_spec, precision=precision
                )[1]
            )(model, placed),
        }
        if candidate is not None:
            grads["candidate"] = candidate(model, placed)
    return grads


def pipelined_gradients(
    model: Any,
    loss_fn: Callable[[Any, PyTree], jax.Array],
    host_batch: PyTree,
    mesh: Mesh,
    *,
    data_axis: str,
    batch_spec: BatchSpec | None,
    microbatches: int,
    schedule: str,
) -> dict[str, Any]:
    """The gradient of each mode's pipelined step (``schedule``, ``microbatches``), by mode.

    ``model`` is used as placed (``shard_state(..., stages=...)`` on ``mesh``): the steps'
    own gradient halves run on it, the pipeline's ticks and permutes included.
    """
    shardings = _batch_shardings(host_batch, mesh, data_axis, batch_spec)
    steps = {"implicit": spmd.STEPS, "explicit": explicit.STEPS}
    if schedule in EXPLICIT_ONLY:  # implicit mode refuses it
        del steps["implicit"]
    out = {}
    with jax.set_mesh(mesh):
        placed = place_batch_on_shards(host_batch, shardings)
        for mode, mode_steps in steps.items():
            options = StepOptions(
                mode=mode, mesh=mesh, data_axis=data_axis, batch_spec=batch_spec, microbatches=microbatches,
                schedule=schedule,
            )  # fmt: skip
            gradients = lambda m, b, s=mode_steps, o=options: s.gradients(m, loss_fn, b, o)  # noqa: E731
            out[mode] = nnx.jit(gradients)(model, placed)
    return out
