"""What ``compare_gradients`` finds: a ``GradientRow`` per parameter, each method against the reference."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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
      max_abs_diff: The largest absolute difference from the reference, over all.
      rows: One ``GradientRow`` per parameter path.
      methods: The methods compared (``"implicit"``, ``"explicit"``, ``"candidate"``).
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
            lines.append(f"{row.path:<32} {row.shape!s:<12} {row.reference_norm:>10.3g} {cells}")
        for method, text in self.diagnosis.items():
            lines.append(f"{method}: {text}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Reference:
    """The one-device gradient, flattened: a name, a float64 copy and a tolerance per leaf."""

    names: list[str]
    values: list[np.ndarray]
    dtypes: list[np.dtype]
    rtol: list[float]
    atol: list[float]

    @property
    def sq_norm(self) -> float:
        return sum(float(np.vdot(r, r)) for r in self.values)


def _param_name(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")


def flatten_reference(reference: nnx.State, compute_dtype: Any = None) -> Reference:
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
    return Reference(
        names=[_param_name(path) for path, _ in leaves],
        values=values,
        dtypes=dtypes,
        rtol=[rtol for rtol, _ in tolerances],
        atol=[atol * max(largest, 1e-30) for _, atol in tolerances],
    )


# A policy's round-off grows with the number of terms a gradient element sums (a bias under
# a conv sums rows x pixels), which no fixed tolerance covers: it is measured instead, as the
# one-device gradient under the policy against the reference, and each leaf may differ by
# this many times that.
POLICY_ERROR_FACTOR = 4.0


def widen_to_policy_error(ref: Reference, under_policy: Any) -> Reference:
    """``ref`` with each leaf's ``atol`` at least ``POLICY_ERROR_FACTOR`` times the leaf's
    largest difference between ``under_policy`` (the one-device gradient under the same
    mixed-precision policy) and the reference."""
    noisy = [np.asarray(leaf, dtype=np.float64) for leaf in jax.tree.leaves(under_policy)]
    atol = [
        max(a, POLICY_ERROR_FACTOR * float(np.max(np.abs(n - v), initial=0.0)))
        for a, n, v in zip(ref.atol, noisy, ref.values, strict=True)
    ]
    return dataclasses.replace(ref, atol=atol)


def flatten_method(method: str, grads: Any, ref: Reference) -> list[np.ndarray]:
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


def leaf_rows(
    ref: Reference, by_method: dict[str, list[np.ndarray]]
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
