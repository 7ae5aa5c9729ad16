"""FSDP units: the submodules whose split parameters are gathered together, just in time.

``shard_state(..., units=...)`` writes the unit on its split parameters' metadata
(``fsdp_unit``, ``fsdp_reshard_after_forward``, ``fsdp_prefetch``). See the layouts guide, "Units".
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from substrax._base.hooks import recording_into
from substrax._base.trees import KeyPath, node_at, path_str

__all__ = [
    "PREFETCH_KEY",
    "RESHARD_KEY",
    "UNIT_KEY",
    "UnitsSpec",
    "find_units",
    "mark_units",
    "matched_modules",
    "note_layers",
    "prefetched_units",
    "recording_layers",
    "stacked_modules",
    "unit_paths",
]

UNIT_KEY = "fsdp_unit"
RESHARD_KEY = "fsdp_reshard_after_forward"
PREFETCH_KEY = "fsdp_prefetch"

UnitsSpec = type | tuple[type, ...] | Callable[[KeyPath, nnx.Module], bool] | None


def _matcher(units: UnitsSpec, keyword: str = "units") -> Callable[[KeyPath, Any], bool]:
    if isinstance(units, type) or (isinstance(units, tuple) and all(isinstance(u, type) for u in units)):
        return lambda _, node: isinstance(node, units)  # type: ignore[arg-type]
    if callable(units):
        return lambda path, node: isinstance(node, nnx.Module) and bool(units(path, node))
    raise TypeError(
        f"{keyword} must be a module type, a tuple of them, or a function (path, module) -> bool; "
        f"got {units!r}."
    )


def find_units(
    model: nnx.Module, units: UnitsSpec, reshard_after_forward: bool, prefetch: bool = False
) -> list[KeyPath]:
    """The paths of the submodules ``units`` matches (none for ``units=None``).

    Raises:
      TypeError: If ``units`` is not a type, a tuple of types or a predicate, or
        ``reshard_after_forward`` or ``prefetch`` not a bool.
      ValueError: If ``units`` matches no submodule (naming the model's module types), a unit
        lies inside another (naming both), or is the model itself; if ``prefetch`` comes
        without ``units`` or with ``reshard_after_forward=False``.
    """
    for name, flag in (("reshard_after_forward", reshard_after_forward), ("prefetch", prefetch)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False; got {flag!r}.")
    if prefetch and units is None:
        raise ValueError(
            "prefetch=True gathers the next layer of a stacked FSDP unit while one layer runs; "
            "name the stacked block with units= (and run it with substrax.nn.scan_layers)."
        )
    if prefetch and not reshard_after_forward:
        raise ValueError(
            "prefetch=True gathers each layer again, one ahead, for the backward pass; "
            "reshard_after_forward=False would keep every layer of the stack gathered instead. "
            "Pass one or the other."
        )
    found = matched_modules(model, units, "units") if units is not None else []
    found.sort(key=len)
    for i, inner in enumerate(found):
        for outer in found[:i]:
            if inner[: len(outer)] == outer:
                raise ValueError(
                    f"units= matched {path_str(inner, 'model')} inside {path_str(outer, 'model')}; units "
                    f"may not nest. Name only the outer modules (or only the inner ones)."
                )
    return found


def matched_modules(model: nnx.Module, spec: UnitsSpec, keyword: str) -> list[KeyPath]:
    """The paths of the submodules ``spec`` (``units=`` or ``stages=``) matches, in graph order.

    Raises:
      TypeError: If ``spec`` is not a type, a tuple of types or a predicate.
      ValueError: If it matches no submodule (naming the model's module types), or the model itself.
    """
    match = _matcher(spec, keyword)
    found: list[KeyPath] = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and match(tuple(path), node):
            if not path:
                root = " Parameters outside every unit are gathered as the root unit already." * (
                    keyword == "units"
                )
                raise ValueError(
                    f"{keyword}= matched the model itself; name a submodule (a block, a layer).{root}"
                )
            found.append(tuple(path))
    if not found:
        raise ValueError(_matched_nothing(model, spec, keyword))
    return found


def _matched_nothing(model: nnx.Module, units: UnitsSpec, keyword: str = "units") -> str:
    """Why ``units`` (or ``stages``) was refused: what was asked, and the module types the model has."""
    if isinstance(units, tuple):
        asked = "(" + ", ".join(u.__name__ for u in units) + ("," if len(units) == 1 else "") + ")"
    else:
        asked = getattr(units, "__qualname__", repr(units))
    kinds = sorted({type(node).__name__ for path, node in nnx.iter_graph(model)
                    if path and isinstance(node, nnx.Module)})  # fmt: skip
    has = (
        f"Its submodules are of the types {', '.join(kinds)}: name one ({keyword}={kinds[0]}), a tuple of "
        f"them, or a function (path, module) -> bool that holds for some, or drop {keyword}="
        if kinds
        else f"It has no submodule: drop {keyword}="
    )
    what = "gathered as a unit (plain FSDP)" if keyword == "units" else "split over the stages (no pipeline)"
    return (
        f"{keyword}={asked} matched no submodule of the {type(model).__name__}, so no parameter would be "
        f"{what}. {has}."
    )


def stacked_modules(model: nnx.Module, units: list[KeyPath]) -> set[KeyPath]:
    """The modules that read as stacks of layers (``nnx.vmap``): each unit, and each module
    holding two or more parameters itself, whose parameters all have two or more dimensions
    and share the first, the layer axis, which FSDP leaves whole.

    (One layer has a bias or a norm's scale of one dimension, or parameters whose first
    dimensions differ. A module that only reads as a stack, such as two square kernels,
    is split on another dimension: the same memory.)
    """
    owners: dict[KeyPath, list[tuple[int, ...]]] = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        owners.setdefault(tuple(path)[:-1], []).append(np.shape(variable.get_value()))
    candidates = {p: s for p, s in owners.items() if len(s) >= 2}
    for unit in units:
        candidates[unit] = [
            np.shape(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(node_at(model, unit), nnx.Param))
        ]
    return {p for p, shapes in candidates.items()
            if shapes and all(len(s) >= 2 for s in shapes) and len({s[0] for s in shapes}) == 1}  # fmt: skip


def mark_units(
    model: nnx.Module,
    found: list[KeyPath],
    reshard_after_forward: bool,
    split: set[KeyPath],
    prefetch: bool = False,
) -> None:
    """Write on each split parameter its unit (one of ``found``), or clear it outside every unit.

    ``split``: the paths of the parameters the layout splits (only those are gathered).
    """
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        owner = next((u for u in found if tuple(path)[: len(u)] == u), None) if tuple(path) in split else None
        if owner is not None:
            variable.set_metadata(
                **{UNIT_KEY: owner, RESHARD_KEY: reshard_after_forward, PREFETCH_KEY: prefetch}
            )
        elif variable.get_metadata().get(UNIT_KEY) is not None:
            variable.set_metadata(**{UNIT_KEY: None, RESHARD_KEY: None, PREFETCH_KEY: None})


def unit_paths(model: nnx.Module) -> dict[KeyPath, bool]:
    """Each unit's path and its ``reshard_after_forward``, read from the parameters' metadata."""
    found: dict[KeyPath, bool] = {}
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        meta = variable.get_metadata()
        if meta.get(UNIT_KEY) is not None:
            found[tuple(meta[UNIT_KEY])] = bool(meta.get(RESHARD_KEY, True))
    return found


def prefetched_units(model: nnx.Module) -> set[KeyPath]:
    """The units placed with ``prefetch=True``, read from the parameters' metadata."""
    return {
        tuple(meta[UNIT_KEY])
        for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if (meta := variable.get_metadata()).get(UNIT_KEY) is not None and meta.get(PREFETCH_KEY)
    }


_LAYERS: contextvars.ContextVar[dict[KeyPath, int] | None] = contextvars.ContextVar(
    "substrax_unit_layers", default=None
)


def recording_layers() -> contextlib.AbstractContextManager[dict[KeyPath, int]]:
    """Collect, while a step is traced, the units run one layer at a time (path -> layers)."""
    return recording_into(_LAYERS, {})


def note_layers(path: KeyPath, layers: int) -> None:
    """Record (inside ``recording_layers``) that the unit at ``path`` ran as ``layers`` calls of one layer."""
    found = _LAYERS.get()
    if found is not None:
        found[path] = layers
