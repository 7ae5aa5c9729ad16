"""Layouts of a model's and optimizer's state over the data axis: replicated, ZeRO-1, FSDP.

``shard_state`` places the state; every step reads the placement back from the
variables' ``out_sharding`` metadata (flax's own, what ``nnx.get_partition_spec``
reads), which survives ``nnx.split``/``nnx.merge`` and so is visible inside a traced
step, where the arrays' shardings are not.

- **replicated**: every device holds every parameter and all optimizer state.
- **ZeRO-1** (``params=False``): parameters replicated; the optimizer state that
  mirrors a parameter (Adam's moments, momentum) split over the data axis. Each device
  updates its slice of every split parameter; the new parameters are gathered.
- **FSDP** (``params=True``, ZeRO-3): parameters and their optimizer state split.
  A split parameter is gathered whole right before use and its gradient comes back
  reduce-scattered.

The split rule: a parameter with at least ``min_size`` elements is split on its
largest dimension that the axis size divides (the first such on a tie); a smaller or
indivisible parameter, a scalar, and anything that is not an ``nnx.Param`` (BatchNorm
statistics, random keys, the step count) stays replicated.

Optimizer state belongs to the parameter whose path its path ends with (the longest
such). State of the parameter's shape (Adam's moments, momentum, ``MultiSteps``'
accumulated gradients) is split like the parameter's state. State of another shape
that keeps the parameter's split dimension (adafactor's factored row or column
statistics: the parameter's shape with one dimension dropped) is split on that
dimension; any other state (a ``(1,)`` placeholder, a statistic that dropped the split
dimension, a counter, a leaf of no parameter such as muon's coefficients) is
replicated. Nothing the optimizer holds for the model is refused.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax._tree import path_str
from substrax.mesh import current_mesh

__all__ = ["Layout", "LeafPlacement", "layout_of", "shard_state"]

LayoutKind = Literal["replicated", "zero1", "fsdp"]
LAYOUTS: tuple[LayoutKind, ...] = ("replicated", "zero1", "fsdp")
# shard_state calls per object: a step that split a model before one must split it again.
_EPOCHS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def epoch(obj: Any) -> int:
    """How many times ``shard_state`` has placed ``obj`` (a model or an optimizer)."""
    return _EPOCHS.get(obj, 0)


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """Where one array of the state lives.

    Attributes:
      owner: ``"model"`` or ``"optimizer"``.
      path: The leaf's path, as ``model['hidden']['kernel']``.
      shape: Its global shape.
      dtype: Its dtype's name.
      split_dim: The dimension split over the data axis, or ``None`` when replicated.
      axis_size: The data axis's size.
      other_splits: ``(dim, axis, size)`` for each split over another mesh axis (a
        tensor-parallel ``model`` axis), declared by the layer.
    """

    owner: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    split_dim: int | None
    axis_size: int
    other_splits: tuple[tuple[int, str, int], ...] = ()

    @property
    def nbytes(self) -> int:
        """The whole array's bytes."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def bytes_per_device(self) -> int:
        """What one device holds of it."""
        ways = math.prod(n for _, _, n in self.other_splits)
        return self.nbytes // ways if self.split_dim is None else self.nbytes // ways // self.axis_size

    def where(self) -> str:
        """``replicated``, or each split as ``dim 0 over 'data'``."""
        splits = sorted(
            [(self.split_dim, "data")] * (self.split_dim is not None) + [(d, a) for d, a, _ in self.other_splits]
        )
        return "; ".join(f"dim {d} over {a!r}" for d, a in splits) or "replicated"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which leaf of a model's and optimizer's state went where; ``str()`` prints a table.

    Attributes:
      kind: ``"replicated"``, ``"zero1"`` or ``"fsdp"``.
      axis: The data axis.
      axis_size: Its size.
      rows: One ``LeafPlacement`` per array of the state.
    """

    kind: LayoutKind
    axis: str
    axis_size: int
    rows: tuple[LeafPlacement, ...]

    @property
    def bytes_per_device(self) -> int:
        """The state's bytes on one device."""
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def total_bytes(self) -> int:
        """The state's bytes, counted once (what one device holds when replicated)."""
        return sum(r.nbytes for r in self.rows)

    def split(self) -> tuple[LeafPlacement, ...]:
        """The rows split over the axis."""
        return tuple(r for r in self.rows if r.split_dim is not None)

    def __str__(self) -> str:
        width = max([len(r.path) for r in self.rows] + [4])
        lines = [
            f"layout {self.kind} over {self.axis!r} ({self.axis_size} devices): "
            f"{self.bytes_per_device:,} state bytes per device of {self.total_bytes:,}",
            f"{'leaf':<{width}}  {'shape':<14} {'dtype':<8} where",
        ]
        for r in self.rows:
            where = r.where() if r.other_splits else "replicated" if r.split_dim is None else f"split on dim {r.split_dim}"
            lines.append(f"{r.path:<{width}}  {str(r.shape):<14} {r.dtype:<8} {where}")
        return "\n".join(lines)


