"""Data-parallel placement, the SPMD training step and collectives.

Under ``jax.jit`` with the batch sharded, the gradient of the batch's loss is already the
full one (XLA inserts the all-reduce); inside ``shard_map`` average the loss before
``grad``. See the modes guide.
"""

from substrax._batch.placement import (
    check_replicated_equal,
    create_data_parallel_sharding,
    place_batch_on_shards,
)
from substrax._layout import place_nnx_state_on_shards
from substrax._metrics.collectives import (
    all_gather,
    collect_from_devices,
    reduce_max_collective,
    reduce_mean_collective,
    reduce_min_collective,
    reduce_sum_collective,
)
from substrax.spmd._metrics import reduce_custom, reduce_max, reduce_mean, reduce_min, reduce_sum

# the library's other packages' (the mode chooser, compare_gradients), not in __all__
from substrax.spmd._step import STEPS, spmd_train_step

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
