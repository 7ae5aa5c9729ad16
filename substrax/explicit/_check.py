"""Check a data-parallel gradient against a one-device reference, leaf by leaf."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax._placement import place_batch_on_shards
from substrax._precision import MixedPrecision
from substrax._tree import PyTree, broadcast_prefix, map_arrays
from substrax.explicit._step import BatchSpec, explicit_value_and_grad

__all__ = ["GradientReport", "GradientRow", "compare_gradients"]

# (rtol, atol) per dtype. The paths sum the same terms in different orders, so they agree
# to round-off, not bit for bit. atol is relative to the largest magnitude in the whole
# gradient, not the leaf's own: a leaf whose exact gradient is zero (the key bias of an
# attention layer: softmax ignores that shift) holds round-off alone, which no tolerance
# scaled to that leaf could accept.
_TOLERANCES = {
    np.dtype(np.float64): (1e-9, 1e-11),
    np.dtype(np.float32): (1e-4, 1e-5),
    np.dtype(jnp.bfloat16): (3e-2, 1e-2),
    np.dtype(np.float16): (1e-2, 1e-3),
}
# How closely a gradient must follow ``c * reference`` for its error to be called the factor c.
_FIT_RTOL = 1e-3


@dataclasses.dataclass(frozen=True)
class GradientRow:
    """One parameter's gradient, each method's largest absolute difference from the reference."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    reference_norm: float
    max_abs_diff: dict[str, float]
    ok: dict[str, bool]


