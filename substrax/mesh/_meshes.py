"""Meshes: one from a shape (``Auto`` axes), the data-, model-parallel and hybrid ones, the
mesh in effect, emulated CPU devices, and the ``DeviceMeshManager`` spelling of them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

__all__ = [
    "DeviceMeshManager",
    "MeshShape",
    "create_data_parallel_mesh",
    "create_device_mesh",
    "create_hybrid_mesh",
    "create_model_parallel_mesh",
    "current_mesh",
    "current_mesh_with",
    "get_mesh_info",
    "mesh_in_effect",
    "mesh_info",
    "use_cpu_devices",
]

MeshShape = Mapping[str, int] | Sequence[tuple[str, int]]


def _axes(mesh_shape: MeshShape) -> list[tuple[str, int]]:
    pairs = list(mesh_shape.items()) if isinstance(mesh_shape, Mapping) else list(mesh_shape)
    try:
        return [(name, size) for name, size in pairs]
    except (TypeError, ValueError):
        raise ValueError(
            f"mesh_shape {mesh_shape!r} must be a mapping from axis name to size, or a list "
            f"of (name, size) pairs, such as {{'data': 8}} or [('data', 4), ('model', 2)]."
        ) from None


def create_device_mesh(
    mesh_shape: MeshShape,
    devices: Sequence[jax.Device] | None = None,
    *,
    axis_types: Sequence[AxisType] | AxisType | None = None,
) -> Mesh:
    """Create a named device mesh.

    Args:
      mesh_shape: Axis name to size, as a mapping (``{"data": 4, "model": 2}``) or a list
        of ``(name, size)`` pairs; the order is the mesh's axis order.
      devices: The devices to lay out; ``jax.devices()`` by default. Only the first
        ``prod(sizes)`` are used, in ``jax.make_mesh``'s topology-aware order.
      axis_types: One ``jax.sharding.AxisType`` for every axis, or one per axis;
        ``AxisType.Auto`` by default (see the batches guide, "Meshes with Auto axes").

    Returns:
      A ``jax.sharding.Mesh`` with the given axis names and sizes.

    Raises:
      ValueError: If a size is not a positive int, an axis name repeats, or the shape
        needs more devices than there are; the message names the shape and the count.
    """
    available = list(devices) if devices is not None else jax.devices()
    axes = _checked_axes(mesh_shape, available)
    if axis_types is None:
        axis_types = AxisType.Auto
    if isinstance(axis_types, AxisType):
        axis_types = (axis_types,) * len(axes)
    if len(axis_types) != len(axes):
        names = [n for n, _ in axes]
        raise ValueError(f"axis_types has {len(axis_types)} entries for {len(axes)} mesh axes {names}.")
    needed = math.prod(s for _, s in axes)
    return jax.make_mesh(
        tuple(s for _, s in axes),
        tuple(n for n, _ in axes),
        axis_types=tuple(axis_types),
        devices=available[:needed],
    )


def _checked_axes(mesh_shape: MeshShape, available: Sequence[jax.Device]) -> list[tuple[str, int]]:
    """``mesh_shape``'s ``(name, size)`` pairs, checked against the ``available`` devices."""
    axes = _axes(mesh_shape)
    shape_text = dict(axes) if len({n for n, _ in axes}) == len(axes) else axes
    for name, size in axes:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Mesh axis names must be non-empty strings; got {name!r} in {shape_text}.")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"Mesh axis {name!r} has size {size!r}; every size in {shape_text} must be a "
                f"positive int (their product at most the {len(available)} devices available)."
            )
    names = [n for n, _ in axes]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"Mesh axis names {repeated} repeat in mesh_shape {axes} ({len(available)} devices "
            f"available); name each axis once."
        )
    needed = math.prod(s for _, s in axes)
    if needed > len(available):
        raise ValueError(
            f"Not enough devices: mesh shape {shape_text} needs {needed} devices, but {len(available)} are "
            f"available. Use a smaller shape, or on the CPU emulate more devices with "
            f"substrax.mesh.use_cpu_devices({needed}) before jax starts."
        )
    return axes


def create_data_parallel_mesh(num_devices: int | None = None, *, data_axis: str = "data") -> Mesh:
    """Create a one-axis mesh ``{data_axis: num_devices}`` (Auto) for data parallelism.

    Args:
      num_devices: How many devices the axis spans; every device by default.
      data_axis: The axis name.

    Raises:
      ValueError: As ``create_device_mesh``.
    """
    return create_device_mesh({data_axis: jax.device_count() if num_devices is None else num_devices})


