"""The ``jax.named_scope`` names of the library's collectives: written by the steps, read by the census."""

from __future__ import annotations

__all__ = [
    "BATCH_STATS",
    "FINITE",
    "GATHER_PARAMS",
    "GRAD_REDUCE",
    "LOSS",
    "METRICS",
    "PIPELINE",
    "PREFIX",
    "TENSOR_PARALLEL",
    "UNIT",
    "UPDATE",
]

PREFIX = "substrax."  # every scope below starts so; the census finds them by it

LOSS = "substrax.loss"  # the loss's (and its gradient's) own collectives
METRICS = "substrax.metrics"  # the explicit step's metric reductions
GRAD_REDUCE = "substrax.grad_reduce"  # the gradient's reduction over the data axis
GATHER_PARAMS = "substrax.gather_params"  # split parameters gathered whole for the forward pass
BATCH_STATS = "substrax.batch_stats"  # the average of replicated nnx.BatchStat values
UPDATE = "substrax.update"  # the optimizer update on global arrays
FINITE = "substrax.finite"  # the non-finite guard inside the update
UNIT = "substrax.unit"  # a unit's gathers and reduce-scatters
TENSOR_PARALLEL = "substrax.tensor_parallel"  # substrax.nn's layers: the model's own collectives
PIPELINE = "substrax.pipeline"  # a pipeline's permutes between stages, its sum over stages