def spec_tuple(variable: nnx.Variable[Any]) -> tuple[Any, ...] | None:
    """A variable's ``out_sharding`` metadata, or None when it has none."""
    meta = variable.get_metadata()
    spec = meta.get("out_sharding", meta.get("sharding_names"))
    return None if spec is None else tuple(spec)


def split_dim_of(spec: tuple[Any, ...] | None, axis: str) -> int | None:
    """The dimension ``spec`` splits over ``axis``, or None."""
    if spec is None:
        return None
    for dim, entry in enumerate(spec):
        if entry == axis or (isinstance(entry, tuple) and axis in entry):
            return dim
    return None


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry names: ``None``, a name or a tuple of names."""
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def without_axis(spec: tuple[Any, ...] | None, ndim: int, axis: str) -> tuple[Any, ...]:
    """``spec`` padded to ``ndim`` entries, with ``axis`` dropped: what the layer itself declared."""
    entries = []
    for entry in tuple(spec or ()) + (None,) * (ndim - len(spec or ())):
        kept = tuple(a for a in entry_axes(entry) if a != axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(entries)


def with_axis(base: tuple[Any, ...], dim: int | None, axis: str) -> tuple[Any, ...]:
    """``base`` with ``axis`` put first on dimension ``dim`` (unchanged when ``dim`` is None)."""
    if dim is None:
        return base
    kept = (axis, *entry_axes(base[dim]))
    return (*base[:dim], kept[0] if len(kept) == 1 else kept, *base[dim + 1 :])


def gradient_spec(variable: nnx.Variable[Any], update_dim: int | None, axis: str) -> PartitionSpec:
    """Where a parameter's reduced gradient lives: its other axes as declared, ``axis`` on ``update_dim``."""
    ndim = np.ndim(variable.get_value())
    return PartitionSpec(*with_axis(without_axis(spec_tuple(variable), ndim, axis), update_dim, axis))


