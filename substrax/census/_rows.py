"""The rows of a census: one ``Collective`` per collective instruction, and its ``Part``s (buffers)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from substrax._base import scopes
from substrax.census import _hlo
from substrax.census._hlo import Operand
from substrax.census._text import short_op, shorten

__all__ = ["LIBRARY_SCOPE", "Collective", "Part", "buffers_text", "collectives", "library_scope", "phase_of"]


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program, as one census row.

    Attributes:
      kind: the HLO name without ``-start``/``-done``, e.g. ``"all-reduce"``.
      name: the instruction's name in the HLO, e.g. ``"all-reduce.5"``.
      opcode: the HLO opcode as written, e.g. ``"all-reduce-start"``.
      computation: the HLO computation that holds the instruction.
      operands: the operand buffers (a combined all-reduce or collective-permute has several; an
        in-place permute's input alone).
      results: the result buffers (for ``all-gather-start``, the gathered ones only).
      bytes: per device and execution, as nccl-tests count "size": the operands; an
        all-gather's result; a send's first operand; a recv's buffer.
      replica_groups: the replica groups as the HLO writes them (``""`` when absent).
      groups: the device groups as logical device ids, or ``None`` when not readable.
      axes: the mesh axes the groups span (from ``mesh=``, else the HLO's names), or ``None``.
      source_target_pairs: a collective-permute's ``(source, target)`` pairs.
      shift: a collective-permute's step along the one mesh axis all its pairs move on
        (``+1``: each device sends to the next along ``axes``, ``-1``: to the previous);
        ``None`` when they move otherwise (a wrap-around) or the mesh is not known.
      trip_counts: the trip count of each ``while`` loop around it, outermost first
        (``None`` where not stated); ``()`` outside loops.
      op_name: the JAX operation it came from (all of them for a combined one), or ``""``.
      buffer_op_names: the JAX operation of each buffer of ``parts``, in order.
      crosses: for a send or recv the TPU runtime runs between slices, the collective it carries
        (``"all-reduce"``: one part of an all-reduce across the slices), else ``""``.
      rendezvous: the name that pairs such a send with its recv, else ``""``.
      fed_by: the instruction whose result it moves (its first operand, read through bitcasts,
        copies and tuple elements), ``""`` when that operand is computed: what links an
        all-reduce across slices to the collectives over the slice's own chips around it.
      unpadded: the bytes its buffer held before the TPU compiler padded it to whole tiles for
        it (an all-reduce or send across slices of buffers it combined), ``None`` when not padded.
    """

    kind: str
    name: str
    opcode: str
    computation: str
    operands: tuple[Operand, ...]
    results: tuple[Operand, ...]
    bytes: int
    replica_groups: str = ""
    groups: tuple[tuple[int, ...], ...] | None = None
    axes: tuple[str, ...] | None = None
    source_target_pairs: tuple[tuple[int, int], ...] | None = None
    shift: int | None = None
    trip_counts: tuple[int | None, ...] = ()
    op_name: str = ""
    buffer_op_names: tuple[str, ...] = ()
    crosses: str = ""
    rendezvous: str = ""
    fed_by: str = ""
    unpadded: int | None = None

    @property
    def parts(self) -> tuple[Part, ...]:
        """Its buffers one by one, each with its own operation and bytes (they sum to ``bytes``).

        An all-gather's parts are its gathered results; a send's and a recv's the one buffer
        ``bytes`` counts; the others' their operands.
        """
        buffers = _part_buffers(self)
        if len(buffers) <= 1:
            return (Part(self, 0, buffers[0] if buffers else Operand("?", ()), self.op_name, self.bytes),)
        names = (
            self.buffer_op_names
            if len(self.buffer_op_names) == len(buffers)
            else (self.op_name,) * len(buffers)
        )
        return tuple(
            Part(self, i, b, n, b.bytes) for i, (b, n) in enumerate(zip(buffers, names, strict=True))
        )

    @property
    def in_loop(self) -> bool:
        """Whether it sits inside a ``while`` body (or a computation one calls)."""
        return bool(self.trip_counts)

    @property
    def trip_count(self) -> int | None:
        """Its executions per step inside loops (the product of their trip counts).

        ``None`` outside loops, or when a loop around it does not state its trip count.
        """
        if not self.trip_counts or any(n is None for n in self.trip_counts):
            return None
        return math.prod(n for n in self.trip_counts if n is not None)

    @property
    def executions(self) -> int | None:
        """Times it runs per execution of the program: 1 outside loops, ``None`` if unknown."""
        return self.trip_count if self.trip_counts else 1

    @property
    def bytes_per_step(self) -> int:
        """``bytes`` times its executions; a loop of unknown trip count counted once
        (``CensusReport.uncounted`` lists those rows; the report's ``str()`` names them)."""
        return self.bytes * (self.executions or 1)

    @property
    def dtype(self) -> str:
        """The element type of its buffers; several joined by ``","`` when they differ."""
        buffers = self.results if self.kind == "all-gather" else self.operands
        return ",".join(sorted({b.dtype for b in buffers})) or "?"

    @property
    def group_size(self) -> int | None:
        """Devices in each replica group, ``None`` when the groups are unknown."""
        return len(self.groups[0]) if self.groups else None


