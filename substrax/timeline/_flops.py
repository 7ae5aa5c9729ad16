"""The model's FLOPs per step, for an MFU: three times the forward pass's matrix products.

The loss function's ``dot_general`` and convolutions, traced on the global batch (a scan's body its
length times): the backward pass computes two products for each forward one, and recomputation
under remat is the program's cost, not the model's. For a transformer this is ``6 x parameters x
tokens`` (the matrix parameters') plus attention's ``12 x layers x seq x d x tokens``, counted from
the program the model is rather than from a formula.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from substrax._base.jaxprs import equations

__all__ = ["matmul_flops", "model_flops"]


def model_flops(
    loss_fn: Callable[..., Any], model: nnx.Module, batch: Any, mesh: jax.sharding.Mesh | None = None
) -> float | None:
    """The model's FLOPs per step: three times the forward pass's matrix products of
    ``loss_fn(model, batch)``, traced on the global ``batch`` (under ``jax.set_mesh(mesh)`` where
    given); ``None`` where the loss function cannot be traced alone."""
    graphdef, state = nnx.split(model)
    shapes = jax.tree.map(_abstract, (state, batch))

    def forward(state: Any, batch: Any) -> Any:
        return loss_fn(nnx.merge(graphdef, state), batch)

    try:
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            traced = jax.make_jaxpr(forward)(*shapes)
    except Exception:  # noqa: BLE001  (a loss that only runs inside a step: no MFU)
        return None
    return 3.0 * matmul_flops(traced.jaxpr)


def matmul_flops(jaxpr: Any) -> float:
    """The FLOPs of ``jaxpr``'s matrix products (``dot_general``, ``conv_general_dilated``), a scan's
    body counted its length times."""
    return float(sum(_product_flops(e) * runs for e, runs in equations(jaxpr)))


def _product_flops(eqn: Any) -> int:
    name = eqn.primitive.name
    if name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contracting)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, *spatial)
        per_output = rhs[spec[1]] * math.prod(rhs[d] for d in spec[2:])
        return 2 * math.prod(eqn.outvars[0].aval.shape) * per_output
    return 0


def _abstract(x: Any) -> Any:
    if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return x
