"""The data-parallel step under ``jax.shard_map``, with every collective in plain sight.

``explicit_train_step`` is the twin of ``substrax.spmd.spmd_train_step``; the helpers
it is built from (``data_parallel_value_and_grad``, ``reduce_metrics_collective``) are
for writing your own shard_map steps; ``compare_gradients`` checks a gradient against
a one-device reference, the implicit path and the explicit one.
"""

from substrax._batch_specs import batch_partition_specs
from substrax.explicit._check import GradientReport, compare_gradients
from substrax.explicit._grad import data_parallel_value_and_grad, varying_axes
from substrax.explicit._metrics import reduce_metrics_collective
from substrax.explicit._step import explicit_train_step, explicit_value_and_grad

__all__ = [
    "GradientReport",
    "batch_partition_specs",
    "compare_gradients",
    "data_parallel_value_and_grad",
    "explicit_train_step",
    "explicit_value_and_grad",
    "reduce_metrics_collective",
    "varying_axes",
]
