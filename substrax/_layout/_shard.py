"""``shard_state``: place a model's and optimizer's state over the data axis (see the layouts guide)."""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax._base.trees import adopt_assigned_arrays, path_str
from substrax._layout._decide import ShardDecision, decide
from substrax._layout._owners import flat_state
from substrax._layout._report import LAYOUTS, REPLICA_AXIS, REPLICA_KEY, Layout, LayoutKind, layout_of
from substrax._layout._specs import model_roles, spec_tuple, split_dim_of, trimmed
from substrax._layout._stages import mark_stages
from substrax._layout._units import UnitsSpec, mark_units
from substrax.mesh import compile_only, current_mesh

__all__ = ["epoch", "shard_state"]

# shard_state calls per object: a step that split a model before one must split it again.
_EPOCHS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def epoch(obj: Any) -> int:
    """How many times ``shard_state`` has placed ``obj`` (a model or an optimizer)."""
    return _EPOCHS.get(obj, 0)


def _global(value: Any, sharding: NamedSharding) -> Any:
    """``value`` on ``sharding``; on several processes, each fills its devices from its own copy.

    An abstract ``value`` (a ``jax.ShapeDtypeStruct``, as from ``nnx.eval_shape``) stays abstract,
    with ``sharding``: the mesh's devices may be compile-only (``substrax.mesh.topology_mesh``).
    """
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding, weak_type=value.weak_type)
    if not jax.tree.leaves(value):  # optax.MaskedNode(): nothing to place (device_put leaves it too)
        return value
    if jax.process_count() > 1 and getattr(value, "is_fully_addressable", True):
        host = np.asarray(jax.device_get(value))
        return jax.make_array_from_callback(np.shape(value), sharding, lambda idx: host[idx])
    if isinstance(value, jax.Array) and len(value.devices()) == 1 and sharding.is_fully_replicated:
        # device_put reuses the value's buffer on its own device for a whole copy: a step donating
        # the placed array would delete the value under whoever kept it. Copied first where it is.
        value = jax.device_put(value, next(iter(value.devices())), may_alias=False)
    return jax.device_put(value, sharding)


def _place(variable: nnx.Variable[Any], spec: tuple[Any, ...], mesh: Mesh) -> None:
    value = variable.get_value()
    if isinstance(value, jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        variable.set_value(_global(value, NamedSharding(mesh, PartitionSpec())))
        return
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        # A typed key array has no host form: place its raw data, then wrap it again.
        data = _global(jax.random.key_data(value), NamedSharding(mesh, PartitionSpec()))
        variable.set_value(jax.random.wrap_key_data(data, impl=jax.random.key_impl(value)))
        return
    variable.set_value(_global(value, NamedSharding(mesh, trimmed(spec, mesh))))
    variable.set_metadata(out_sharding=spec)


def _check_abstract(model: nnx.Module, optimizer: nnx.Optimizer[Any], mesh: Mesh) -> None:
    """Raise where the state holds an array: a compile-only mesh's devices take abstract state only."""
    for owner, tree in (("model", model), ("optimizer", optimizer)):
        for path, variable in flat_state(tree):
            value = variable.get_value()
            if hasattr(value, "shape") and not isinstance(value, jax.ShapeDtypeStruct):
                kind = mesh.devices.flat[0].device_kind
                raise ValueError(
                    f"shard_state: the mesh's devices ({kind}, {mesh.size}) are compile-only, so they hold "
                    f"no array, and {path_str(path, owner)} is one. Build the model and optimizer abstract: "
                    f"model = nnx.eval_shape(lambda: Model(...)), optimizer = nnx.eval_shape(lambda: "
                    f"nnx.Optimizer(Model(...), tx, wrt=nnx.Param)); see the guide 'Plan a pod from a "
                    f"laptop'."
                )


def _older_spellings(
    layout: Any, params: bool | None, data_axis: str, axis: str | None
) -> tuple[LayoutKind | None, str]:
    """``layout`` and the data axis, with ``params`` and ``axis`` (their older spellings) folded in."""
    if params is not None:
        if not isinstance(params, bool):
            raise TypeError(f"params must be True (FSDP) or False (ZeRO-1); got {params!r}. Prefer layout=.")
        implied: LayoutKind = "fsdp" if params else "zero1"
        if layout is not None and layout != implied:
            raise ValueError(f"layout={layout!r} and params={params} disagree; pass layout= only.")
        layout = implied
    if axis is not None and axis != data_axis and data_axis != "data":
        raise ValueError(f"axis={axis!r} and data_axis={data_axis!r} disagree; pass data_axis only.")
    return layout, data_axis if axis is None else axis


def _checked_layout(layout: Any, units: UnitsSpec) -> LayoutKind:
    """``layout`` (``None``: ``"fsdp"``) checked, and against ``units``."""
    layout = "fsdp" if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}.")
    if units is not None and layout not in ("fsdp", "hsdp"):
        raise ValueError(
            f"units= names what FSDP gathers together; layout={layout!r} gathers no parameter. "
            f"Pass layout='fsdp', or drop units=."
        )
    return layout  # type: ignore[no-any-return]


