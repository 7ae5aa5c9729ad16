"""Pytree helpers shared by placement, reductions and collectives."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

PyTree = Any
KeyPath = tuple[Any, ...]


def is_array(x: object) -> bool:
    """True for a jax.Array (tracers included), a NumPy array or a NumPy scalar."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def path_str(path: KeyPath, root: str = "batch") -> str:
    """A key path as a user reads it, such as ``batch['rows']['x']``.

    ``path`` holds jax key entries (``DictKey``, ``GetAttrKey``, ...) or, as NNX's flat
    states do, plain strings and ints.
    """
    if not path:
        return f"{root} (the root)"
    parts = [f"[{k!r}]" if isinstance(k, (str, int)) else jax.tree_util.keystr((k,)) for k in path]
    return root + "".join(parts)


def map_arrays(fn: Callable[[Any], Any], tree: PyTree, *, min_ndim: int = 0) -> PyTree:
    """Apply ``fn`` to every array leaf of ``tree`` with at least ``min_ndim`` dimensions.

    Any other leaf (a string, a Python number, ``None``, a 0-d array below ``min_ndim``)
    passes through unchanged, and the result has the structure of ``tree``.
    """

    def apply(leaf: Any) -> Any:
        if is_array(leaf) and np.ndim(leaf) >= min_ndim:
            return fn(leaf)
        return leaf

    return jax.tree.map(apply, tree)


def describe(x: Any) -> str:
    """A value as an error message names it: its kind and shape (or keys, or length), never its contents."""
    if is_array(x):
        return f"an array of shape {tuple(np.shape(x))} and dtype {x.dtype}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"


def _one_level(node: Any) -> tuple[list[tuple[KeyPath, Any]], Any]:
    children, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    return children, treedef


def broadcast_prefix(
    prefix: PyTree,
    tree: PyTree,
    is_prefix_leaf: Callable[[Any], bool],
    *,
    what: str,
) -> tuple[list[tuple[KeyPath, Any]], list[Any], Any]:
    """Pair every leaf of ``tree`` with the leaf of ``prefix`` whose subtree holds it.

    Args:
      prefix: A pytree prefix of ``tree`` (or one leaf standing for the whole tree).
      tree: The full tree.
      is_prefix_leaf: Which nodes of ``prefix`` are its leaves (shardings, specs).
      what: What the prefix is called in error messages, such as ``"sharding"``.

    Returns:
      ``(path_leaves, prefix_leaves, treedef)``: the ``(path, leaf)`` pairs of ``tree``
      in flatten order, the prefix leaf for each, and the treedef of ``tree``.

    Raises:
      ValueError: If ``prefix`` does not fit ``tree``; the message names the subtree.
    """
    path_leaves: list[tuple[KeyPath, Any]] = []
    prefix_leaves: list[Any] = []

    def walk(p: Any, t: Any, path: KeyPath) -> None:
        if is_prefix_leaf(p):
            for sub_path, leaf in jax.tree_util.tree_flatten_with_path(t)[0]:
                path_leaves.append((path + tuple(sub_path), leaf))
                prefix_leaves.append(p)
            return
        p_children, p_def = _one_level(p)
        if jax.tree_util.treedef_is_leaf(p_def) and p is not None:
            hint = (
                " Wrap a PartitionSpec as NamedSharding(mesh, spec)."
                if what == "sharding" and isinstance(p, PartitionSpec)
                else ""
            )
            raise ValueError(f"The {what} tree holds {p!r} at {path_str(path)}, which is not a {what}.{hint}")
        t_children, t_def = _one_level(t)
        if p_def != t_def:
            raise ValueError(
                f"The {what} tree does not fit the batch at {path_str(path)}: the {what} tree "
                f"has {describe(p)} where the batch has {describe(t)}. Give one {what} for "
                f"that whole subtree, or mirror its structure exactly."
            )
        for (key, pc), (_, tc) in zip(p_children, t_children, strict=True):
            walk(pc, tc, path + tuple(key))

    walk(prefix, tree, ())
    return path_leaves, prefix_leaves, jax.tree.structure(tree)


_ARRAY = (jax.Array, np.ndarray, np.generic)


def node_at(root: Any, path: KeyPath) -> Any:
    """The node of an NNX graph at ``path`` (as ``nnx.iter_graph`` gives it): items and attributes."""
    node = root
    for key in path:
        indexed = isinstance(node, (Mapping, list, nnx.List, nnx.Dict)) or (
            isinstance(node, tuple) and not hasattr(node, "_fields")
        )
        node = node[key] if indexed else getattr(node, key)
    return node


def adopt_assigned_arrays(optimizer: Any) -> None:
    """Wrap each plain array found in ``optimizer.opt_state`` in an ``nnx.OptArray``, in place.

    Raises:
      TypeError: If the array sits in an immutable container (a tuple), naming its path.
    """
    found = [
        path
        for path, node in nnx.iter_graph(optimizer)
        if path[:1] == ("opt_state",) and isinstance(node, _ARRAY)
    ]
    for path in found:
        parent = node_at(optimizer, path[:-1])
        value = nnx.OptArray(jnp.asarray(node_at(parent, path[-1:])))
        if isinstance(parent, (dict, list)):
            parent[path[-1]] = value
        elif isinstance(parent, nnx.Pytree):
            setattr(parent, path[-1], value)
        else:
            raise TypeError(
                f"{path_str(path, 'optimizer')} holds a plain array inside a {type(parent).__name__}, "
                f"which cannot take a variable in its place; set the value of the variable that was "
                f"there (.set_value(x)), or assign nnx.OptArray(x)."
            )


def picked(values: list[Any], keep: list[bool]) -> list[Any]:
    """The ``values`` whose ``keep`` is true, in order."""
    return [v for v, k in zip(values, keep, strict=True) if k]


def merged(values: list[Any], keep: list[bool], chosen: list[Any]) -> list[Any]:
    """``values`` with the kept positions taken from ``chosen``, in order (``picked``'s inverse)."""
    it = iter(chosen)
    return [next(it) if k else v for v, k in zip(values, keep, strict=True)]
