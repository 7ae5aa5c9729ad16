"""The census's two answers: ``census`` gives a ``CensusReport``, ``compare`` a ``Comparison``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax

from substrax.census import _hlo
from substrax.census._expected import Expected, ExpectedCollective, sources_of
from substrax.census._hlo import KINDS
from substrax.census._match import kind_key, match, ordered_keys
from substrax.census._rows import Collective, Part, buffers_text, collectives
from substrax.census._text import table

__all__ = ["CensusReport", "Comparison", "KindTotal", "census", "compare"]


@dataclass(frozen=True)
class KindTotal:
    """The collectives of one kind in a census, summed.

    Attributes:
      kind: the HLO name, e.g. ``"all-reduce"``.
      count: the instructions (XLA combines several reductions into one).
      bytes: the sum of their ``bytes``, one execution each.
      bytes_per_step: the sum of their ``bytes_per_step``.
    """

    kind: str
    count: int
    bytes: int
    bytes_per_step: int


@dataclass(frozen=True)
class CensusReport:
    """Every collective of a compiled program, in program order.

    Attributes:
      rows: one ``Collective`` per collective instruction (one per call site of the
        computation holding it).
      module: the HLO module's name.
    """

    rows: tuple[Collective, ...]
    module: str = ""

    def _select(self, kind: str | None) -> list[Collective]:
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; known kinds are {KINDS}")
        return [r for r in self.rows if kind is None or r.kind == kind]

    def count(self, kind: str | None = None) -> int:
        """The number of collective instructions of ``kind`` (all kinds when ``None``)."""
        return len(self._select(kind))

    def bytes(self, kind: str | None = None) -> int:
        """The sum of ``bytes`` of the rows of ``kind``, each counted once."""
        return sum(r.bytes for r in self._select(kind))

    def bytes_per_step(self, kind: str | None = None) -> int:
        """The sum of ``bytes_per_step`` of the rows of ``kind`` (loops multiplied out)."""
        return sum(r.bytes_per_step for r in self._select(kind))

    def in_loop(self, kind: str | None = None) -> tuple[Collective, ...]:
        """The rows of ``kind`` that sit inside a ``while`` loop."""
        return tuple(r for r in self._select(kind) if r.in_loop)

    def uncounted(self, kind: str | None = None) -> tuple[Collective, ...]:
        """The rows of ``kind`` inside a loop whose trip count the program shows nowhere: each is
        counted once in ``bytes_per_step``, a lower bound (``str()`` says so)."""
        return tuple(r for r in self._select(kind) if r.executions is None)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds present, in the order of ``KINDS``."""
        present = {r.kind for r in self.rows}
        return tuple(k for k in KINDS if k in present)

    def totals(self) -> dict[str, KindTotal]:
        """One ``KindTotal`` per kind present."""
        return {k: KindTotal(k, self.count(k), self.bytes(k), self.bytes_per_step(k)) for k in self.kinds}

    def check(self, expected: Expected) -> Comparison:
        """``compare(self, expected)``."""
        return compare(self, expected)

    def __str__(self) -> str:
        return _format_report(self)


# ---------------------------------------------------------------------------------------
# census
# ---------------------------------------------------------------------------------------


def census(
    compiled: jax.stages.Compiled | jax.stages.Lowered | str,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | Mapping[str, int] | None = None,
) -> CensusReport:
    """Count and size every collective of a compiled program.

    Args:
      compiled: a ``jax.stages.Compiled``, a ``jax.stages.Lowered`` (compiled here), either
        of ``nnx.jit``'s, or the text of an optimized HLO module (unoptimized text has no
        collectives yet).
      mesh: optional; the mesh (or ``{axis name: size}``), to name each collective's axes.

    Returns:
      A ``CensusReport`` with one row per collective instruction.
    """
    module = _hlo.parse_module(_hlo_text(compiled))
    return CensusReport(rows=collectives(module, _mesh_shape(mesh)), module=module.name)


def _hlo_text(compiled: Any) -> str:
    if isinstance(compiled, str):
        return compiled
    for stage in ("compiled", "lowered"):  # nnx.jit's stages hold jax's
        inner = getattr(compiled, stage, None)
        if isinstance(inner, (jax.stages.Compiled, jax.stages.Lowered)):
            compiled = inner
    if isinstance(compiled, jax.stages.Lowered):
        compiled = compiled.compile()
    if isinstance(compiled, jax.stages.Compiled):
        text = compiled.as_text()
        if not text:
            raise ValueError("census: this Compiled object has no HLO text (as_text() returned nothing)")
        return text
    raise TypeError(
        f"census takes a jax.stages.Compiled, a jax.stages.Lowered or HLO text, not {type(compiled).__name__}"
    )


def _mesh_shape(mesh: Any) -> tuple[tuple[str, int], ...] | None:
    if mesh is None:
        return None
    shape = mesh.shape if hasattr(mesh, "shape") else mesh
    if not isinstance(shape, Mapping):
        raise TypeError(f"census: mesh= takes a jax Mesh or a mapping of axis names to sizes, not {mesh!r}")
    return tuple((str(k), int(v)) for k, v in shape.items())