def create_model_parallel_mesh(num_devices: int, *, model_axis: str = "model") -> Mesh:
    """Create a one-axis mesh ``{model_axis: num_devices}`` (Auto) for model parallelism.

    Args:
      num_devices: How many devices the axis spans.
      model_axis: The axis name.

    Raises:
      ValueError: As ``create_device_mesh`` ("Not enough devices" when there are fewer).
    """
    return create_device_mesh({model_axis: num_devices})


def _granules(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """The devices grouped by slice (multi-slice TPU) or else by process, in order."""
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        key = lambda d: d.slice_index  # noqa: E731
    else:
        key = lambda d: d.process_index  # noqa: E731
    groups: dict[int, list[jax.Device]] = {}
    for d in devices:
        groups.setdefault(key(d), []).append(d)
    return [groups[k] for k in sorted(groups)]


def create_hybrid_mesh(
    data_parallel_size: int,
    model_parallel_size: int,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: Sequence[AxisType] | AxisType | None = None,
) -> Mesh:
    """Create a two-axis ``("data", "model")`` mesh, ``model`` inside a host, ``data`` across hosts.

    See the batches guide, "Meshes with Auto axes", for the layout.

    Args:
      data_parallel_size: Devices along ``data``; a multiple of the number of hosts.
      model_parallel_size: Devices along ``model``, at most a host's devices.
      devices: The devices to lay out; ``jax.devices()`` by default. Each host gives
        its first ``data_parallel_size * model_parallel_size // hosts`` devices.
      axis_types: As ``create_device_mesh``; ``AxisType.Auto`` by default.

    Returns:
      A mesh with axes ``("data", "model")`` of those sizes.

    Raises:
      ValueError: If a size is not a positive int, there are not enough devices ("Not
        enough devices", with the count), ``data_parallel_size`` does not divide by the
        number of hosts, or a host has too few devices for its share; names the sizes.
    """
    from jax.experimental import mesh_utils

    shape = {"data": data_parallel_size, "model": model_parallel_size}
    available = list(devices) if devices is not None else jax.devices()
    groups = _granules(available)
    if len(groups) == 1:
        return create_device_mesh(shape, available, axis_types=axis_types)
    create_device_mesh(shape, available)  # the same checks of the sizes and the device count
    hosts = len(groups)
    if data_parallel_size % hosts:
        raise ValueError(
            f"create_hybrid_mesh: data_parallel_size {data_parallel_size} does not divide by "
            f"the {hosts} hosts the devices are on; the data axis spans every host, so make it "
            f"a multiple of {hosts}."
        )
    per_host = data_parallel_size // hosts * model_parallel_size
    short = [i for i, g in enumerate(groups) if len(g) < per_host]
    if short:
        raise ValueError(
            f"create_hybrid_mesh: each of the {hosts} hosts needs {per_host} devices for "
            f"{shape}, but host(s) {short} have fewer ({[len(groups[i]) for i in short]})."
        )
    layout = mesh_utils.create_hybrid_device_mesh(
        (data_parallel_size // hosts, model_parallel_size),
        (hosts, 1),
        [d for g in groups for d in g[:per_host]],
        process_is_granule=len({getattr(d, "slice_index", 0) for d in available}) == 1,
    )
    types = AxisType.Auto if axis_types is None else axis_types
    return Mesh(
        layout, ("data", "model"), axis_types=(types,) * 2 if isinstance(types, AxisType) else tuple(types)
    )


def get_mesh_info(mesh: Mesh) -> dict[str, Any]:
    """The short form of ``mesh_info``, kept for earlier code: ``{"total_devices": n, "axes": {name: size}}``.

    Args:
      mesh: The mesh.
    """
    return {"total_devices": int(mesh.devices.size), "axes": dict(mesh.shape)}


def mesh_info(mesh: Mesh) -> dict[str, Any]:
    """Describe a mesh: its axes, sizes, types and devices.

    Returns:
      A dict with ``axis_names``, ``shape``, ``axis_types`` (name to type name),
      ``num_devices``, ``platform``, ``process_count`` (processes owning its devices) and
      ``local_shape`` (name to size over this process's devices).
    """
    devices = mesh.devices.flat
    return {
        "axis_names": tuple(mesh.axis_names),
        "shape": dict(mesh.shape),
        "axis_types": {n: t.name for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)},
        "num_devices": mesh.size,
        "platform": mesh.devices.flat[0].platform,
        "process_count": len({d.process_index for d in devices}),
        "local_shape": dict(mesh.local_mesh.shape),
    }


def current_mesh(
    mesh: Mesh | AbstractMesh | None = None, *, required_axes: Iterable[str] = ()
) -> Mesh | AbstractMesh:
    """Return ``mesh``, or the one set by ``jax.set_mesh``, checking it has ``required_axes``.

    Inside ``jax.jit`` that is an ``AbstractMesh``.

    Raises:
      ValueError: If there is no mesh, or an axis is missing; names the mesh's axes.
    """
    if mesh is None:
        found = _set_mesh()
        mesh = found if found.axis_names else None
    if mesh is None:
        raise ValueError(
            "No mesh: pass mesh=, or call inside `with jax.set_mesh(mesh):` "
            "(substrax.mesh.create_device_mesh builds one)."
        )
    for axis in required_axes:
        if axis not in mesh.axis_names:
            raise ValueError(
                f"Axis {axis!r} is not in the mesh, whose axes are {tuple(mesh.axis_names)}; "
                f"pass one of those as the axis name, or build the mesh with {axis!r}."
            )
    return mesh


def current_mesh_with(axis: str, mesh: Mesh | AbstractMesh | None = None) -> Mesh | AbstractMesh | None:
    """The mesh with ``axis``: ``mesh``, or the one set by ``jax.set_mesh`` when it has ``axis``.

    Returns ``None`` where ``current_mesh`` would raise; a ``mesh`` given is checked as
    ``current_mesh`` checks it. Inside ``jax.jit`` (or with only an abstract mesh set) the
    abstract mesh.
    """
    if mesh is not None:
        return current_mesh(mesh, required_axes=(axis,))
    found = _set_mesh()
    if axis not in found.axis_names:  # an abstract mesh set alone
        found = jax.sharding.get_abstract_mesh()
    return found if axis in found.axis_names else None


def mesh_in_effect(mesh: Mesh | AbstractMesh | None = None) -> Mesh | AbstractMesh | None:
    """``mesh``, else the one set by ``jax.set_mesh`` (inside ``jax.jit``: the abstract mesh), else None."""
    if mesh is not None:
        return mesh
    found = _set_mesh()
    if not found.axis_names:  # an abstract mesh set alone
        found = jax.sharding.get_abstract_mesh()
    return found if found.axis_names else None


def _set_mesh() -> Mesh | AbstractMesh:
    """The mesh set by ``jax.set_mesh`` (an empty one when none is set)."""
    try:
        return jax.sharding.get_mesh()
    except ValueError:  # inside jax.jit only the abstract mesh is known
        return jax.sharding.get_abstract_mesh()


def use_cpu_devices(num_devices: int) -> None:
    """Emulate ``num_devices`` CPU devices (sets ``jax_num_cpu_devices``); call before jax starts a backend.

    Args:
      num_devices: How many CPU devices jax should expose.

    Raises:
      ValueError: If ``num_devices`` is not a positive int.
      RuntimeError: If jax's backend is already up with another device count; the message
        says how to start over.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int; got {num_devices!r}.")
    from jax._src import xla_bridge  # The only way to ask without starting a backend.

    if xla_bridge.backends_are_initialized():
        have = jax.local_device_count()
        if jax.default_backend() == "cpu" and have == num_devices:
            return
        raise RuntimeError(
            f"jax's backend is already running with {have} {jax.default_backend()} "
            f"device(s), so it cannot switch to {num_devices} emulated CPU devices. Call "
            f"substrax.mesh.use_cpu_devices({num_devices}) right after `import jax`, before "
            f"any array is created, or start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices}."
        )
    jax.config.update("jax_num_cpu_devices", num_devices)


class DeviceMeshManager:
    """Builds and describes device meshes (the names the reference uses)."""

    create_device_mesh = staticmethod(create_device_mesh)
    create_data_parallel_mesh = staticmethod(create_data_parallel_mesh)
    create_model_parallel_mesh = staticmethod(create_model_parallel_mesh)
    create_hybrid_mesh = staticmethod(create_hybrid_mesh)
    get_mesh_info = staticmethod(get_mesh_info)
    mesh_info = staticmethod(mesh_info)
