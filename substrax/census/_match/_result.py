"""What ``match`` found: the assignment (``_assign``) with its differences and notes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from substrax.census._expected import Expected, ExpectedCollective
from substrax.census._match._assign import Assignment
from substrax.census._match._differences import (
    bound_applies,
    bound_note,
    kind_differences,
    loop_differences,
    rewrite_differences,
)
from substrax.census._rows import Collective, Part
from substrax.census._text import shorten

__all__ = ["Match", "match"]


@dataclass(frozen=True)
class Match:
    """What ``match`` found; ``substrax.census.Comparison`` describes each field."""

    matches: bool
    differences: tuple[str, ...]
    notes: tuple[str, ...]
    expected: Expected
    matched: tuple[tuple[ExpectedCollective, tuple[Part, ...]], ...]
    model: tuple[Part, ...]
    unexpected: tuple[Part, ...]


def match(rows: Sequence[Collective], expected: Expected, *, attribute_model: bool = False) -> Match:
    """Match the buffers of ``rows`` (a census's, in program order) to ``expected``'s."""
    a = Assignment(rows, expected, attribute_model)
    differences = loop_differences(a)
    loops = bool(differences)
    differences += rewrite_differences(a) + kind_differences(a)
    notes = list(a.notes) + _layer_notes(a) + _uncounted_notes(a)
    for i, item in enumerate(a.items):
        if item.optional and i not in a.assigned:
            notes.append(f"not compiled, optional: {item}" + (f": {item.why}" if item.why else ""))
    if differences and not loops and bound_applies(a):
        notes.append(bound_note(a))
        differences = []
    return _found(a, differences, notes)


def _found(a: Assignment, differences: list[str], notes: list[str]) -> Match:
    """The ``Match`` of ``a``: each item with its buffers, the model's own buffers taken as expected."""
    parts = a.parts
    model_items = [
        ExpectedCollective(
            parts[j].kind,
            f"model: {parts[j].op_name or parts[j].row.name}",
            parts[j].bytes_per_step,
            "model",
            buffer=str(parts[j].buffer),
        )
        for j in a.model
    ]
    matched = tuple((item, tuple(parts[j] for j in a.assigned.get(i, ()))) for i, item in enumerate(a.items))
    matched += tuple((m, (parts[j],)) for m, j in zip(model_items, a.model, strict=True))
    declared = [j for i, js in a.assigned.items() if a.items[i].category == "model" for j in js]
    return Match(
        matches=not differences,
        differences=tuple(differences),
        notes=tuple(notes),
        expected=a.expected.with_items(model_items) if model_items else a.expected,
        matched=matched,
        model=tuple(parts[j] for j in sorted({*declared, *a.model})),
        unexpected=tuple(parts[j] for j in a.unexpected),
    )


def _uncounted_notes(a: Assignment) -> list[str]:
    """The model's own buffers inside a loop whose trip count the program does not show."""
    parts = [a.parts[j] for j in a.model if a.parts[j].row.executions is None]
    if not parts:
        return []
    return [
        f"the model's own {shorten([str(p) for p in parts], 4)}: inside a loop whose trip count the "
        f"program does not show, counted once (its bytes per step not known)"
    ]


def _layer_notes(a: Assignment) -> list[str]:
    """What was matched one layer per iteration, and which matches the program leaves open."""
    notes = []
    for source, verb in (("gradients", "reduced"), ("parameters", "gathered")):
        layered = [i for i in a.layered if a.items[i].category == source]
        if not layered:
            continue
        loops = sorted({a.layered[i] for i in layered})
        names = shorten([a.items[i].what for i in layered], 4)
        notes.append(
            f"implicit mode: XLA {verb} {len(layered)} stacked parameter(s) one layer per iteration, "
            f"inside a loop of {' or '.join(map(str, loops))} (a scanned stack): {names}; each one "
            f"layer's buffer per iteration, its bytes per step the rule's: accepted"
        )
    return notes + _shared_shape_notes(a)


def _shared_shape_notes(a: Assignment) -> list[str]:
    """Parameters of one shape matched by shape alone: which buffer is whose the program does not say."""
    shared: dict[tuple[int, ...], dict[str, None]] = {}  # parameters matched by a shape they share
    kinds: dict[tuple[int, ...], dict[str, None]] = {}
    for i, js in a.assigned.items():
        item = a.items[i]
        if a.shape_bound(item) and len(js) == 1:
            part = a.parts[js[0]]
            dims = tuple(sorted(d for d in part.buffer.shape if d != 1))
            shared.setdefault(dims, {})[item.what] = None
            kinds.setdefault(dims, {})[part.kind] = None
    notes = []
    for dims, whats in shared.items():
        if len(whats) > 1:
            shape = "x".join(map(str, dims)) or "scalar"
            notes.append(
                f"{shorten(list(whats), 4)} have buffers of one shape ({shape}), matched to "
                f"{' and '.join(kinds[dims])} buffers of that shape by shape alone: which buffer is "
                f"which parameter's the program does not say"
            )
    return notes
