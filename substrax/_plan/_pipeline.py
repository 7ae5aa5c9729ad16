"""The plan's pipeline axis: which schedules a mesh tries, their keywords, a row's bubble."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from substrax._shared.schedule import EXPLICIT_ONLY, SCHEDULES, STAGE_AXIS, bubble_fraction

_INTERLEAVED = "interleaved-1f1b"


def schedules(
    mesh: Mesh,
    schedule: str | None | Sequence[str | None],
    mode: str,
    placement: Mapping[str, Any] | None = None,
) -> list[str | None]:
    """The schedules to try on ``mesh`` in ``mode``: on a ``stage`` axis the candidates (when none are
    named, each that ``mode`` runs on ``placement``: interleaved alone where it places several chunks a
    stage, else the others), without one none (``[None]``: no pipeline)."""
    if STAGE_AXIS not in mesh.axis_names:
        return [None]
    chunks = (placement or {}).get("virtual_stages", 1)
    candidates = [schedule] if schedule is None or isinstance(schedule, str) else list(schedule)
    named = [c for c in candidates if c is not None]
    runs = [
        s
        for s in SCHEDULES
        if (mode == "explicit" or s not in EXPLICIT_ONLY) and (s == _INTERLEAVED) == (chunks > 1)
    ]
    return named or runs


def runs(
    mesh: Mesh, schedule: str | None | Sequence[str | None], modes: Sequence[str], placement: Any
) -> list[tuple[str, str | None]]:
    """Each ``(mode, schedule)`` to try on ``mesh`` (``schedules``' for each mode)."""
    return [(mode, s) for mode in modes for s in schedules(mesh, schedule, mode, placement)]


def piped(
    mesh: Mesh, schedule: str | None, placement: Mapping[str, Any] | None, opts: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``shard_state``'s and ``make_train_step``'s keywords with the pipeline's: ``schedule`` on a
    ``stage`` mesh; the placement's ``stages`` only there."""
    place = dict(placement or {})
    if STAGE_AXIS not in mesh.axis_names:
        place.pop("stages", None)
    if schedule == _INTERLEAVED:  # two chunks a stage unless the placement says how many
        place.setdefault("virtual_stages", 2)
    elif place.get("virtual_stages", 1) > 1:
        place.pop("virtual_stages")  # a schedule of one chunk a stage
    return place, {**opts, **({"schedule": schedule} if schedule is not None else {})}


def fields(mesh: Mesh, opts: Mapping[str, Any], place: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A row's ``schedule`` and ``bubble`` (``place``: its ``shard_state`` keywords, the chunks a stage)."""
    schedule = opts.get("schedule")
    if schedule is None:
        return {}
    chunks = (place or {}).get("virtual_stages", 1)
    bubble = bubble_fraction(mesh.shape[STAGE_AXIS], opts.get("microbatches", 1), schedule, chunks)
    return {"schedule": schedule, "bubble": bubble}
