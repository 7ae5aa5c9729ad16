"""Layouts of a model's and optimizer's state over the data axis: replicated, ZeRO-1, FSDP.

``shard_state`` places the state and records it in each variable's ``out_sharding``
metadata, which every step reads back (it survives ``nnx.split``/``nnx.merge``). Which
parameter and optimizer leaf is split where: see the layouts guide.
"""

from substrax._layout._owners import (
    ParamSplit,
    check_optimizer_of,
    flat_state,
    follow_dim,
    optimizer_followers,
    optimizer_mirrors,
    parameter_splits,
)
from substrax._layout._place import place_nnx_state_on_shards
from substrax._layout._report import (
    LAYOUTS,
    REPLICA_AXIS,
    REPLICA_KEY,
    Layout,
    LayoutKind,
    LeafPlacement,
    LeftWhole,
    check_replica_axis,
    layout_of,
    replica_axis_of,
)
from substrax._layout._shard import epoch, shard_state
from substrax._layout._specs import (
    check_declared_rank,
    check_mesh_axes,
    choose_split_dim,
    declared_spec,
    gradient_spec,
    model_axes,
    model_roles,
    optional_axes,
    spec_tuple,
    split_dim_of,
    trimmed,
    with_axis,
    without_axes,
    without_axis,
)
from substrax._layout._stages import STAGE_AXIS, STAGE_KEY, staged_stack
from substrax._layout._units import (
    PREFETCH_KEY,
    RESHARD_KEY,
    UNIT_KEY,
    UnitsSpec,
    find_units,
    mark_units,
    note_layers,
    prefetched_units,
    recording_layers,
    unit_paths,
)

__all__ = [
    "STAGE_AXIS",
    "STAGE_KEY",
    "staged_stack",
    "PREFETCH_KEY",
    "RESHARD_KEY",
    "UNIT_KEY",
    "UnitsSpec",
    "find_units",
    "flat_state",
    "mark_units",
    "note_layers",
    "prefetched_units",
    "recording_layers",
    "unit_paths",
    "LAYOUTS",
    "REPLICA_AXIS",
    "REPLICA_KEY",
    "Layout",
    "LayoutKind",
    "LeafPlacement",
    "LeftWhole",
    "ParamSplit",
    "check_declared_rank",
    "check_mesh_axes",
    "check_optimizer_of",
    "check_replica_axis",
    "choose_split_dim",
    "declared_spec",
    "epoch",
    "follow_dim",
    "gradient_spec",
    "layout_of",
    "model_axes",
    "model_roles",
    "replica_axis_of",
    "optimizer_followers",
    "optional_axes",
    "optimizer_mirrors",
    "parameter_splits",
    "place_nnx_state_on_shards",
    "shard_state",
    "spec_tuple",
    "split_dim_of",
    "trimmed",
    "with_axis",
    "without_axes",
    "without_axis",
]