LIBRARY_SCOPE = re.compile(r"\b" + re.escape(scopes.PREFIX) + r"[A-Za-z_][\w]*")
"""A ``jax.named_scope`` of the library's steps in an operation's name, e.g. ``substrax.grad_reduce``."""

_BACKWARD = re.compile(r"(?:^|[/(])transpose\(")
_FORWARD = re.compile(r"(?:^|[/(])(?:jvp|vjp|linearize)\(")


def library_scope(op_name: str) -> str | None:
    """The library scope an operation ran under (``"substrax.loss"``, ...), ``None`` outside them."""
    match = LIBRARY_SCOPE.search(op_name)
    return match[0] if match else None


def phase_of(op_name: str) -> str | None:
    """``"backward"`` for an operation of a gradient's transpose, ``"forward"`` for one
    differentiated (under ``jvp``), ``None`` for one outside the differentiated function."""
    if _BACKWARD.search(op_name):
        return "backward"
    if _FORWARD.search(op_name):
        return "forward"
    return None


@dataclass(frozen=True)
class Part:
    """One buffer of a collective: what ``compare`` matches against one expected buffer.

    Attributes:
      row: the collective it belongs to.
      index: its position among the collective's buffers.
      buffer: its element type and shape.
      op_name: the JAX operation it came from (its own, in a combined collective).
      bytes: its bytes per execution, counted as ``Collective.bytes`` counts them.
    """

    row: Collective
    index: int
    buffer: Operand
    op_name: str
    bytes: int

    @property
    def kind(self) -> str:
        return self.row.kind

    @property
    def bytes_per_step(self) -> int:
        """``bytes`` times the collective's executions per step."""
        return self.bytes * (self.row.executions or 1)

    @property
    def scope(self) -> str | None:
        """``library_scope(op_name)``."""
        return library_scope(self.op_name)

    @property
    def phase(self) -> str | None:
        """``phase_of(op_name)``: where in the differentiated computation it ran, if there."""
        return phase_of(self.op_name)

    def __str__(self) -> str:
        where = f" from {short_op(self.op_name)}" if self.op_name else ""
        times = self.row.trip_count
        runs = (
            f", {times if times is not None else 'an unstated number of'} times per step"
            if self.row.in_loop
            else ""
        )
        return f"{self.buffer} ({self.bytes:,} B) of {self.kind} {self.row.name}{where}{runs}"


def _part_buffers(row: Collective) -> tuple[Operand, ...]:
    if row.kind == "all-gather" or row.kind == "recv":
        return row.results
    if row.kind in ("send", "ragged-all-to-all"):
        return (row.operands or row.results)[:1]
    return row.operands or row.results  # a collective-permute's: several where XLA combined them


