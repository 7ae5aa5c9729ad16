"""Logical axis rules: name an array's dimensions, get its ``PartitionSpec``.

``MeshRules`` maps the Flax NNX FSDP example's names (``data``, ``embed``, ``mlp``,
``heads``) to mesh axes, with avitai/substrax's names and defaults.

    >>> from substrax.mesh import fsdp_rules, partition_spec_for_names
    >>> partition_spec_for_names(fsdp_rules(), "data", "embed")
    P('data', 'model')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

Axis = str | tuple[str, ...] | None


def _axis(value: object, what: str) -> Axis:
    """``value`` if it is a mesh axis name, a tuple of names or None; else a clear error."""
    if value is None:
        return None
    names = value if isinstance(value, tuple) else (value,)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{what} must be a mesh axis name (str), a tuple of names, or None; got {value!r} "
            f"({type(value).__name__})."
        )
    if not names or not all(names) or len(set(names)) != len(names):
        raise ValueError(
            f"{what} must be a non-empty mesh axis name, or a non-empty tuple of distinct "
            f"ones; got {value!r}. Use None to leave the dimension unsplit."
        )
    return value  # type: ignore[return-value]


def _no_axis_twice(axes: tuple[Axis, ...], dims: tuple[str, ...], what: str) -> None:
    seen: dict[str, str] = {}
    for axis, dim in zip(axes, dims, strict=True):
        for name in (axis,) if isinstance(axis, str) else axis or ():
            if name in seen:
                raise ValueError(
                    f"{what}: {seen[name]} and {dim} both map to mesh axis {name!r}; a mesh axis "
                    f"can split only one dimension of an array. Map one of them elsewhere or to None."
                )
            seen[name] = dim


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshRules:
    """Which mesh axis (or axes) splits each logical dimension; ``None`` leaves it whole.

    Attributes:
      data: The batch dimension's axis.
      embed: The embedding (model width) dimension's axis.
      mlp: The MLP hidden dimension's axis.
      heads: The attention heads dimension's axis.

    Raises:
      TypeError: If a field is not a str, a tuple of str, or None.
      ValueError: If a name is empty, a tuple is empty or repeats a name.

    Example, on a ``{"data": 4, "model": 2}`` mesh:

      >>> from substrax.mesh import MeshRules, create_device_mesh, create_named_sharding
      >>> rules = MeshRules(data="data", mlp="model")
      >>> rules("data", "mlp", "embed")
      ('data', 'model', None)
      >>> mesh2d = create_device_mesh({"data": 4, "model": 2})
      >>> sharding = create_named_sharding(mesh2d, *rules("embed", "mlp"))
      >>> sharding.shard_shape((8, 128))
      (8, 64)
    """

    data: Axis = None
    embed: Axis = None
    mlp: Axis = None
    heads: Axis = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _axis(getattr(self, field.name), f"MeshRules.{field.name}")

    def __call__(self, *keys: str) -> tuple[Axis, ...]:
        """The mesh axes of the logical dimensions ``keys``, in order; ``None`` where unmapped.

        Raises:
          TypeError: If a key is not a str.
          ValueError: If a key is not a field of ``MeshRules``; names it and the fields.
        """
        known = tuple(f.name for f in dataclasses.fields(self))
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"Logical dimension names are str; got {key!r} ({type(key).__name__}).")
            if key not in known:
                raise ValueError(f"Unknown logical dimension name {key!r}; MeshRules knows {known}.")
        return tuple(getattr(self, key) for key in keys)


def data_parallel_rules(data_axis: str | tuple[str, ...] = "data") -> MeshRules:
    """Rules for data parallelism: the batch split over ``data_axis``, everything else whole.

    Raises:
      TypeError: If ``data_axis`` is not a str or a tuple of str.
      ValueError: If it is empty, or a tuple empty or repeating a name.
    """
    return MeshRules(data=_axis(data_axis, "data_parallel_rules: data_axis"))


def fsdp_rules(
    data_axis: str | tuple[str, ...] = "data", model_axis: str | tuple[str, ...] = "model"
) -> MeshRules:
    """Rules with the batch on ``data_axis`` and ``embed``, ``mlp`` and ``heads`` on ``model_axis``.

    ``embed`` and ``mlp`` share ``model_axis``, so ``partition_spec_for_names`` refuses a
    weight named ``"embed", "mlp"``; ``dataclasses.replace(rules, embed=None)`` keeps one.

    Raises:
      TypeError: If an axis is not a str or a tuple of str; names the argument.
      ValueError: If an axis name is empty, or a tuple empty or repeating; names the argument.
    """
    data = _axis(data_axis, "fsdp_rules: data_axis")
    model = _axis(model_axis, "fsdp_rules: model_axis")
    return MeshRules(data=data, embed=model, mlp=model, heads=model)


def create_named_sharding(mesh: Mesh | AbstractMesh, *axis_names: Axis) -> NamedSharding:
    """``NamedSharding(mesh, PartitionSpec(*axis_names))``; no names: replicated.

    Raises:
      TypeError: If ``mesh`` is not a ``jax.sharding.Mesh``, or an axis name is not a str,
        tuple of str or None.
      ValueError: If an axis is not in the mesh (names the mesh's axes) or splits two dimensions.
    """
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"create_named_sharding: mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}."
        )
    axes = tuple(_axis(a, f"create_named_sharding: axis_names[{i}]") for i, a in enumerate(axis_names))
    for i, axis in enumerate(axes):
        for name in (axis,) if isinstance(axis, str) else axis or ():
            if name not in mesh.axis_names:
                raise ValueError(
                    f"create_named_sharding: axis_names[{i}] {name!r} is not in the mesh, whose "
                    f"axes are {tuple(mesh.axis_names)}."
                )
    _no_axis_twice(axes, tuple(f"axis_names[{i}]" for i in range(len(axes))), "create_named_sharding")
    return NamedSharding(mesh, PartitionSpec(*axes))


def partition_spec_for_names(rules: MeshRules, *logical_names: str) -> PartitionSpec:
    """``PartitionSpec(*rules(*logical_names))``: the mesh axes of an array's named dimensions.

    Raises:
      TypeError: If ``rules`` is not a ``MeshRules`` or a name is not a str.
      ValueError: If a name is unknown, or two names map to the same mesh axis (a spec
        that jax would reject); names them.
    """
    if not isinstance(rules, MeshRules):
        raise TypeError(
            f"partition_spec_for_names: rules must be a MeshRules (data_parallel_rules() or "
            f"fsdp_rules() build one); got {type(rules).__name__}."
        )
    axes = rules(*logical_names)
    _no_axis_twice(axes, tuple(repr(n) for n in logical_names), f"partition_spec_for_names under {rules}")
    return PartitionSpec(*axes)
