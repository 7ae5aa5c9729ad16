"""The units ``plan`` tries by default: none, and the model's block where it has a stack of them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flax import nnx

__all__ = ["block_of"]


def block_of(model: nnx.Module) -> type | None:
    """The type of the model's block: of the submodules made of submodules (a block of layers, not
    a layer) that it holds two or more of, or one stacked by ``nnx.vmap`` (each parameter's first
    dimension the layers'), the one with the most parameters per instance; ``None`` for a model
    without such a stack."""
    counts: dict[type, int] = {}
    sizes: dict[type, int] = {}
    stacked: set[type] = set()
    for path, node in nnx.iter_graph(model):
        if not path or not isinstance(node, nnx.Module):
            continue
        params = nnx.to_flat_state(nnx.state(node, nnx.Param))
        shapes = [np.shape(v.get_value()) for _, v in params]
        if not any(len(tuple(p)) >= 2 for p, _ in params):
            continue  # a layer: its parameters are its own
        kind = type(node)
        counts[kind] = counts.get(kind, 0) + 1
        sizes[kind] = max(sizes.get(kind, 0), sum(math.prod(s) for s in shapes))
        if _stacked(params, shapes):
            stacked.add(kind)
    blocks = [k for k in counts if counts[k] >= 2 or k in stacked]
    return max(blocks, key=lambda k: sizes[k], default=None)


def _stacked(params: Any, shapes: list[tuple[int, ...]]) -> bool:
    """Whether a module's parameters read as layers stacked on their first dimension: two or more
    submodules' parameters, each of rank two or more (one layer's bias or norm has rank one),
    sharing that dimension."""
    owners = {tuple(p)[:-1] for p, _ in params}
    return len(owners) >= 2 and all(len(s) >= 2 for s in shapes) and len({s[0] for s in shapes}) == 1