@dataclasses.dataclass(frozen=True)
class GradientReport:
    """What ``compare_gradients`` found.

    Attributes:
      ok: Whether every method's gradient matches the reference within tolerance.
      max_abs_diff: The largest absolute difference from the reference, over every
        method and parameter.
      rows: One ``GradientRow`` per parameter path.
      methods: The methods compared with the reference (``"implicit"``,
        ``"explicit"`` and, when given, ``"candidate"``).
      scale: Per method, the least-squares factor ``c`` fitting ``grad ≈ c * reference``.
      diagnosis: Per method that fails, what is wrong and its usual causes.
    """

    ok: bool
    max_abs_diff: float
    rows: list[GradientRow]
    methods: tuple[str, ...]
    scale: dict[str, float]
    diagnosis: dict[str, str]

    def __str__(self) -> str:
        head = f"{'parameter':<32} {'shape':<12} {'|ref|':>10} " + " ".join(f"{m:>12}" for m in self.methods)
        lines = [
            f"gradient check: {'OK' if self.ok else 'MISMATCH'} "
            f"(max |grad - reference| = {self.max_abs_diff:.3g})",
            head,
            "-" * len(head),
        ]
        for row in self.rows:
            cells = " ".join(f"{row.max_abs_diff[m]:>11.3g}{' ' if row.ok[m] else '!'}" for m in self.methods)
            lines.append(f"{row.path:<32} {str(row.shape):<12} {row.reference_norm:>10.3g} {cells}")
        for method, text in self.diagnosis.items():
            lines.append(f"{method}: {text}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Reference:
    """The one-device gradient, flattened: a name, a float64 copy and a tolerance per leaf."""

    names: list[str]
    values: list[np.ndarray]
    dtypes: list[np.dtype]
    rtol: list[float]
    atol: list[float]

    @property
    def sq_norm(self) -> float:
        return sum(float(np.vdot(r, r)) for r in self.values)


def _diagnose(scale: float, fits: bool, mesh: Mesh, data_axis: str, worst: list[str]) -> str:
    if fits:
        for axis, size in mesh.shape.items():
            if size > 1 and axis != data_axis and np.isclose(scale, size, rtol=1e-3):
                return (
                    f"gradient is {size}x the reference: a factor of {size}, the size of mesh "
                    f"axis {axis!r}, which is not the data axis {data_axis!r}. Usual cause: the "
                    f"batch split over {axis!r} while the loss is averaged over {data_axis!r} "
                    f"only, so the gradient sums the {size} {axis!r} shards' gradients. Split the "
                    f"batch over {data_axis!r} alone (in_specs PartitionSpec({data_axis!r})), or "
                    f"average the loss over every axis the batch is split over."
                )
            if size > 1 and np.isclose(scale, size, rtol=1e-3):
                return (
                    f"gradient is {size}x the reference: a factor of {size}, the size of mesh "
                    f"axis {axis!r}. Usual causes: averaging the gradient after grad "
                    f"(pmean(grad(loss))) under shard_map(check_vma=True), where the gradient "
                    f"of a replicated parameter already arrives summed over the axis; or "
                    f"psum-ing the loss instead of pmean-ing it. Average the loss before grad: "
                    f"grad(lambda p: pmean(loss(p, shard), {axis!r}))."
                )
            if size > 1 and np.isclose(scale, 1 / size, rtol=1e-3):
                return (
                    f"gradient is 1/{size} of the reference: a factor of 1/{size}, the size of "
                    f"mesh axis {axis!r}. Usual causes: a loss_fn that sums over the examples "
                    f"instead of averaging them (the data-parallel paths average the shards' "
                    f"losses with pmean, which divides a sum by the axis size); the gradient "
                    f"pmean-ed twice; or the loss divided by the axis size on top of a pmean."
                )
        return f"gradient is {scale:.4g}x the reference everywhere; check the loss's scaling."
    return (
        f"gradient differs from the reference beyond round-off and not by a constant factor; "
        f"worst leaves: {', '.join(worst)}. Usual causes: shard_map with check_vma=False (each "
        f"device's grad of a pmean-ed loss is only its own shard's gradient), a batch split over the "
        f"wrong axis, or per-device state (dropout keys, batch statistics) that differs."
    )


def _param_name(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")


def _rng_counts(state: nnx.State) -> dict[str, int]:
    """Every random stream's count in ``state``, by path."""
    return {
        ".".join(map(str, path)).removesuffix(".count"): int(np.asarray(var.get_value()))
        for path, var in nnx.to_flat_state(state)
        if isinstance(var, nnx.RngCount)
    }


def _refuse_random_draws(before: dict[str, int], after: dict[str, int]) -> None:
    """Raise a ValueError if the loss drew random numbers (dropout) from the model's streams.

    Each path would draw its own masks (the explicit one a different mask per device),
    so their gradients could not agree, and the comparison would report noise.
    """
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


def _layer_axis_names(model: nnx.Module) -> tuple[str, ...]:
    """The axis names the model's layers reduce over (``nnx.BatchNorm(axis_name=...)`` and the like)."""
    names: list[str] = []
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            axis_name = getattr(node, "axis_name", None)
            for name in axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,):
                if isinstance(name, str) and name not in names:
                    names.append(name)
    return tuple(names)


def _bound_axes(fn: Callable[..., Any], axes: Sequence[str]) -> Callable[..., Any]:
    """``fn`` with each of ``axes`` bound as a size-1 axis, so a collective over it is the identity.

    A layer that reduces over a named axis (``nnx.BatchNorm(axis_name="data")``) fails
    where no ``shard_map`` binds that axis: on one device, and under ``jax.jit``. Bound
    with size 1, its ``pmean`` returns its input, which there is already the whole batch's
    statistic. Every input is unmapped; the outputs gain, then lose, a leading size-1 axis.
    """

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
    """``(state, batch) -> (grads, state after the loss)``, with ``axes`` bound (``_bound_axes``);
    under ``precision`` as the implicit step runs it."""

    def grad_and_state(state: nnx.State, batch: PyTree) -> tuple[nnx.State, nnx.State]:
        model = nnx.merge(graphdef, state)
        if precision is None:
            grads = nnx.grad(loss_fn)(model, batch)
        else:
            run_loss = precision.loss_fn(loss_fn, False)
            _, grads = precision.value_and_grad(lambda m, b: (run_loss(m, b), None))(model, batch)
        return grads, nnx.state(model)

    return _bound_axes(grad_and_state, axes)


def _reference_gradient(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    loss_fn: Callable[[Any, PyTree], jax.Array],
    host_batch: PyTree,
    axes: Sequence[str],
) -> tuple[nnx.State, nnx.State]:
    """The gradient on the whole batch on one device, and the state after the loss ran.

    Refuses a loss that draws random numbers.
    """
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    grads, after = _grad_and_state(graphdef, loss_fn, axes)(
        jax.device_put(state, one_device), map_arrays(lambda x: jax.device_put(x, one_device), host_batch)
    )
    _refuse_random_draws(_rng_counts(state), _rng_counts(after))
    return grads, after


@dataclasses.dataclass(frozen=True)
class _ShardStatistics:
    """A layer that computes statistics from each device's shard alone, when the batch is split.

    ``kind`` is the layer's class name; ``batchnorm``: it is an ``nnx.BatchNorm`` (whose
    ``axis_name`` is ``axis_name``); otherwise a layer that updates the ``nnx.BatchStat``
    variables ``stats``.
    """

    path: str
    kind: str
    batchnorm: bool
    axis_name: Any
    stats: tuple[str, ...]


def _per_shard_statistics(
    model: nnx.Module, before: nnx.State, after: nnx.State, data_axis: str
) -> list[_ShardStatistics]:
    """The layers whose batch statistics, under shard_map, come from each device's shard alone.

    An ``nnx.BatchNorm`` in training mode (``use_running_average=False``, or its
    statistics updated by the loss) whose ``axis_name`` does not name ``data_axis``, and
    any other layer whose ``nnx.BatchStat`` variables the loss updated, unless its
    ``axis_name`` names ``data_axis``.
    """

    def batch_stats(state: nnx.State) -> dict[tuple[Any, ...], np.ndarray]:
        return {
            tuple(path): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(state)
            if isinstance(var, nnx.BatchStat)
        }

    old, new = batch_stats(before), batch_stats(after)
    updated = {p for p, v in old.items() if p in new and not np.array_equal(v, new[p], equal_nan=True)}
    found = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        where = tuple(path)
        own = [p for p in updated if p[:-1] == where]
        axis_name = getattr(node, "axis_name", None)
        names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
        if data_axis in names:
            continue
        batchnorm = isinstance(node, nnx.BatchNorm)
        if (batchnorm and getattr(node, "use_running_average", True) is False) or own:
            found.append(
                _ShardStatistics(
                    ".".join(map(str, where)) or "(the model)",
                    type(node).__name__,
                    batchnorm,
                    axis_name,
                    tuple(".".join(map(str, p)) for p in sorted(own, key=str)),
                )
            )
    return found


def _per_shard_statistics_text(layers: Sequence[_ShardStatistics], data_axis: str) -> str:
    """Why a gradient under shard_map differs from the reference, given those layers."""
    norms = [layer for layer in layers if layer.batchnorm]
    others = [layer for layer in layers if not layer.batchnorm]
    parts = []
    if norms:
        named = ", ".join(f"{layer.path} (axis_name={layer.axis_name!r})" for layer in norms)
        parts.append(
            f"nnx.BatchNorm in training mode at {named}: under shard_map each device normalizes "
            f"its shard with that shard's own batch statistics (mean and variance over its rows), "
            f"not the global batch's that the reference and the implicit path use, so the loss "
            f"itself differs, and with it the gradient (its reduction over the devices may be "
            f"right). Give the layer axis_name={data_axis!r} (nnx.BatchNorm(..., "
            f"axis_name={data_axis!r})): the statistics are then averaged over the data axis and "
            f"equal the global batch's. Or check with the running averages (model.eval())."
        )
    if others:
        named = ", ".join(f"{layer.path} ({layer.kind}: {', '.join(layer.stats)})" for layer in others)
        parts.append(
            f"nnx.BatchStat variables updated by the loss at {named}: if the layer computes them "
            f"from its input, under shard_map each device computes them from its own shard, and "
            f"they differ from the global batch's. Average them over {data_axis!r} inside the "
            f"layer (jax.lax.pmean(..., {data_axis!r})) to use the global batch's."
        )
    return " ".join(parts)


def _batch_shardings(host_batch: PyTree, mesh: Mesh, data_axis: str, batch_spec: BatchSpec | None) -> PyTree:
    """One NamedSharding per batch leaf, from ``batch_spec`` (default: every leaf on ``data_axis``)."""
    spec = PartitionSpec(data_axis) if batch_spec is None else batch_spec
    _, specs, treedef = broadcast_prefix(
        spec, host_batch, lambda s: isinstance(s, (PartitionSpec, NamedSharding)), what="batch_spec"
    )
    return jax.tree.unflatten(
        treedef, [s if isinstance(s, NamedSharding) else NamedSharding(mesh, s) for s in specs]
    )


def _data_parallel_gradients(
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
                lambda m, b: explicit_value_and_grad(
                    m, loss_fn, b, mesh=mesh, data_axis=data_axis, batch_spec=batch_spec, precision=precision
                )[1]
            )(model, placed),
        }
        if candidate is not None:
            grads["candidate"] = candidate(model, placed)
    return grads


