"""Check a data-parallel gradient against a one-device reference, leaf by leaf."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax._placement import place_batch_on_shards
from substrax._tree import PyTree, broadcast_prefix, map_arrays
from substrax.explicit._step import BatchSpec, explicit_value_and_grad

__all__ = ["GradientReport", "GradientRow", "compare_gradients"]

# (rtol, atol relative to the reference's largest magnitude) per dtype: the paths sum
# the same terms in different orders, so they agree to round-off, not bit for bit.
_TOLERANCES = {
    np.dtype(np.float64): (1e-9, 1e-11),
    np.dtype(np.float32): (1e-4, 1e-5),
    np.dtype(jnp.bfloat16): (3e-2, 1e-2),
    np.dtype(np.float16): (1e-2, 1e-3),
}


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
            cells = " ".join(
                f"{row.max_abs_diff[m]:>11.3g}{' ' if row.ok[m] else '!'}" for m in self.methods
            )
            lines.append(f"{row.path:<32} {str(row.shape):<12} {row.reference_norm:>10.3g} {cells}")
        for method, text in self.diagnosis.items():
            lines.append(f"{method}: {text}")
        return "\n".join(lines)


def _diagnose(scale: float, fits: bool, mesh: Mesh, worst: list[str]) -> str:
    if fits:
        for axis, size in mesh.shape.items():
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
) -> GradientReport:
    """Compare the data-parallel gradients of ``loss_fn`` with a one-device reference.

    The gradient of the loss on the global batch, with respect to the model's
    ``nnx.Param`` variables, is computed on one device (the reference), by the implicit
    path (``nnx.grad`` under ``jax.jit`` with the batch sharded), by the explicit path
    (under ``shard_map``, the loss ``pmean``-ed before ``grad``) and, when given, by
    ``candidate``. Tolerances follow each parameter's dtype.

    Args:
      model: The NNX model; it is not changed.
      loss_fn: ``(model, batch) -> scalar loss``: a mean over the batch's examples, so
        the explicit path's per-shard loss averages to the global one.
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

    Returns:
      A ``GradientReport``; ``str(report)`` is a table with a row per parameter and,
      for a method that fails, its diagnosis (a factor equal to an axis size is named
      as such).

    Raises:
      ValueError: If a candidate's gradient does not have exactly the model's
        parameters (names the missing and extra paths), or as the explicit step does
        for a batch that cannot be split or a loss that is not a scalar.
    """
    if has_aux:
        loss_with_aux = loss_fn
        loss_fn = lambda m, b: loss_with_aux(m, b)[0]  # noqa: E731
    graphdef, state = nnx.split(model)
    host_batch = map_arrays(np.asarray, batch)

    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ref_model = nnx.merge(graphdef, jax.device_put(state, one_device))
    reference = nnx.grad(loss_fn)(ref_model, map_arrays(lambda x: jax.device_put(x, one_device), host_batch))

    spec = PartitionSpec(data_axis) if batch_spec is None else batch_spec
    _, specs, treedef = broadcast_prefix(
        spec, host_batch, lambda s: isinstance(s, (PartitionSpec, NamedSharding)), what="batch_spec"
    )
    shardings = jax.tree.unflatten(
        treedef, [s if isinstance(s, NamedSharding) else NamedSharding(mesh, s) for s in specs]
    )
    with jax.set_mesh(mesh):
        dp_model = nnx.merge(graphdef, jax.device_put(state, NamedSharding(mesh, PartitionSpec())))
        placed = place_batch_on_shards(host_batch, shardings)
        grads = {
            "implicit": nnx.jit(lambda m, b: nnx.grad(loss_fn)(m, b))(dp_model, placed),
            "explicit": nnx.jit(
                lambda m, b: explicit_value_and_grad(
                    m, loss_fn, b, mesh=mesh, data_axis=data_axis, batch_spec=batch_spec
                )[1]
            )(dp_model, placed),
        }
        if candidate is not None:
            grads["candidate"] = candidate(dp_model, placed)

    ref_leaves = jax.tree_util.tree_flatten_with_path(reference)[0]
    ref_paths = [_param_name(path) for path, _ in ref_leaves]
    method_leaves = {}
    for method, g in grads.items():
        got = jax.tree_util.tree_flatten_with_path(g)[0]
        got_paths = [_param_name(path) for path, _ in got]
        if got_paths != ref_paths:
            missing = sorted(set(ref_paths) - set(got_paths))
            extra = sorted(set(got_paths) - set(ref_paths))
            raise ValueError(
                f"The {method} gradient does not have the model's parameters: it lacks "
                f"{missing or 'none'} and has {extra or 'no'} other leaves ({len(got_paths)} "
                f"leaves for {len(ref_paths)} parameters). A candidate must return the "
                f"gradient State of every nnx.Param, as nnx.grad(loss_fn)(model, batch) does."
            )
        method_leaves[method] = [np.asarray(leaf, dtype=np.float64) for _, leaf in got]

    rows: list[GradientRow] = []
    worst_by_method: dict[str, list[tuple[float, str]]] = {m: [] for m in grads}
    for i, (_, ref_leaf) in enumerate(ref_leaves):
        ref = np.asarray(ref_leaf, dtype=np.float64)
        rtol, atol_rel = _TOLERANCES.get(np.dtype(ref_leaf.dtype), _TOLERANCES[np.dtype(np.float32)])
        atol = atol_rel * max(float(np.max(np.abs(ref), initial=0.0)), 1e-30)
        name = ref_paths[i]
        diffs, oks = {}, {}
        for method, leaves in method_leaves.items():
            leaf = leaves[i]
            diff = float(np.max(np.abs(leaf - ref), initial=0.0)) if leaf.shape == ref.shape else float("inf")
            diffs[method] = diff
            oks[method] = leaf.shape == ref.shape and bool(np.all(np.abs(leaf - ref) <= atol + rtol * np.abs(ref)))
            if not oks[method]:
                worst_by_method[method].append((diff / (atol + rtol * float(np.max(np.abs(ref), initial=0))), name))
        rows.append(
            GradientRow(name, tuple(ref.shape), str(ref_leaf.dtype), float(np.linalg.norm(ref)), diffs, oks)
        )

    refs = [np.asarray(leaf, dtype=np.float64) for _, leaf in ref_leaves]
    ref_sq = sum(float(np.vdot(r, r)) for r in refs)
    scale, diagnosis = {}, {}
    for method, leaves in method_leaves.items():
        misshapen = [row.path for row, g in zip(rows, leaves, strict=True) if g.shape != row.shape]
        if misshapen:
            scale[method] = float("nan")
            diagnosis[method] = f"gradient has the wrong shape at {', '.join(misshapen)}."
            continue
        c = sum(float(np.vdot(g, r)) for g, r in zip(leaves, refs, strict=True)) / max(ref_sq, 1e-300)
        scale[method] = c
        if all(row.ok[method] for row in rows):
            continue
        fits = all(
            np.allclose(g, c * r, rtol=1e-3, atol=1e-6 * max(np.abs(c * r).max(initial=0), 1e-30))
            for g, r in zip(leaves, refs, strict=True)
        )
        worst = [name for _, name in sorted(worst_by_method[method], reverse=True)[:3]]
        diagnosis[method] = _diagnose(c, fits, mesh, worst)

    max_diff = max((d for row in rows for d in row.max_abs_diff.values()), default=0.0)
    ok = all(all(row.ok.values()) for row in rows)
    return GradientReport(ok, max_diff, rows, tuple(grads), scale, diagnosis)
