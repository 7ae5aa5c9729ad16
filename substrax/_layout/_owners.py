"""Which optimizer state belongs to which parameter (the layouts guide's rule), and where each is updated."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx

from substrax._base.trees import path_str
from substrax._layout._specs import spec_tuple, split_dim_of

__all__ = [
    "ParamSplit",
    "check_optimizer_of",
    "follow_dim",
    "optimizer_followers",
    "optimizer_mirrors",
    "parameter_splits",
]


def flat_state(tree: Any) -> Iterator[tuple[tuple[Any, ...], nnx.Variable[Any]]]:
    for path, variable in nnx.to_flat_state(nnx.state(tree)):
        yield tuple(path), variable


def _owner(path: tuple[Any, ...], params: dict[tuple[Any, ...], Any]) -> tuple[Any, ...] | None:
    """The parameter path that ``path`` ends with (the longest such), or None."""
    ends = [p for p in params if len(p) <= len(path) and path[len(path) - len(p) :] == p]
    return max(ends, key=len) if ends else None


def follow_dim(param_shape: tuple[int, ...], leaf_shape: tuple[int, ...], dim: int | None) -> int | None:
    """The dimension of an optimizer leaf that follows its parameter's dimension ``dim``.

    The leaf has the parameter's shape (``dim`` itself), the parameter's shape with one
    dimension dropped (adafactor's factored statistics: the same dimension, shifted
    past the dropped one) or one inserted (a history axis), or as many dimensions with
    the same size on ``dim`` (a statistic with kept dimensions). ``None`` when ``dim``
    is None, when the dropped dimension is ``dim`` itself, and when the shapes leave
    the correspondence ambiguous: such a leaf is replicated.
    """
    if dim is None:
        return None
    p, leaf = tuple(param_shape), tuple(leaf_shape)
    if leaf == p:
        return dim
    if len(leaf) == len(p):
        return dim if leaf[dim] == p[dim] else None
    if len(leaf) == len(p) - 1:  # dimension k of the parameter dropped
        found = {None if k == dim else dim - (k < dim) for k in range(len(p)) if p[:k] + p[k + 1 :] == leaf}
    elif len(leaf) == len(p) + 1:  # a dimension inserted at k
        found = {dim + (k <= dim) for k in range(len(leaf)) if leaf[:k] + leaf[k + 1 :] == p}
    else:
        return None
    return found.pop() if len(found) == 1 else None


def _key(entry: Any) -> Any:
    """A jax key-path entry as NNX's flat states spell it (a name or an index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def _pure_shapes(tree: Any) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """Each leaf's path, as ``("opt_state", ...)`` in NNX's spelling, and shape."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {("opt_state", *map(_key, path)): tuple(np.shape(leaf)) for path, leaf in flat}


def _expected_opt_state(
    model: nnx.Module, optimizer: nnx.Optimizer[Any]
) -> dict[tuple[Any, ...], tuple[int, ...]] | None:
    """The opt-state paths and shapes ``optimizer.tx`` gives ``model`` (``jax.eval_shape``), or None."""
    tx = getattr(optimizer, "tx", None)
    if tx is None or not hasattr(tx, "init"):
        return None
    wrt = getattr(optimizer, "wrt", nnx.Param)
    try:
        params = nnx.as_pure(nnx.state(model, wrt))
        return _pure_shapes(jax.eval_shape(tx.init, params))
    except Exception:  # noqa: BLE001  (an init jax cannot evaluate abstractly: no check, nothing refused)
        return None


