"""Layouts of a model's and optimizer's state over the data axis: replicated, ZeRO-1, FSDP.

``shard_state`` places the state; every step reads the placement back from the
variables' ``out_sharding`` metadata (flax's own, what ``nnx.get_partition_spec``
reads), which survives ``nnx.split``/``nnx.merge`` and so is visible inside a traced
step, where the arrays' shardings are not.

- **replicated**: every device holds every parameter and all optimizer state.
- **ZeRO-1** (``params=False``): parameters replicated; the optimizer state that
  mirrors a parameter (Adam's moments, momentum) split over the data axis. Each device
  updates its slice of every split parameter; the new parameters are gathered.
- **FSDP** (``params=True``, ZeRO-3): parameters and their optimizer state split.
  A split parameter is gathered whole right before use and its gradient comes back
  reduce-scattered.

The split rule: a parameter with at least ``min_size`` elements is split on its
largest dimension that the axis size divides (the first such on a tie); a smaller or
indivisible parameter, a scalar, and anything that is not an ``nnx.Param`` (BatchNorm
statistics, random keys, the step count) stays replicated.

Optimizer state belongs to the parameter whose path its path ends with (the longest
such). State of the parameter's shape (Adam's moments, momentum, ``MultiSteps``'
accumulated gradients) is split like the parameter's state. State of another shape
that keeps the parameter's split dimension (adafactor's factored row or column
statistics: the parameter's shape with one dimension dropped) is split on that
dimension; any other state (a ``(1,)`` placeholder, a statistic that dropped the split
dimension, a counter, a leaf of no parameter such as muon's coefficients) is
replicated. Nothing the optimizer holds for the model is refused.
"""

from substrax._layout._owners import (
    ParamSplit,
    check_optimizer_of,
    follow_dim,
    optimizer_followers,
    optimizer_mirrors,
    parameter_splits,
)
from substrax._layout._report import (
    LAYOUTS,
    REPLICA_AXIS,
    Layout,
    LayoutKind,
    LeafPlacement,
    LeftWhole,
    layout_of,
)
from substrax._layout._shard import epoch, shard_state
from substrax._layout._specs import (
    check_declared_rank,
    check_mesh_axes,
    choose_split_dim,
    declared_spec,
    gradient_spec,
    optional_axes,
    spec_tuple,
    split_dim_of,
    with_axis,
    without_axis,
)
from substrax._layout._units import (
    RESHARD_KEY,
    UNIT_KEY,
    UnitsSpec,
    mark_units,
    note_layers,
    recording_layers,
    unit_paths,
)

__all__ = [
    "RESHARD_KEY",
    "UNIT_KEY",
    "UnitsSpec",
    "mark_units",
    "note_layers",
    "recording_layers",
    "unit_paths",
    "LAYOUTS",
    "REPLICA_AXIS",
    "Layout",
    "LayoutKind",
    "LeafPlacement",
    "LeftWhole",
    "ParamSplit",
    "check_declared_rank",
    "check_mesh_axes",
    "check_optimizer_of",
    "choose_split_dim",
    "declared_spec",
    "epoch",
    "follow_dim",
    "gradient_spec",
    "layout_of",
    "optimizer_followers",
    "optional_axes",
    "optimizer_mirrors",
    "parameter_splits",
    "shard_state",
    "spec_tuple",
    "split_dim_of",
    "with_axis",
    "without_axis",
]
