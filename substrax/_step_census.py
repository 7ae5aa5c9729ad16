"""A training step's census held against the communication its layout calls for."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from flax import nnx

from substrax._census import Comparison, ExpectedCollective, census, compare, expected_communication
from substrax._layout import layout_of, optimizer_mirrors, spec_tuple, split_dim_of
from substrax._tree import PyTree, path_str

if TYPE_CHECKING:
    from substrax._train_step import TrainStep

__all__ = ["step_census"]


def parameter_leaves(
    model: nnx.Module, optimizer: nnx.Optimizer[Any], axis: str
) -> list[tuple[str, tuple[int, ...], Any, bool]]:
    """``(path, shape, dtype, split)`` per parameter, as ``expected_communication`` takes them.

    ``split``: the parameter, or the optimizer state mirroring it, is split over ``axis``.
    """
    mirrors = optimizer_mirrors(model, optimizer)
    opt = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(optimizer))}
    leaves = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        split = split_dim_of(spec_tuple(variable), axis) is not None or any(
            split_dim_of(spec_tuple(opt[m]), axis) is not None for m in mirrors.get(tuple(path), ())
        )
        leaves.append((path_str(tuple(path), "model"), tuple(value.shape), value.dtype, split))
    return leaves


def _metric_items(outputs: Any, has_aux: bool) -> tuple[int, list[ExpectedCollective]]:
    """The metrics' share: scalars all-reduced (their bytes), per-example values all-gathered."""
    if not has_aux:
        return 0, []
    _, metrics = outputs
    scalars, gathered = 0, []
    for name, value in metrics.items():
        nbytes = math.prod(value.shape) * np.dtype(value.dtype).itemsize
        if value.shape:
            gathered.append(ExpectedCollective("all-gather", f"metric {name!r}", nbytes))
        else:
            scalars += nbytes
    return scalars, gathered


def step_census(
    step: TrainStep, model: nnx.Module, optimizer: nnx.Optimizer[Any], batch: PyTree
) -> Comparison:
    """Compile ``step`` for these arguments, take its census, and compare it with its layout's rule.

    The expected communication is computed from the state's placement alone
    (``substrax.layout_of``): see ``substrax.expected_communication`` for the rule per
    layout and ``substrax.compare`` for how a census is held against it (bytes per kind).
    It covers the gradients, the loss and the metrics; a layer's own collectives
    (BatchNorm with ``axis_name``, the explicit step's average of such state) show as
    differences.
    """
    lowered = step.lower(model, optimizer, batch)
    compiled = lowered.compile()
    with step.mesh_context():
        layout = layout_of(model, optimizer, mesh=step.mesh, axis=step.data_axis)
    out = lowered.out_info[1]  # the step's (loss, metrics), as shapes and dtypes
    scalars, gathered = _metric_items(out, step.has_aux)
    one_device = layout.axis_size == 1  # a data axis of size 1 calls for no communication at all
    expected = expected_communication(
        [] if one_device else parameter_leaves(model, optimizer, step.data_axis),
        layout=layout.kind,
        mode=step.mode,
        microbatches=step.microbatches,
        extra_reduce_bytes=0 if one_device else scalars,
        loss_bytes=0 if one_device else np.dtype(out[0].dtype if step.has_aux else out.dtype).itemsize,
    )
    gathered = [] if one_device else gathered
    if gathered:
        expected = type(expected)(
            expected.layout, expected.mode, expected.microbatches, expected.items + tuple(gathered)
        )
    mesh = step.mesh if step.mesh is not None else None
    return compare(census(compiled, mesh=mesh), expected)