def _checked_arguments(optimizer: Any, min_size: Any) -> None:
    """Refuse an ``optimizer`` that is no ``nnx.Optimizer`` and a ``min_size`` that is no count."""
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(f"shard_state takes the model's nnx.Optimizer; got {type(optimizer).__name__}.")
    if isinstance(min_size, bool) or not isinstance(min_size, int):
        raise TypeError(f"min_size must be an int (a number of elements); got {min_size!r}.")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0 (a number of elements); got {min_size}.")


def _mesh_for(
    model: nnx.Module,
    optimizer: nnx.Optimizer[Any],
    mesh: Mesh | None,
    axis: str,
    layout: str,
    replica_axis: str,
) -> Mesh:
    """The concrete mesh to place on (``mesh`` or the one set), its axis roles checked (``axis_roles``)
    and HSDP's ``replica_axis`` on it."""
    found = current_mesh(mesh)
    model_roles(model, found, axis, replica_axis)
    if not isinstance(found, Mesh):
        raise ValueError("shard_state places arrays: call it outside jax.jit, with a concrete mesh.")
    if compile_only(found):
        _check_abstract(model, optimizer, found)
    if layout == "hsdp" and replica_axis not in found.axis_names:
        raise ValueError(
            f"layout='hsdp' splits the state over {axis!r} within a replica and replicates it "
            f"over {replica_axis!r}, which the mesh {dict(found.shape)} lacks. Build the mesh with "
            f"both, replicas outer: create_device_mesh({{{replica_axis!r}: R, {axis!r}: D}}) "
            f"(or name yours with replica_axis=), or use layout='fsdp' on this mesh."
        )
    return found


def _apply(model: nnx.Module, optimizer: nnx.Optimizer[Any], decision: ShardDecision) -> Layout:
    """Place the state as ``decision`` says, mark the units, stages and replica axis; the ``Layout``."""
    d = decision
    variables = {"model": dict(flat_state(model)), "optimizer": dict(flat_state(optimizer))}
    for (owner, path), spec in d.specs.items():
        _place(variables[owner][path], spec, d.mesh)
    for (owner, path), said in d.declared.items():
        variables[owner][path].set_metadata(declared_sharding=said)
    fsdp = d.layout in ("fsdp", "hsdp")
    split = {
        p
        for p, v in variables["model"].items()
        if isinstance(v, nnx.Param) and fsdp and split_dim_of(spec_tuple(v), d.axis) is not None
    }
    mark_units(model, list(d.units), d.reshard_after_forward, split, d.prefetch)
    mark_stages(model, d.stage, d.virtual_stages)
    hsdp = d.layout == "hsdp"
    # the replica axis recorded: the steps refuse another (check_replica_axis)
    for variable in variables["model"].values():
        if isinstance(variable, nnx.Param) and (hsdp or variable.get_metadata().get(REPLICA_KEY)):
            variable.set_metadata(**{REPLICA_KEY: d.replica_axis if hsdp else None})
    for obj in (model, optimizer):
        _EPOCHS[obj] = epoch(obj) + 1
    return dataclasses.replace(
        layout_of(model, optimizer, mesh=d.mesh, axis=d.axis, axis_size=d.size, kind=d.kind),
        asked=d.layout,
        min_size=d.min_size,
        left_whole=d.left_whole,
    )