def choose_split_dim(
    shape: tuple[int, ...], axis_size: int, min_size: int, taken: tuple[Any, ...] = ()
) -> int | None:
    """The dimension a parameter of ``shape`` is split on (see the module docstring), or None.

    ``taken``: the parameter's spec over other axes; a dimension split there is skipped.
    """
    if not shape or math.prod(shape) < min_size:
        return None
    fits = [
        d
        for d, n in enumerate(shape)
        if n % axis_size == 0 and n >= axis_size and (d >= len(taken) or taken[d] is None)
    ]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def _flat(tree: Any) -> Iterator[tuple[tuple[Any, ...], nnx.Variable[Any]]]:
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
    """The optimizer-state paths and shapes ``optimizer.tx`` gives ``model``; None if not computable.

    ``tx.init`` runs abstractly (``jax.eval_shape``) on the model's parameters as plain
    arrays, as ``nnx.Optimizer.update`` hands them to optax: no memory, no compute, and
    no variable (nor its sharding metadata) is created.
    """
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
    """Raise a ValueError unless ``optimizer``'s state is what its transformation gives ``model``.

    ``optimizer.tx`` is initialized abstractly on ``model``'s parameters (no memory, no
    compute) and its state's paths and shapes compared with ``optimizer.opt_state``'s.
    Nothing is checked when the initialization cannot run abstractly.

    Raises:
      ValueError: If they differ (the optimizer was built for another model); names
        the first leaf that differs, with both shapes.
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


def optimizer_mirrors(
    model: nnx.Module, optimizer: nnx.Optimizer[Any]
) -> dict[tuple[Any, ...], tuple[tuple[Any, ...], ...]]:
    """Each model parameter's path, with the paths of the optimizer leaves that mirror it.

    A leaf of ``optimizer.opt_state`` mirrors a parameter when its path ends with the
    parameter's path and it has the parameter's shape (Adam's ``mu`` and ``nu``,
    momentum's trace, ``MultiSteps``' accumulated gradients). Other optimizer state
    (adafactor's factored statistics and placeholders, counters, coefficients) mirrors
    none and is not listed; ``optimizer_followers`` lists the parameter's leaves of
    other shapes.

    Raises:
      ValueError: If ``optimizer`` was built for another model (``check_optimizer_of``);
        names the first leaf that differs.
    """
    check_optimizer_of(model, optimizer)
    params = {p: v for p, v in _flat(model) if isinstance(v, nnx.Param)}
    mirrors: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {p: [] for p in params}
    for path, variable in _flat(optimizer):
        if path[:1] != ("opt_state",) or np.ndim(variable.get_value()) == 0:
            continue
        owner = _owner(path, params)
        if owner is not None and np.shape(variable.get_value()) == np.shape(params[owner].get_value()):
            mirrors[owner].append(path)
    return {p: tuple(m) for p, m in mirrors.items()}


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
    opt = dict(_flat(optimizer)) if optimizer is not None else {}
    splits = {}
    for path, variable in _flat(model):
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
    params = {p: v for p, v in _flat(model) if isinstance(v, nnx.Param)}
    followers: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {p: [] for p in params}
    for path, variable in _flat(optimizer):
        if path[:1] != ("opt_state",) or np.ndim(variable.get_value()) == 0:
            continue
        owner = _owner(path, params)
        if owner is not None and np.shape(variable.get_value()) != np.shape(params[owner].get_value()):
            followers[owner].append(path)
    return {p: tuple(f) for p, f in followers.items()}


def _global(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` on ``sharding``; on several processes, each fills its devices from its own copy."""
    if jax.process_count() > 1 and getattr(value, "is_fully_addressable", True):
        host = np.asarray(jax.device_get(value))
        return jax.make_array_from_callback(np.shape(value), sharding, lambda idx: host[idx])
    return jax.device_put(value, sharding)


def _place(variable: nnx.Variable[Any], spec: tuple[Any, ...], mesh: Mesh) -> None:
    value = variable.get_value()
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        # A typed key array has no host form: place its raw data, then wrap it again.
        data = _global(jax.random.key_data(value), NamedSharding(mesh, PartitionSpec()))
        variable.set_value(jax.random.wrap_key_data(data, impl=jax.random.key_impl(value)))
        return
    variable.set_value(_global(value, NamedSharding(mesh, PartitionSpec(*spec))))
    variable.set_metadata(out_sharding=spec)


def _layout_kind(layout: Any, params: bool | None) -> LayoutKind:
    """``layout`` checked, with ``params`` (its older spelling) folded in."""
    if params is not None:
        if not isinstance(params, bool):
            raise TypeError(f"params must be True (FSDP) or False (ZeRO-1); got {params!r}. Prefer layout=.")
        implied: LayoutKind = "fsdp" if params else "zero1"
        if layout is not None and layout != implied:
            raise ValueError(f"layout={layout!r} and params={params} disagree; pass layout= only.")
        return implied
    if layout is None:
        return "fsdp"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}.")
    return layout  # type: ignore[no-any-return]


