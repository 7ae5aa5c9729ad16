"""The data-parallel step under ``jax.shard_map``, with every collective in plain sight.

``explicit_train_step`` is the twin of ``substrax.spmd.spmd_train_step``; the helpers
it is built from (``data_parallel_value_and_grad``, ``reduce_metrics_collective``) are
for writing your own shard_map steps. ``compare_gradients`` and ``GradientReport`` live in
``substrax.gradcheck``; the names here are kept as aliases (read lazily: the checker imports
this package, never the reverse at import time).
"""

from typing import Any

from substrax._batch.leaves import batch_partition_specs
from substrax.explicit._grad import data_parallel_value_and_grad, varying_axes
from substrax.explicit._metrics import reduce_metrics_collective
from substrax.explicit._step import explicit_train_step, explicit_value_and_grad

__all__ = [
    "batch_partition_specs",
    "data_parallel_value_and_grad",
    "explicit_train_step",
    "explicit_value_and_grad",
    "reduce_metrics_collective",
    "varying_axes",
]


def __getattr__(name: str) -> Any:
    if name in ("GradientReport", "compare_gradients"):
        from substrax import gradcheck

        return getattr(gradcheck, name)
    raise AttributeError(f"module 'substrax.explicit' has no attribute {name!r}")