def _flatten_reference(reference: nnx.State, compute_dtype: Any = None) -> _Reference:
    """Flatten the reference and give each leaf its tolerance, atol scaled to the whole gradient.

    ``compute_dtype``: the dtype the compared paths compute in (a mixed-precision
    policy's), whose tolerance then applies.
    """
    leaves = jax.tree_util.tree_flatten_with_path(reference)[0]
    values = [np.asarray(leaf, dtype=np.float64) for _, leaf in leaves]
    dtypes = [np.dtype(leaf.dtype) for _, leaf in leaves]
    largest = max((float(np.max(np.abs(v), initial=0.0)) for v in values), default=0.0)
    tolerances = [
        _TOLERANCES.get(
            np.dtype(compute_dtype) if compute_dtype is not None else d, _TOLERANCES[np.dtype(np.float32)]
        )
        for d in dtypes
    ]
    return _Reference(
        names=[_param_name(path) for path, _ in leaves],
        values=values,
        dtypes=dtypes,
        rtol=[rtol for rtol, _ in tolerances],
        atol=[atol * max(largest, 1e-30) for _, atol in tolerances],
    )


def _flatten_method(method: str, grads: Any, ref: _Reference) -> list[np.ndarray]:
    """``grads``'s leaves as float64, in the reference's order; refuses other parameters."""
    got = jax.tree_util.tree_flatten_with_path(grads)[0]
    got_names = [_param_name(path) for path, _ in got]
    if got_names != ref.names:
        missing = sorted(set(ref.names) - set(got_names))
        extra = sorted(set(got_names) - set(ref.names))
        raise ValueError(
            f"The {method} gradient does not have the model's parameters: it lacks "
            f"{missing or 'none'} and has {extra or 'no'} other leaves ({len(got_names)} "
            f"leaves for {len(ref.names)} parameters). A candidate must return the "
            f"gradient State of every nnx.Param, as nnx.grad(loss_fn)(model, batch) does."
        )
    return [np.asarray(leaf, dtype=np.float64) for _, leaf in got]