def shard_state(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    *,
    mesh: Mesh | None = None,
    layout: LayoutKind | None = None,
    data_axis: str = "data",
    min_size: int = 1024,
    params: bool | None = None,
    axis: str | None = None,
) -> Layout:
    """Place ``model``'s and ``optimizer``'s state over ``data_axis``, in place: FSDP, ZeRO-1 or replicated.

    See the module docstring of ``substrax._layout`` for what each device then holds
    and which parameter is split on which dimension. Both modes of
    ``make_train_step`` train on the result as placed and keep it so.

    Args:
      model: The model; its ``nnx.Param`` variables are placed.
      optimizer: The model's ``nnx.Optimizer``; the state of each parameter is placed
        with it (see the module docstring), everything else replicated.
      mesh: The mesh; ``None`` takes the one set by ``jax.set_mesh``.
      layout: ``"fsdp"`` (the default) splits parameters and their optimizer state;
        ``"zero1"`` only the optimizer state; ``"replicated"`` splits nothing (every
        array placed whole on every device of the mesh).
      data_axis: The data axis to split over.
      min_size: Parameters with fewer elements stay replicated.
      params: The older spelling of ``layout``: ``True`` is ``"fsdp"``, ``False``
        ``"zero1"``.
      axis: The older spelling of ``data_axis``.

    Returns:
      The ``Layout``: which leaf went where, and the bytes per device.

    Raises:
      TypeError: If ``optimizer`` is not an ``nnx.Optimizer`` or ``min_size`` not an int.
      ValueError: If ``layout`` is unknown or contradicts ``params``, ``axis``
        contradicts ``data_axis``, the mesh lacks the axis, ``min_size`` is negative, the optimizer is
        not the model's (its state is not what its transformation gives this model:
        ``check_optimizer_of``), or a parameter already carries a sharding over another
        axis; each message names the axis or leaf. Optimizer state that mirrors no
        parameter (adafactor's factored statistics, counters) is placed, never refused.
    """
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(f"shard_state takes the model's nnx.Optimizer; got {type(optimizer).__name__}.")
    if isinstance(min_size, bool) or not isinstance(min_size, int):
        raise TypeError(f"min_size must be an int (a number of elements); got {min_size!r}.")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0 (a number of elements); got {min_size}.")
    layout = _layout_kind(layout, params)
    if axis is not None and axis != data_axis and data_axis != "data":
        raise ValueError(f"axis={axis!r} and data_axis={data_axis!r} disagree; pass data_axis only.")
    axis = data_axis if axis is None else axis
    found = current_mesh(mesh, required_axes=(axis,))
    if not isinstance(found, Mesh):
        raise ValueError("shard_state places arrays: call it outside jax.jit, with a concrete mesh.")
    size = found.shape[axis]
    mirrors = optimizer_mirrors(model, optimizer)
    followers = optimizer_followers(model, optimizer)
    model_vars = dict(_flat(model))
    opt_vars = dict(_flat(optimizer))
    for owner, variables in (("model", model_vars), ("optimizer", opt_vars)):
        for path, variable in variables.items():
            missing = [a for e in spec_tuple(variable) or () for a in entry_axes(e) if a not in found.axis_names]
            if missing:
                raise ValueError(
                    f"{path_str(path, owner)} is declared sharded as {spec_tuple(variable)}, over mesh "
                    f"axis {missing[0]!r}, which the mesh {dict(found.shape)} lacks. Build the mesh "
                    f"with that axis, or drop the annotation."
                )
    for path, mirror_paths in mirrors.items():
        variable = model_vars[path]
        shape = tuple(np.shape(variable.get_value()))
        base = without_axis(spec_tuple(variable), len(shape), axis)  # the layer's own (model-axis) splits
        dim = None if layout == "replicated" else choose_split_dim(shape, size, min_size, base)
        split = with_axis(base, dim, axis)
        _place(variable, split if layout == "fsdp" else base, found)
        for mirror in mirror_paths:
            _place(opt_vars[mirror], split, found)
        for follower in followers[path]:
            leaf_shape = tuple(np.shape(opt_vars[follower].get_value()))
            spec: list[Any] = [None] * len(leaf_shape)
            for d, entry in enumerate(split):
                on = follow_dim(shape, leaf_shape, d if entry is not None else None)
                ways = math.prod(found.shape[a] for a in entry_axes(entry))
                if on is not None and leaf_shape[on] % ways == 0:
                    spec[on] = entry
            _place(opt_vars[follower], tuple(spec), found)
    placed = (
        {("model", p) for p in mirrors}
        | {("optimizer", m) for ms in mirrors.values() for m in ms}
        | {("optimizer", f) for fs in followers.values() for f in fs}
    )
    for owner, variables in (("model", model_vars), ("optimizer", opt_vars)):
        for path, variable in variables.items():  # everything else: replicated on the mesh
            if (owner, path) not in placed and hasattr(variable.get_value(), "shape"):
                _place(variable, without_axis(spec_tuple(variable), np.ndim(variable.get_value()), axis), found)
    for obj in (model, optimizer):
        _EPOCHS[obj] = epoch(obj) + 1
    kind: LayoutKind = (
        layout
        if any(
            choose_split_dim(
                shape := tuple(np.shape(model_vars[p].get_value())),
                size,
                min_size,
                without_axis(spec_tuple(model_vars[p]), len(shape), axis),
            )
            is not None
            for p in mirrors
        )
        else "replicated"
    )
    return layout_of(model, optimizer, mesh=found, axis=axis, axis_size=size, kind=kind)


