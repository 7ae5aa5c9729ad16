"""The data-parallel step under ``jax.shard_map``, with every collective in plain sight.

``explicit_train_step`` and the helpers it is built from, for your own shard_map steps.
``compare_gradients`` and ``GradientReport`` are aliases of ``substrax.gradcheck``'s, which
``substrax/__init__.py`` sets here (``gradcheck`` imports this package, not the other way).
"""

from substrax._batch.leaves import batch_partition_specs
from substrax._shared.compiler import compiler_options
from substrax.explicit._grad import data_parallel_value_and_grad, varying_axes
from substrax.explicit._metrics import reduce_metrics_collective

# the library's other packages' (the mode chooser, compare_gradients), not in __all__
from substrax.explicit._step import STEPS, explicit_train_step, explicit_value_and_grad

__all__ = [
    "batch_partition_specs",
    "compiler_options",
    "data_parallel_value_and_grad",
    "explicit_train_step",
    "explicit_value_and_grad",
    "reduce_metrics_collective",
    "varying_axes",
]