def _leaf_error(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> tuple[float, float]:
    """``(max |got - want|, the worst element's error in tolerances)``; inf for a wrong shape."""
    if got.shape != want.shape:
        return float("inf"), float("inf")
    diff = np.abs(got - want)
    return float(np.max(diff, initial=0.0)), float(np.max(diff / (atol + rtol * np.abs(want)), initial=0.0))


def _rows(
    ref: _Reference, by_method: dict[str, list[np.ndarray]]
) -> tuple[list[GradientRow], dict[str, list[str]]]:
    """A row per parameter, and per method its failing leaves, worst first."""
    rows: list[GradientRow] = []
    failing: dict[str, list[tuple[float, str]]] = {m: [] for m in by_method}
    for i, (name, want) in enumerate(zip(ref.names, ref.values, strict=True)):
        diffs, oks = {}, {}
        for method, leaves in by_method.items():
            diffs[method], ratio = _leaf_error(leaves[i], want, ref.rtol[i], ref.atol[i])
            oks[method] = ratio <= 1.0
            if not oks[method]:
                failing[method].append((ratio, name))
        rows.append(
            GradientRow(name, want.shape, str(ref.dtypes[i]), float(np.linalg.norm(want)), diffs, oks)
        )
    return rows, {m: [name for _, name in sorted(f, reverse=True)] for m, f in failing.items()}


def _fits_factor(leaves: Sequence[np.ndarray], ref: _Reference, c: float) -> bool:
    """Whether ``leaves`` is ``c * reference`` to round-off (the tolerances scaled by ``c``)."""
    return all(
        bool(np.all(np.abs(g - c * r) <= abs(c) * (atol + _FIT_RTOL * np.abs(r))))
        for g, r, atol in zip(leaves, ref.values, ref.atol, strict=True)
    )


def _scale_and_diagnosis(
    method: str,
    leaves: list[np.ndarray],
    ref: _Reference,
    rows: list[GradientRow],
    worst: list[str],
    mesh: Mesh,
    data_axis: str,
    shard_statistics: str,
) -> tuple[float, str | None]:
    """The least-squares factor ``c`` in ``grad ≈ c * reference``, and what is wrong, if anything.

    ``shard_statistics``: why a gradient under shard_map legitimately differs here (the
    model's per-shard batch statistics), or ``""``.
    """
    misshapen = [row.path for row, g in zip(rows, leaves, strict=True) if g.shape != row.shape]
    if misshapen:
        return float("nan"), f"gradient has the wrong shape at {', '.join(misshapen)}."
    c = sum(float(np.vdot(g, r)) for g, r in zip(leaves, ref.values, strict=True)) / max(ref.sq_norm, 1e-300)
    if all(row.ok[method] for row in rows):
        return c, None
    if shard_statistics and method == "explicit":
        return c, (
            f"gradient differs from the reference beyond round-off (worst leaves: "
            f"{', '.join(worst[:3])}) because of the model's batch statistics: {shard_statistics}"
        )
    fits = _fits_factor(leaves, ref, c)
    text = _diagnose(c, fits, mesh, data_axis, worst[:3])
    if shard_statistics and not fits:
        text += f" This model has such state; if the {method} runs under shard_map: {shard_statistics}"
    return c, text


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
) -> GradientReport:
    """Compare the data-parallel gradients of ``loss_fn`` with a one-device reference.

    The gradient of the loss on the global batch, with respect to the model's
    ``nnx.Param`` variables, is computed on one device (the reference), by the implicit
    path (``nnx.grad`` under ``jax.jit`` with the batch sharded), by the explicit path
    (under ``shard_map``, the loss ``pmean``-ed before ``grad``) and, when given, by
    ``candidate``. An element passes when ``|grad - ref| <= atol + rtol * |ref|``, with
    ``rtol`` set by the parameter's dtype (``1e-4`` for float32) and ``atol`` the
    dtype's factor (``1e-5`` for float32) times the largest magnitude in the whole
    reference gradient: a leaf whose exact gradient is zero holds only round-off, and
    passes. A gradient off by a constant factor is reported with that factor.

    The reference and the implicit path run with ``data_axis`` (and any axis a layer
    names, as ``nnx.BatchNorm(axis_name=...)`` does) bound with size 1, so such a layer
    reduces over the whole batch there, as it does over the shards under ``shard_map``.
    BatchNorm in training mode without ``axis_name=data_axis`` normalizes each device's
    shard with its own statistics in the explicit path, which then legitimately differs
    from the reference; the diagnosis names the layer and says so.

    Args:
      model: The NNX model; it is not changed.
      loss_fn: ``(model, batch) -> scalar loss``: a mean over the batch's examples, so
        the explicit path's per-shard loss averages to the global one. It must not draw
        random numbers (active dropout): turn them off for the check.
      batch: The global batch: host arrays, or global jax Arrays (one process).
      mesh: The mesh to run the implicit and explicit paths on.
      data_axis: The mesh axis the batch is split over.
      candidate: Your own data-parallel gradient, ``(model, batch) -> grads`` where
        ``grads`` is an ``nnx.State`` of the ``nnx.Param`` gradients (what
        ``nnx.grad(...)(model)`` returns). It is called with the model replicated over
        ``mesh``, the batch placed on it, inside ``jax.set_mesh(mesh)``.
      batch_spec: How the batch is split: one ``PartitionSpec`` or ``NamedSharding``, or
        a prefix tree of them; default every leaf on ``data_axis``.
      has_aux: Whether ``loss_fn`` returns ``(loss, metrics)``; the metrics are ignored.
      precision: A ``substrax.MixedPrecision`` policy: the implicit and explicit paths
        run under it (as the steps do) against the reference in the parameters' own
        dtype, to the tolerance of the policy's ``param_dtype`` (bfloat16: ``rtol``
        3e-2, ``atol`` 1e-2 of the largest reference magnitude: about four roundings
        to bfloat16's 8-bit mantissa).

    Returns:
      A ``GradientReport``; ``str(report)`` is a table with a row per parameter and,
      for a method that fails, its diagnosis (a factor equal to an axis size is named
      as such).

    Raises:
      ValueError: If ``loss_fn`` draws random numbers from the model's ``nnx.Rngs``
        (dropout on: each path would draw different masks; names the streams), if a
        candidate's gradient does not have exactly the model's parameters (names the
        missing and extra paths), or as the explicit step does for a batch that cannot
        be split or a loss that is not a scalar.
    """
    if has_aux:
        loss_with_aux = loss_fn
        loss_fn = lambda m, b: loss_with_aux(m, b)[0]  # noqa: E731
    graphdef, state = nnx.split(model)
    host_batch = map_arrays(np.asarray, batch)
    # A layer that reduces over a named axis needs it bound off shard_map too (size 1 there).
    axes = tuple(dict.fromkeys((data_axis, *_layer_axis_names(model))))
    reference, after = _reference_gradient(graphdef, state, loss_fn, host_batch, axes)
    ref = _flatten_reference(reference, None if precision is None else precision.param_dtype)
    per_shard = _per_shard_statistics(model, state, after, data_axis)
    shard_statistics = _per_shard_statistics_text(per_shard, data_axis)
    grads = _data_parallel_gradients(
        graphdef,
        state,
        loss_fn,
        host_batch,
        mesh,
        data_axis=data_axis,
        batch_spec=batch_spec,
        candidate=candidate,
        axes=axes,
        precision=precision,
    )
    by_method = {method: _flatten_method(method, g, ref) for method, g in grads.items()}
    rows, worst = _rows(ref, by_method)
    scale, diagnosis = {}, {}
    for method, leaves in by_method.items():
        scale[method], text = _scale_and_diagnosis(
            method, leaves, ref, rows, worst[method], mesh, data_axis, shard_statistics
        )
        if text is not None:
            diagnosis[method] = text
    max_diff = max((d for row in rows for d in row.max_abs_diff.values()), default=0.0)
    ok = all(all(row.ok.values()) for row in rows)
    return GradientReport(ok, max_diff, rows, tuple(grads), scale, diagnosis)