def layout_of(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    *,
    mesh: Mesh | None = None,
    data_axis: str = "data",
    axis_size: int | None = None,
    kind: LayoutKind | None = None,
    axis: str | None = None,
) -> Layout:
    """The layout ``model`` and ``optimizer`` have now, read from their variables' metadata.

    Args:
      model: The model.
      optimizer: Its optimizer.
      mesh: The mesh, for the axis's size when no array is placed on one.
      data_axis: The data axis.
      axis_size: The axis's size; default: from the mesh the arrays are placed on, else
        ``mesh`` or the one set by ``jax.set_mesh``, else 1 (nothing placed: every
        device that runs it holds it whole).
      kind: The layout's name; default: ``"fsdp"`` when a parameter is split,
        ``"zero1"`` when only optimizer state is, else ``"replicated"``.
      axis: The older spelling of ``data_axis``.
    """
    axis = data_axis if axis is None else axis
    if axis_size is None:
        meshes = [
            v.get_value().sharding.mesh
            for _, v in _flat((model, optimizer))
            if isinstance(getattr(v.get_value(), "sharding", None), NamedSharding)
        ]
        with_axis = [m for m in meshes if axis in m.axis_names]
        if not with_axis:
            try:
                with_axis = [current_mesh(mesh, required_axes=(axis,))]
            except ValueError:
                if mesh is not None:
                    raise
        axis_size = with_axis[0].shape[axis] if with_axis else 1
        sizes = dict(with_axis[0].shape) if with_axis else {}
    else:
        sizes = {}
        try:
            sizes = dict(current_mesh(mesh).shape)
        except ValueError:
            if mesh is not None:
                raise
    rows = []
    for owner, tree in (("model", model), ("optimizer", optimizer)):
        for path, variable in _flat(tree):
            value = variable.get_value()
            if not hasattr(value, "shape"):
                continue
            dtype = value.dtype
            name = "key" if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype).name
            if name == "key":
                continue
            shape = tuple(value.shape)
            others = tuple(
                (d, a, sizes.get(a, 1))
                for d, entry in enumerate(without_axis(spec_tuple(variable), len(shape), axis))
                for a in entry_axes(entry)
            )
            rows.append(
                LeafPlacement(
                    owner,
                    path_str(path, owner),
                    shape,
                    name,
                    split_dim_of(spec_tuple(variable), axis),
                    axis_size,
                    others,
                )
            )
    if kind is None:
        split_model = any(r.split_dim is not None and r.owner == "model" for r in rows)
        split_opt = any(r.split_dim is not None and r.owner == "optimizer" for r in rows)
        kind = "fsdp" if split_model else "zero1" if split_opt else "replicated"
    return Layout(kind, axis, axis_size, tuple(rows))
