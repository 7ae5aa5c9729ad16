"""Data-parallel placement, the SPMD training step and collectives.

A data-parallel gradient needs no reduction after differentiating. Under ``jax.jit``
with the batch sharded over a mesh axis, the gradient of the batch's loss is already
the full gradient: the compiler inserts the all-reduce (``spmd_train_step`` relies on
this). Inside ``jax.shard_map`` each device sees its shard, and the loss is averaged
over the axis before differentiating,
``jax.grad(lambda w: jax.lax.pmean(loss(w, shard), axis))``; the gradient of a
replicated parameter then comes back as the full one (``substrax.explicit`` writes the
step that way). Averaging the gradient afterwards is wrong by the axis size, because
the gradient of a replicated parameter already arrives summed over the axis.
``reduce_mean_collective`` and ``reduce_sum_collective`` average or sum per-device
metrics inside shard_map.
"""

from substrax._batch.placement import (
    check_replicated_equal,
    create_data_parallel_sharding,
    place_batch_on_shards,
)
from substrax._layout._place import place_nnx_state_on_shards
from substrax._metrics.collectives import (
    all_gather,
    collect_from_devices,
    reduce_max_collective,
    reduce_mean_collective,
    reduce_min_collective,
    reduce_sum_collective,
)
from substrax.spmd._metrics import reduce_custom, reduce_max, reduce_mean, reduce_min, reduce_sum
from substrax.spmd._step import spmd_train_step

__all__ = [
    "all_gather",
    "check_replicated_equal",
    "collect_from_devices",
    "create_data_parallel_sharding",
    "place_batch_on_shards",
    "place_nnx_state_on_shards",
    "reduce_custom",
    "reduce_max",
    "reduce_max_collective",
    "reduce_mean",
    "reduce_mean_collective",
    "reduce_min",
    "reduce_min_collective",
    "reduce_sum",
    "reduce_sum_collective",
    "spmd_train_step",
]