# ---------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """A census held against the expected communication; unpacks as ``matches, differences``.

    Attributes:
      matches: whether the compiled program communicates as expected.
      differences: one sentence per difference, naming the buffers involved.
      notes: what was accepted and why (optional buffers absent, combined buffers, ...).
      report: the census.
      expected: the expected communication, with the model's own buffers (``"model"``) added.
      matched: each expected buffer with the compiled buffers matched to it.
      model: the compiled buffers attributed to the model's own forward or backward pass.
      unexpected: the compiled buffers nothing accounts for.
    """

    matches: bool
    differences: tuple[str, ...]
    notes: tuple[str, ...]
    report: CensusReport
    expected: Expected
    matched: tuple[tuple[ExpectedCollective, tuple[Part, ...]], ...] = ()
    model: tuple[Part, ...] = ()
    unexpected: tuple[Part, ...] = ()

    def __iter__(self) -> Iterator[Any]:
        return iter((self.matches, list(self.differences)))

    def __str__(self) -> str:
        return _format_comparison(self)


def compare(report: CensusReport, expected: Expected, *, attribute_model: bool = False) -> Comparison:
    """Hold a census against the expected communication of a step (see the census guide, "The rule").

    Args:
      report: a census (``census(compiled)``).
      expected: ``expected_communication(...)`` for the step.
      attribute_model: count the model's own collectives (as
        ``TrainStep.check_communication`` does); ``False`` makes every unmatched buffer a
        difference.

    Returns:
      A ``Comparison``; ``str()`` of it shows the census, expected against compiled
      bytes per source and kind, the model's buffers, and each difference.
    """
    found = match(report.rows, expected, attribute_model=attribute_model)
    return Comparison(
        matches=found.matches,
        differences=found.differences,
        notes=found.notes,
        report=report,
        expected=found.expected,
        matched=found.matched,
        model=found.model,
        unexpected=found.unexpected,
    )


# ---------------------------------------------------------------------------------------
# str()
# ---------------------------------------------------------------------------------------


def _format_report(report: CensusReport) -> str:
    if not report.rows:
        return "census: no collectives"
    total = report.bytes_per_step()
    head = f"census: {report.count()} collective(s), {total:,} B per device per step"
    uncounted = report.uncounted()
    if uncounted:  # never counted once in silence
        head += (
            f"\n  at least: {len(uncounted)} of them inside loops whose trip count the program does "
            f"not show, each counted once ({', '.join(r.name for r in uncounted)})"
        )
    rows = [("#", "kind", "instruction", "axes", "buffers", "bytes", "runs")]
    for i, row in enumerate(report.rows):
        rows.append(
            (str(i), row.kind, row.name, _axes_text(row), buffers_text(row), f"{row.bytes:,}", _runs(row))
        )
    totals = [("totals", "count", "bytes", "bytes/step")]
    for t in report.totals().values():
        totals.append((t.kind, str(t.count), f"{t.bytes:,}", f"{t.bytes_per_step:,}"))
    return "\n".join([head, *table(rows, right={0, 5}), *table(totals, right={1, 2, 3})])


def _axes_text(row: Collective) -> str:
    if row.axes is not None:
        return ",".join(row.axes) or "-"
    if row.groups is not None:
        return f"{len(row.groups)}x{row.group_size} groups"
    if row.source_target_pairs is not None:
        return f"{len(row.source_target_pairs)} pairs"
    return row.replica_groups or "?"


def _runs(row: Collective) -> str:
    if not row.in_loop:
        return "once"
    return f"loop x{row.trip_count}" if row.trip_count is not None else "loop x? (counted once)"


def _format_comparison(comparison: Comparison) -> str:
    expected = comparison.expected
    mode = expected.mode
    verdict = "matches" if comparison.matches else "does NOT match"
    head = (
        f"{verdict} the expected communication of {expected.layout} ({mode}, "
        f"{expected.microbatches} microbatch(es)), bytes per device per step:"
    )
    rows: dict[tuple[str, str], list[int]] = {}  # (source, kind) -> [expected, optional, compiled]
    seen: set[int] = set()
    for item, parts in comparison.matched:
        crossing = any(p.row.crosses and p.kind == "send" for p in parts)  # across slices: what each sends
        key = kind_key(item.kind, mode) + (" across slices" if crossing else "")
        cell = rows.setdefault((item.category, key), [0, 0, 0])
        cell[1 if item.optional else 0] += item.bytes
        for p in parts:
            if id(p) not in seen and (not crossing or (p.row.crosses and p.kind == "send")):
                seen.add(id(p))
                cell[2] += p.bytes_per_step
    for p in comparison.unexpected:
        rows.setdefault(("not expected", kind_key(p.kind, mode)), [0, 0, 0])[2] += p.bytes_per_step
    sources = [*sources_of([i for i, _ in comparison.matched]), "not expected"]
    cells = [("source", "kind", "expected", "optional", "compiled")]
    for source in sources:
        for key in ordered_keys({k for s, k in rows if s == source}):
            want, optional, got = rows[source, key]
            cells.append((source, key, f"{want:,}", f"{optional:,}" if optional else "", f"{got:,}"))
    lines = [str(comparison.report), head, *table(cells, right={2, 3, 4})]
    declared = {  # a model buffer a layer declared: named by its layer and phase
        id(p): f"{i.what}: "
        for i, parts in comparison.matched
        if i.category == "model" and i.phase
        for p in parts
    }
    lines += [f"  model: {declared.get(id(p), '')}{p}" for p in comparison.model]
    lines += [f"  difference: {d}" for d in comparison.differences]
    lines += [f"  note: {n}" for n in comparison.notes]
    return "\n".join(lines)