def collectives(module: _hlo.Module, mesh: tuple[tuple[str, int], ...] | None) -> tuple[Collective, ...]:
    """One row per collective instruction of ``module``, in program order; ``mesh``: ``(axis, size)``
    pairs."""
    local, across = _slices(module, mesh)
    rows = tuple(_row(site, module, local) for site in _hlo.collective_sites(module))
    if not across:
        return rows
    # one slice's program: its send/recv pairs carry what crosses the slices (measured, libtpu 0.0.52)
    cross = ("send", "recv")
    return tuple(
        dataclasses.replace(r, axes=across) if r.kind in cross and r.axes is None else r for r in rows
    )


def _slices(
    module: _hlo.Module, mesh: tuple[tuple[str, int], ...] | None
) -> tuple[tuple[tuple[str, int], ...] | None, tuple[str, ...]]:
    """``(in-slice axes, axes across slices)`` when ``module`` is one slice's program of ``mesh``.

    The TPU compiler compiles a multi-slice mesh per slice: its device ids are one slice's,
    the trailing axes of a mesh whose leading ones cross the slices (``topology_mesh``).
    Else ``(mesh, ())``.
    """
    n = module.num_devices
    if mesh is None or not n or math.prod(s for _, s in mesh) <= n:
        return mesh, ()
    for k in range(len(mesh)):
        if math.prod(s for _, s in mesh[k:]) == n:
            return mesh[k:], tuple(a for a, s in mesh[:k] if s > 1)
    return mesh, ()


def _row(site: _hlo.Site, module: _hlo.Module, mesh: tuple[tuple[str, int], ...] | None) -> Collective:
    kind, instruction, computation = site.kind, site.instruction, site.computation
    operands = _hlo.operand_buffers(instruction, computation, module)
    if kind == "collective-permute" and "slice_sizes=" in instruction.attrs:
        operands = operands[:1]  # in place: (input, output, offsets...): the input is what moves
    results = _hlo.result_buffers(kind, instruction, operands)
    raw, groups, hlo_axes = _hlo.replica_groups(instruction.attrs, module.num_devices)
    pairs = _hlo.source_target_pairs(instruction.attrs)
    name = _hlo.op_name(instruction.attrs)
    crosses, rendezvous = _hlo.crossing(instruction.attrs) if kind in ("send", "recv") else ("", "")
    row = Collective(
        kind=kind,
        name=instruction.name,
        opcode=instruction.opcode,
        computation=computation.name,
        operands=operands,
        results=results,
        bytes=_buffer_bytes(kind, operands, results),
        replica_groups=raw,
        groups=groups,
        axes=_hlo.mesh_axes(groups, pairs, hlo_axes, mesh),
        source_target_pairs=pairs,
        shift=_hlo.pair_shift(pairs, mesh),
        trip_counts=site.trip_counts,
        op_name=name,
        crosses=crosses,
        rendezvous=rendezvous,
        fed_by=_hlo.source_of(instruction, computation),
        unpadded=_hlo.unpadded(instruction, computation) if kind in ("all-reduce", "send") else None,
    )
    count = len(_part_buffers(row))
    if count <= 1:
        return row
    return dataclasses.replace(
        row, buffer_op_names=_hlo.buffer_op_names(instruction, computation, name, count)
    )


def _buffer_bytes(kind: str, operands: tuple[Operand, ...], results: tuple[Operand, ...]) -> int:
    if kind in ("all-gather", "recv"):
        return sum(b.bytes for b in results)
    if kind in ("send", "ragged-all-to-all"):
        return operands[0].bytes if operands else sum(b.bytes for b in results[:1])
    if not operands and kind in ("all-reduce", "all-to-all", "collective-broadcast"):
        return sum(b.bytes for b in results)  # same sizes in and out
    return sum(b.bytes for b in operands)


def buffers_text(row: Collective) -> str:
    """A collective's buffers as the census table writes them (at most three named)."""
    buffers = row.results if row.kind == "all-gather" else row.operands
    return shorten([str(b) for b in buffers], 3)
