"""The options of a training step, written and checked once: one field, one keyword per signature."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from substrax._base.roles import AxisRoles, axis_roles
from substrax._layout import model_roles
from substrax._metrics.reductions import METRIC_REDUCTIONS
from substrax._shared.microbatch import check_microbatches
from substrax._shared.precision import MixedPrecision
from substrax._shared.schedule import check_schedule
from substrax._shared.skips import DEFAULT_MAX_SKIPS

__all__ = ["MODES", "Mode", "ModeSteps", "StepOptions", "options_from"]

Mode = Literal["implicit", "explicit"]
MODES: tuple[Mode, ...] = ("implicit", "explicit")


class ModeSteps(NamedTuple):
    """What the chooser and the gradient check call of one mode: its package's ``STEPS``.

    ``run_step(model, optimizer, loss_fn, batch, options)`` is the step, ``check_placement(model)``
    refuses a placement the mode cannot run, ``gradients(model, loss_fn, batch, options)`` the
    gradient the step would apply (reduced, before the update).
    """

    run_step: Callable[..., tuple[Any, Any]]
    check_placement: Callable[[Any], None]
    gradients: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a data-parallel step runs: one field per keyword of ``make_train_step``, documented there.

    Attributes:
      mode: ``"implicit"`` or ``"explicit"`` (read by the chooser only).
      mesh: The mesh, or ``None`` for the one set by ``jax.set_mesh``.
      data_axis: The mesh axis the batch is split over.
      batch_spec: How the batch is split, or ``None`` for the default.
      has_aux: Whether ``loss_fn`` returns ``(loss, metrics)``.
      reduce: Metric name to reduction, or ``None``.
      microbatches: Microbatches per step.
      skip_nonfinite: Whether a non-finite step skips its update.
      precision: A ``MixedPrecision`` policy, or ``None``.
      max_skips_in_a_row: Skipped steps in a row after which ``TrainStep`` raises, or ``None``.
      replica_axis: The replica axis of hybrid sharding (rows split over it too: ``row_axes``).
      schedule: One of ``SCHEDULES``: the staged stack runs as a pipeline; or ``None``.

    Raises:
      ValueError: If ``mode`` is unknown, ``data_axis`` and ``replica_axis`` name one axis or
        the stage axis, ``reduce`` is given without ``has_aux`` or
        names an unknown operation, ``microbatches`` is below 1, ``schedule`` is unknown
        or comes with fewer than two microbatches, or
        ``max_skips_in_a_row`` is not a positive int or ``None``.
      TypeError: If an axis name is not a str, ``microbatches`` is not an int,
        ``skip_nonfinite`` not a bool, or ``precision`` not a ``MixedPrecision``.
    """

    mode: Mode = "implicit"
    mesh: Any = None
    data_axis: str = "data"
    batch_spec: Any = None
    has_aux: bool = False
    reduce: Mapping[str, str | None] | None = None
    microbatches: int = 1
    skip_nonfinite: bool = True
    precision: MixedPrecision | None = None
    max_skips_in_a_row: int | None = DEFAULT_MAX_SKIPS
    replica_axis: str = "replica"
    schedule: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {self.mode!r}.")
        if self.reduce is not None:
            if not self.has_aux:
                raise ValueError(
                    "reduce= says how to reduce metrics, which loss_fn returns only with has_aux=True."
                )
            for name, op in self.reduce.items():
                if op is not None and op not in METRIC_REDUCTIONS:
                    raise ValueError(
                        f"Metric {name!r} asks for reduction {op!r}; use one of "
                        f"{', '.join(repr(a) for a in METRIC_REDUCTIONS)} or None (keep it unreduced)."
                    )
        axis_roles(None, self.data_axis, self.replica_axis)  # the names alone: two roles never share one
        check_microbatches(self.microbatches)
        check_schedule(self.schedule, self.microbatches, self.mode)
        if not isinstance(self.skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be True or False; got {self.skip_nonfinite!r}.")
        limit = self.max_skips_in_a_row
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_skips_in_a_row must be an int >= 1 or None; got {limit!r}.")
        if self.precision is not None and not isinstance(self.precision, MixedPrecision):
            raise TypeError(
                f"precision must be a substrax.MixedPrecision policy or None; got {self.precision!r}."
            )

    def roles(self, mesh: Any, model: Any = None) -> AxisRoles:
        """The step's ``AxisRoles`` on ``mesh``, checked (``substrax._layout.model_roles``). With
        ``model``, its layers' axes too: none may be another role's, and on a mesh without
        ``data_axis`` every axis needs a role."""
        return model_roles(model, mesh, self.data_axis, self.replica_axis)

    def row_axes(self, mesh: Any) -> str | tuple[str, ...]:
        """The mesh axes the batch's rows are split over: ``data_axis``, after
        ``replica_axis`` where ``mesh`` has it (hybrid sharding: ``("replica", "data")``);
        an axis ``mesh`` lacks left out (``()``: the rows are not split)."""
        return self.roles(mesh).rows

    def replace(self, **changes: Any) -> StepOptions:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


def options_from(keywords: Mapping[str, Any]) -> StepOptions:
    """``StepOptions`` from a step function's keywords (its ``locals()``; the others ignored)."""
    names = {f.name for f in dataclasses.fields(StepOptions)}
    return StepOptions(**{k: v for k, v in keywords.items() if k in names})
