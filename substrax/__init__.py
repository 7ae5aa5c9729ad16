"""substrax: data-parallel training in JAX and Flax NNX, with the collectives in view.

Two paths to the same step:

- ``substrax.spmd`` (implicit): the batch sharded over a mesh, one ``nnx.jit`` step,
  and XLA inserts the gradient all-reduce.
- ``substrax.explicit``: the same step under ``jax.shard_map``, the loss ``pmean``-ed
  before ``grad``, metrics reduced with collectives; ``compare_gradients`` checks both
  against a one-device reference.

``make_train_step(loss_fn, mode)`` picks one with a word. ``shard_state`` splits the
model's and optimizer's state over the data axis (ZeRO-1, FSDP); both modes train it.
``substrax.mesh`` builds the meshes both use; ``substrax.nn`` holds tensor-parallel
layers for a second (``model``) mesh axis, which both modes and ``shard_state`` follow. ``census(compiled)`` counts the collectives
of a compiled program; it comes from the package ``substrax/census/``, and importing it
here rebinds the attribute ``substrax.census`` from that package to the function.
"""

import importlib

from substrax import explicit, gradcheck, mesh, nn, spmd
from substrax._layout import LAYOUTS, Layout, LeafPlacement, layout_of, shard_state
from substrax._plan import Plan, PlanRow, plan
from substrax._shared.options import StepOptions
from substrax._shared.precision import MixedPrecision
from substrax._shared.skips import NonFiniteStepsError, SkippedStepWarning
from substrax._train.chooser import MODES, BoundTrainStep, TrainStep, make_train_step
from substrax.census import CensusReport, Comparison, Expected, census, compare, expected_communication

__version__ = "0.1.0"

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
    "BoundTrainStep",
    "CensusReport",
    "Comparison",
    "Expected",
    "Layout",
    "LeafPlacement",
    "MixedPrecision",
    "NonFiniteStepsError",
    "Plan",
    "PlanRow",
    "SkippedStepWarning",
    "StepOptions",
    "TrainStep",
    "__version__",
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
