"""Check a data-parallel gradient against a one-device reference, leaf by leaf."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from substrax._base.trees import PyTree, map_arrays
from substrax._batch.leaves import BatchSpec
from substrax._shared.precision import MixedPrecision
from substrax.gradcheck._diagnosis import scale_and_diagnosis
from substrax.gradcheck._gradients import data_parallel_gradients, pipelined_gradients, reference_gradient
from substrax.gradcheck._layers import layer_axis_names, per_shard_statistics, per_shard_statistics_text
from substrax.gradcheck._report import (
    GradientReport,
    GradientRow,
    flatten_method,
    flatten_reference,
    leaf_rows,
    widen_to_policy_error,
)

__all__ = ["GradientReport", "GradientRow", "compare_gradients"]


def _reference(
    graphdef: Any, state: nnx.State, loss_fn: Callable[..., Any], host_batch: PyTree, axes: tuple[str, ...],
    precision: MixedPrecision | None,
) -> tuple[Any, Any]:  # fmt: skip
    """The one-device reference gradient, flattened (widened by the policy's own round-off), and
    the state after its step."""
    reference, after = reference_gradient(graphdef, state, loss_fn, host_batch, axes)
    ref = flatten_reference(reference, None if precision is None else precision.param_dtype)
    if precision is not None:  # the policy's own round-off on one device, measured
        under_policy, _ = reference_gradient(graphdef, state, loss_fn, host_batch, axes, precision)
        ref = widen_to_policy_error(ref, under_policy)
    return ref, after


def _report(
    grads: dict[str, Any], ref: Any, mesh: Mesh, data_axis: str, shard_statistics: str
) -> GradientReport:
    """Each method's gradients held against ``ref``, leaf by leaf, with a diagnosis where one fails."""
    by_method = {method: flatten_method(method, g, ref) for method, g in grads.items()}
    rows, worst = leaf_rows(ref, by_method)
    scale, diagnosis = {}, {}
    for method, leaves in by_method.items():
        scale[method], text = scale_and_diagnosis(
            method, leaves, ref, rows, worst[method], mesh, data_axis, shard_statistics
        )
        if text is not None:
            diagnosis[method] = text
    max_diff = max((d for row in rows for d in row.max_abs_diff.values()), default=0.0)
    ok = all(all(row.ok.values()) for row in rows)
    return GradientReport(ok, max_diff, rows, tuple(grads), scale, diagnosis)


def compare_gradients(
    model: nnx.Module,
    loss_fn: Callable[[Any, PyTree], jax.Array],
    batch: PyTree,
    mesh: Mesh,
    *,
    data_axis: str = "data",
    candidate: Callable[[Any, PyTree], nnx.State] | None = None,
    batch_spec: BatchSpec | None = None,
    has_aux: bool = False,
    precision: MixedPrecision | None = None,
    microbatches: int = 1,
    schedule: str | None = None,
) -> GradientReport:
    """Compare the data-parallel gradients of ``loss_fn`` with a one-device reference.

    The implicit path, the explicit path and ``candidate`` (if given) are each held against
    the reference, element by element, to a tolerance set by the dtype. See the
    gradient-checks guide (tolerances, BatchNorm, mixed precision).

    Args:
      model: The NNX model; it is not changed.
      loss_fn: ``(model, batch) -> scalar loss``, a mean over the batch's examples; it
        must not draw random numbers (turn dropout off).
      batch: The global batch: host arrays, or global jax Arrays (one process).
      mesh: The mesh to run the implicit and explicit paths on.
      data_axis: The mesh axis the batch is split over.
      candidate: Your own gradient, ``(model, batch) -> grads`` (an ``nnx.State`` of the
        ``nnx.Param`` gradients), called with the model replicated over ``mesh``, the batch
        placed on it, inside ``jax.set_mesh(mesh)``.
      batch_spec: A ``PartitionSpec`` or ``NamedSharding``, or a prefix tree of them;
        default every leaf on ``data_axis``.
      has_aux: Whether ``loss_fn`` returns ``(loss, metrics)``; the metrics are ignored.
      precision: A ``substrax.MixedPrecision`` policy to run the two paths under, checked
        to the policy's wider tolerance.
      microbatches: With ``schedule``, the microbatches of the pipelined steps.
      schedule: One of ``substrax.SCHEDULES``: the implicit and explicit gradients are those of
        the pipelined steps (``make_train_step(..., schedule=)``; ``"zb-h1"``: the explicit
        one only, implicit mode refuses it), on ``model`` as
        ``shard_state(..., stages=)`` placed it on ``mesh`` (see the pipelines guide);
        ``candidate`` and ``precision`` do not apply then.

    Returns:
      A ``GradientReport``; ``str(report)`` is a table with a row per parameter and,
      for a method that fails, its diagnosis.

    Raises:
      ValueError: If ``loss_fn`` draws random numbers from the model's ``nnx.Rngs`` (names
        the streams), a candidate's gradient does not have exactly the model's parameters
        (names the paths), or as the explicit step does for a batch that cannot be split
        or a loss that is not a scalar.
    """
    if schedule is not None and (candidate is not None or precision is not None):
        raise ValueError(
            "compare_gradients(schedule=...) checks the gradients of the pipelined steps, in the parameters' "
            "dtype; drop candidate= and precision= (or schedule=)."
        )
    if has_aux:
        loss_with_aux = loss_fn
        loss_fn = lambda m, b: loss_with_aux(m, b)[0]
    graphdef, state = nnx.split(model)
    host_batch = map_arrays(np.asarray, batch)
    # A layer that reduces over a named axis needs it bound off shard_map too (size 1 there).
    axes = tuple(dict.fromkeys((data_axis, *layer_axis_names(model))))
    ref, after = _reference(graphdef, state, loss_fn, host_batch, axes, precision)
    per_shard = per_shard_statistics(model, state, after, data_axis)
    shard_statistics = per_shard_statistics_text(per_shard, data_axis)
    if schedule is not None:
        grads = pipelined_gradients(
            model, loss_fn, host_batch, mesh, data_axis=data_axis, batch_spec=batch_spec,
            microbatches=microbatches, schedule=schedule,
        )  # fmt: skip
    else:
        grads = data_parallel_gradients(
            graphdef, state, loss_fn, host_batch, mesh, data_axis=data_axis, batch_spec=batch_spec,
            candidate=candidate, axes=axes, precision=precision,
        )  # fmt: skip
    return _report(grads, ref, mesh, data_axis, shard_statistics)