def check_optimizer_of(model: nnx.Module, optimizer: nnx.Optimizer[Any]) -> None:
    """Raise a ValueError unless ``optimizer``'s state is what its ``tx`` gives ``model``.

    ``tx`` is initialized abstractly (nothing checked when that cannot run); the message
    names the first leaf that differs, with both shapes.
    """
    want = _expected_opt_state(model, optimizer)
    if want is None:
        return
    have = _pure_shapes(nnx.as_pure(optimizer.opt_state))
    hint = (
        "is the optimizer the model's? Pass the model the optimizer was built for, or build "
        "one for this model: nnx.Optimizer(model, tx, wrt=nnx.Param)."
    )
    name = type(model).__name__
    for path, shape in have.items():
        if path not in want:
            raise ValueError(
                f"{path_str(path, 'optimizer')} (shape {shape}) mirrors no parameter of the {name} "
                f"given (the optimizer's transformation gives this model no such leaf): {hint}"
            )
        if want[path] != shape:
            raise ValueError(
                f"{path_str(path, 'optimizer')} (shape {shape}) mirrors no parameter of the {name} "
                f"given (for this model it would have shape {want[path]}): {hint}"
            )
    missing = [path for path in want if path not in have]
    if missing:
        raise ValueError(
            f"The optimizer lacks {path_str(missing[0], 'optimizer')} (shape {want[missing[0]]}), "
            f"which its transformation gives the {name} given: {hint}"
        )


def _leaves_by_owner(
    model: nnx.Module, optimizer: nnx.Optimizer[Any], *, same_shape: bool
) -> dict[tuple[Any, ...], tuple[tuple[Any, ...], ...]]:
    """Each parameter's path, with the paths of its optimizer leaves (at least 1-d, under ``opt_state``)
    of its own shape (``same_shape``) or of another."""
    params = {p: v for p, v in flat_state(model) if isinstance(v, nnx.Param)}
    found: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {p: [] for p in params}
    for path, variable in flat_state(optimizer):
        if path[:1] != ("opt_state",) or np.ndim(variable.get_value()) == 0:
            continue
        owner = _owner(path, params)
        if owner is None:
            continue
        if (np.shape(variable.get_value()) == np.shape(params[owner].get_value())) == same_shape:
            found[owner].append(path)
    return {p: tuple(f) for p, f in found.items()}


def optimizer_mirrors(
    model: nnx.Module, optimizer: nnx.Optimizer[Any]
) -> dict[tuple[Any, ...], tuple[tuple[Any, ...], ...]]:
    """Each parameter's path, with the paths of the optimizer leaves of its shape that mirror it.

    Leaves of other shapes are ``optimizer_followers``'; see the layouts guide for the rule.

    Raises:
      ValueError: If ``optimizer`` was built for another model (``check_optimizer_of``);
        names the first leaf that differs.
    """
    check_optimizer_of(model, optimizer)
    return _leaves_by_owner(model, optimizer, same_shape=True)


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """Where one parameter and its update live over the data axis, read from the metadata.

    Attributes:
      gather_dim: The dimension the parameter itself is split on (FSDP), or ``None``.
      update_dim: The dimension its update is split on: the parameter's own, else that
        of the optimizer state mirroring it (ZeRO-1); ``None``: updated whole.
    """

    gather_dim: int | None
    update_dim: int | None


def parameter_splits(
    model: nnx.Module, optimizer: nnx.Optimizer[Any] | None, axis: str
) -> dict[tuple[Any, ...], ParamSplit]:
    """Each parameter's ``ParamSplit`` over ``axis``: the one reading of a layout that the
    explicit step, the census and ``layout_of`` share."""
    mirrors = optimizer_mirrors(model, optimizer) if optimizer is not None else {}
    opt = dict(flat_state(optimizer)) if optimizer is not None else {}
    splits = {}
    for path, variable in flat_state(model):
        if not isinstance(variable, nnx.Param):
            continue
        gather = split_dim_of(spec_tuple(variable), axis)
        dims = (split_dim_of(spec_tuple(opt[m]), axis) for m in mirrors.get(path, ()))
        update = gather if gather is not None else next((d for d in dims if d is not None), None)
        splits[path] = ParamSplit(gather, update)
    return splits


def optimizer_followers(
    model: nnx.Module, optimizer: nnx.Optimizer[Any]
) -> dict[tuple[Any, ...], tuple[tuple[Any, ...], ...]]:
    """Each model parameter's path, with its optimizer leaves of another shape (at least 1-d).

    These are the leaves whose path ends with the parameter's path but whose shape is
    not the parameter's: adafactor's ``v_row``/``v_col`` and ``(1,)`` placeholders, for
    example. ``shard_state`` splits one on ``follow_dim`` of it, when that is not None.
    """
    return _leaves_by_owner(model, optimizer, same_shape=False)
