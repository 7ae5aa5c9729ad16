"""What is wrong with a failing gradient: a constant factor ``c`` (an axis size, named), or worse."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

from substrax.gradcheck._report import GradientRow, Reference

# How closely a gradient must follow ``c * reference`` for its error to be called the factor c.
_FIT_RTOL = 1e-3


def _fits_factor(leaves: Sequence[np.ndarray], ref: Reference, c: float) -> bool:
    """Whether ``leaves`` is ``c * reference`` to round-off (the tolerances scaled by ``c``)."""
    return all(
        bool(np.all(np.abs(g - c * r) <= abs(c) * (atol + _FIT_RTOL * np.abs(r))))
        for g, r, atol in zip(leaves, ref.values, ref.atol, strict=True)
    )


def scale_and_diagnosis(
    method: str,
    leaves: list[np.ndarray],
    ref: Reference,
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