def _warn_left_whole(decision: ShardDecision, stacklevel: int) -> None:
    """Warn once, naming each parameter of at least ``min_size`` elements no dimension of which divides."""
    d, size, axis = decision, decision.size, decision.axis
    # fewer elements than devices cannot be split, whatever the shape: named in the summary only
    odd = [w for w in d.left_whole if w.reason == "indivisible" and math.prod(w.shape) >= size]
    if not odd:
        return
    one = len(odd) == 1
    warnings.warn(
        f"substrax.shard_state(layout={d.layout!r}) leaves {len(odd)} parameter{'' if one else 's'} of at "
        f"least min_size={d.min_size:,} elements whole on every device: no dimension of "
        f"{'it' if one else 'each'} is a multiple of the {size} devices of {axis!r} ("
        + ", ".join(f"{w.path} {w.shape}" for w in odd)
        + f"). Each device holds and updates {'it' if one else 'them'} whole, with "
        f"{'its' if one else 'their'} optimizer state. To split one, pad a dimension to a multiple of "
        f"{size}, or use a {axis!r} axis whose size divides one of its dimensions.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


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
    units: UnitsSpec = None,
    reshard_after_forward: bool = True,
    prefetch: bool = False,
    replica_axis: str = REPLICA_AXIS,
    stages: UnitsSpec = None,
    virtual_stages: int = 1,
) -> Layout:
    """Place ``model``'s and ``optimizer``'s state over ``data_axis``, in place: FSDP, ZeRO-1 or replicated.

    Both modes of ``make_train_step`` train on the result and keep it. A layer's own split over another axis
    (``substrax.nn``) is kept, the layout going on another dimension. See the layouts guide (which leaf is
    split where, the optimizer state, "Units", "Hybrid sharding") and the tensor-parallelism guide.

    Args:
      model: The model; its ``nnx.Param`` variables are placed.
      optimizer: The model's ``nnx.Optimizer``; each parameter's state is placed with it,
        the rest replicated.
      mesh: The mesh; ``None`` takes the one set by ``jax.set_mesh``.
      layout: ``"fsdp"`` (the default: parameters and their state split), ``"zero1"`` (the
        optimizer state only), ``"replicated"``, or ``"hsdp"`` (FSDP within a replica,
        replicated over ``replica_axis``, which the mesh must have).
      data_axis: The data axis to split over (a mesh without it: one device, nothing split).
      min_size: Parameters with fewer elements stay replicated.
      params: Older spelling of ``layout`` (``True``: ``"fsdp"``, ``False``: ``"zero1"``); still works.
      axis: Older spelling of ``data_axis``; still works. Given with the newer one, they must agree.
      units: FSDP units: a module type, a tuple of them, or ``(path, module) -> bool``;
        each unit's parameters are gathered together right before it runs (explicit
        mode). ``None``: each parameter gathered before the forward pass.
      reshard_after_forward: With ``units``: gather a unit again for its backward pass
        (``True``, the least memory) or keep it from the forward pass (``False``).
      prefetch: With ``units``: a stacked unit run by ``substrax.nn.scan_layers`` gathers
        layer i+1 while layer i computes, forward and backward (explicit mode).
      replica_axis: ``layout="hsdp"``'s outer axis, over which the state is replicated;
        recorded on the parameters, the step must be built with the same one.
      stages: On a mesh with a ``stage`` axis, the stack of layers to pipeline: a module
        type (a stack built by ``nnx.vmap`` and applied by ``substrax.nn.scan_layers``), a
        tuple of them, or ``(path, module) -> bool``. Its parameters (and their optimizer
        state, and its random streams' counts) are split on the layer axis over ``stage``,
        consecutive layers a stage; the layout applies within a stage (see the pipelines guide).
      virtual_stages: With ``stages``: the chunks each stage runs under ``"interleaved-1f1b"``
        (the state keeps the model's order; the step moves the chunks: pipelines guide).

    Returns:
      The ``Layout``: which leaf went where, the bytes per device, and the parameters
      left whole and why (``Layout.left_whole``).

    Raises:
      TypeError: If ``optimizer`` is not an ``nnx.Optimizer``, ``min_size`` or ``virtual_stages`` not an int.
      ValueError: If ``units`` comes with a layout other than ``"fsdp"``, matches no submodule (naming
        the model's module types), the model or a module inside another; ``prefetch`` without ``units``
        or with ``reshard_after_forward=False``; a ``stage`` axis without ``stages``, or ``stages``
        without one, with ``prefetch``, matching nothing, no stack or two, or a stack the stages (times
        ``virtual_stages``) do not divide; ``layout`` unknown or contradicting ``params``; ``axis``
        contradicting ``data_axis``; two roles on one axis, or an axis without a role (batches guide,
        "Axis roles"); a negative ``min_size``; an optimizer not the model's. Each names the axis or leaf.

    Warns:
      UserWarning: Once per call, naming each parameter of ``min_size`` or more left whole by a split.
    """
    _checked_arguments(optimizer, min_size)
    adopt_assigned_arrays(optimizer)  # an array assigned where the optimizer held a variable
    asked, data_axis = _older_spellings(layout, params, data_axis, axis)
    kind = _checked_layout(asked, units)
    found = _mesh_for(model, optimizer, mesh, data_axis, kind, replica_axis)
    decision = decide(model, optimizer, found, layout=kind, axis=data_axis, min_size=min_size, units=units,
                      reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                      replica_axis=replica_axis, stages=stages, virtual_stages=virtual_stages)  # fmt: skip
    placed = _apply(model, optimizer, decision)  # what it decided, done: nothing moved before here
    _warn_left_whole(decision, stacklevel=2)
    return placed
