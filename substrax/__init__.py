"""substrax: data-parallel training in JAX and Flax NNX, with the collectives in view.

``make_train_step(loss_fn, mode)`` picks the implicit (``substrax.spmd``) or explicit
(``substrax.explicit``) step; ``shard_state`` splits the state. See the guides.
``substrax.census`` is the census package, callable as its function: ``substrax.census(compiled)``.
"""

import importlib

from substrax import census, explicit, gradcheck, mesh, nn, spmd
from substrax._layout import LAYOUTS, Layout, LeafPlacement, layout_of, shard_state
from substrax._plan import Plan, PlanRow, plan
from substrax._shared.options import StepOptions
from substrax._shared.precision import MixedPrecision
from substrax._shared.schedule import SCHEDULES, PipelineSchedule, bubble_fraction
from substrax._shared.skips import NonFiniteStepsError, SkippedStepWarning
from substrax._train.chooser import MODES, BoundTrainStep, TrainStep, make_train_step
from substrax.census import CensusReport, Comparison, Expected, compare, expected_communication

__version__ = "0.1.0"

# substrax.explicit's aliases of the gradient check, set here: gradcheck imports explicit, so
# explicit cannot import it
explicit.compare_gradients = gradcheck.compare_gradients
explicit.GradientReport = gradcheck.GradientReport

_LAZY = ("checkpoint",)  # imported on first use: it imports orbax


def __getattr__(name: str) -> object:
    """``substrax.checkpoint``, imported when first used (``import substrax`` does not load orbax)."""
    if name in _LAZY:
        return importlib.import_module(f"substrax.{name}")
    raise AttributeError(f"module 'substrax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "LAYOUTS",
    "MODES",
    "SCHEDULES",
    "BoundTrainStep",
    "CensusReport",
    "Comparison",
    "Expected",
    "Layout",
    "LeafPlacement",
    "MixedPrecision",
    "NonFiniteStepsError",
    "PipelineSchedule",
    "Plan",
    "PlanRow",
    "SkippedStepWarning",
    "StepOptions",
    "TrainStep",
    "__version__",
    "bubble_fraction",
    "census",
    "checkpoint",
    "compare",
    "expected_communication",
    "explicit",
    "gradcheck",
    "layout_of",
    "make_train_step",
    "mesh",
    "nn",
    "plan",
    "shard_state",
    "spmd",
]
