"""A communication census: every collective of a compiled program, counted and sized.

``census(compiled)`` reads the optimized HLO of a ``jax.stages.Compiled`` (or HLO text)
and returns a ``CensusReport``: one ``Collective`` row per collective instruction the
compiler emitted (``all-reduce``, ``all-gather``, ``reduce-scatter``,
``collective-permute``, ``all-to-all`` and the rarer ones; an asynchronous
``-start``/``-done`` pair is one row), with the replica groups (and mesh axes) it spans,
the element types and shapes of its buffers, the bytes it moves and whether it runs
inside a ``while`` loop.

Bytes are counted as nccl-tests count "size": the full buffer per device and per
execution -- an all-reduce's operands, an all-gather's result, a reduce-scatter's
operand, an all-to-all's or collective-permute's operand. They are the buffer sizes, not
the bytes on the wire (a ring all-reduce of ``S`` bytes over ``n`` devices sends
``2 S (n - 1) / n``). Bytes per step multiply a row's bytes by the trip counts of the
loops around it, when the compiler states them.

Each row also comes apart into ``parts``, one per buffer, each with the JAX operation it
came from: XLA combines several all-reduces into one instruction, but the
``get-tuple-element`` that takes each result back out keeps its own operation's metadata.
That name carries the ``jax.named_scope`` it ran under (the library's steps write theirs:
``substrax.grad_reduce``, ``substrax.gather_params``, ``substrax.loss``,
``substrax.metrics``, ``substrax.batch_stats``, ``substrax.update``, ``substrax.finite``)
and the transformation around it (``jvp(...)``: the forward pass of a gradient;
``transpose(jvp(...))``: its backward pass).

``expected_communication`` states what a data-parallel step of a given layout should
communicate, and ``compare`` (or ``CensusReport.check``) holds a census against it,
buffer by buffer; see ``compare`` for the rule.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from substrax._layout import LAYOUTS

__all__ = [
    "KINDS",
    "LAYOUTS",
    "SOURCES",
    "CensusReport",
    "Collective",
    "Comparison",
    "Expected",
    "ExpectedCollective",
    "Operand",
    "Part",
    "census",
    "compare",
    "expected_communication",
    "library_scope",
    "phase_of",
]

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "ragged-all-to-all",
    "collective-broadcast",
    "send",
    "recv",
)
"""The HLO collectives a census counts, by their names without ``-start``/``-done``."""

# The layouts ``expected_communication`` knows: those of ``substrax.shard_state``.

_MODES = ("implicit", "explicit")
_REDUCTIONS = ("all-reduce", "reduce-scatter")
_REDUCTION_KEY = "all-reduce + reduce-scatter"

_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}

# ---------------------------------------------------------------------------------------
# rows and reports
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Operand:
    """One array buffer of a collective: HLO element type and shape.

    Attributes:
      dtype: the HLO element type, e.g. ``"f32"`` or ``"bf16"``.
      shape: the dimensions, ``()`` for a scalar.
    """

    dtype: str
    shape: tuple[int, ...]

    @property
    def bytes(self) -> int:
        """The buffer's size in bytes."""
        return math.ceil(math.prod(self.shape) * _bits(self.dtype) / 8)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program, as one census row.

    Attributes:
      kind: the HLO name without ``-start``/``-done``, e.g. ``"all-reduce"``.
      name: the instruction's name in the HLO, e.g. ``"all-reduce.5"``.
      opcode: the HLO opcode as written, e.g. ``"all-reduce-start"``.
      computation: the HLO computation that holds the instruction.
      operands: the operand buffers (a combined all-reduce has several).
      results: the result buffers (for ``all-gather-start``, the gathered ones only).
      bytes: the buffer it works on, per device and per execution, as nccl-tests count
        "size": all-reduce, reduce-scatter, all-to-all, collective-broadcast: the operands;
        all-gather: the result; collective-permute, send: the first operand; recv: the
        received buffer.
      replica_groups: the replica groups as the HLO writes them (``""`` when absent).
      groups: the device groups, as logical device ids (positions in the mesh), or
        ``None`` when the HLO does not give them in a form read here.
      axes: the mesh axes the groups span, or ``None`` when unknown. Named from ``mesh=``
        when it was given and the groups match some of its axes; otherwise the names the
        HLO uses (``shard_map`` writes the mesh's names, the sharding propagation of
        ``jax.jit`` writes ``axis_0``, ...).
      source_target_pairs: a collective-permute's ``(source, target)`` pairs.
      trip_counts: the trip count of each ``while`` loop around it, outermost first;
        ``None`` where the compiler does not state it; ``()`` outside loops.
      op_name: the JAX operation it came from (the HLO metadata), ``""`` when absent. A
        collective XLA combined from several writes them all, e.g.
        ``"jit(step)/shard_map/(substrax.grad_reduce/psum:jvp(substrax.loss)/psum)"``.
      buffer_op_names: the JAX operation of each buffer of ``parts``, in order: for a
        combined collective, read from the ``get-tuple-element`` instructions that take
        its results apart (each keeps its own operation's metadata).
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
    trip_counts: tuple[int | None, ...] = ()
    op_name: str = ""
    buffer_op_names: tuple[str, ...] = ()

    @property
    def parts(self) -> tuple[Part, ...]:
        """Its buffers one by one, each with its own operation and bytes (they sum to ``bytes``).

        An all-gather's parts are its gathered results; a collective-permute's, a send's
        and a recv's the one buffer ``bytes`` counts; the others' their operands.
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
        """``bytes`` times its executions (a loop of unknown trip count counted once)."""
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


LIBRARY_SCOPE = re.compile(r"\bsubstrax\.[A-Za-z_][\w]*")
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
        where = f" from {self.op_name}" if self.op_name else ""
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
    if row.kind in ("collective-permute", "send", "ragged-all-to-all"):
        return (row.operands or row.results)[:1]
    return row.operands or row.results


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
      compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(*args).compile()``), a
        ``jax.stages.Lowered`` (compiled here), or the text of an optimized HLO module
        (``compiled.as_text()``). Unoptimized text has no collectives to count yet.
      mesh: optional; the mesh (or ``{axis name: size}``) the program runs on, to name
        the axes each collective spans from its replica groups.

    Returns:
      A ``CensusReport`` with one row per collective instruction.
    """
    text = _hlo_text(compiled)
    module = _parse_module(text)
    shape = _mesh_shape(mesh)
    rows: list[Collective] = []
    _walk(module, module.entry, (), shape, rows, depth=0)
    return CensusReport(rows=tuple(rows), module=module.name)


def _hlo_text(compiled: Any) -> str:
    if isinstance(compiled, str):
        return compiled
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
# HLO text
# ---------------------------------------------------------------------------------------


@dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


@dataclass
class _Computation:
    name: str
    instructions: list[_Instruction] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)
    pieces: dict[str, dict[int, str]] = field(default_factory=dict)  # tuple -> {index: op_name of its gte}
    done: dict[str, str] = field(default_factory=dict)  # an async -start -> its -done


@dataclass
class _Module:
    name: str
    entry: str
    computations: dict[str, _Computation]
    num_devices: int | None


_COMMENT = re.compile(r"/\*.*?\*/")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s({]+)")
_OPCODE = re.compile(r"(?P<opcode>[a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_OPEN = {"(": ")", "[": "]", "{": "}"}


def _parse_module(text: str) -> _Module:
    name, num_devices = "", None
    computations: dict[str, _Computation] = {}
    entry = ""
    current: _Computation | None = None
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw).rstrip()
        if line.startswith("HloModule"):
            name, num_devices = _module_header(line)
        elif current is None and line.endswith("{") and not line[:1].isspace():
            header = _HEADER.match(line)
            if header:
                current = _Computation(header["name"])
                computations[current.name] = current
                if header["entry"]:
                    entry = current.name
        elif current is not None and line == "}":
            current = None
        elif current is not None:
            instruction = _parse_instruction(line)
            if instruction is not None:
                current.instructions.append(instruction)
                current.shapes[instruction.name] = instruction.shape
                _note_users(current, instruction)
    if not entry:
        raise ValueError(
            "census: no ENTRY computation in this HLO text; pass compiled.as_text() of a program"
        )
    return _Module(name, entry, computations, num_devices)


_INDEX = re.compile(r"\bindex=(\d+)")


def _note_users(computation: _Computation, instruction: _Instruction) -> None:
    """Remember what takes a tuple apart: a ``get-tuple-element``'s index and operation, a ``-done``."""
    if not instruction.operands:
        return
    source = _operand_name(instruction.operands[0])
    if instruction.opcode == "get-tuple-element":
        index, op_name = _INDEX.search(instruction.attrs), _OP_NAME.search(instruction.attrs)
        if index and op_name:
            computation.pieces.setdefault(source, {})[int(index[1])] = op_name[1]
    elif instruction.opcode.endswith("-done"):
        computation.done[source] = instruction.name


def _operand_name(text: str) -> str:
    return text.split()[-1].lstrip("%") if text.split() else ""


def _module_header(line: str) -> tuple[str, int | None]:
    name = line.split()[1].rstrip(",") if len(line.split()) > 1 else ""
    partitions = re.search(r"num_partitions=(\d+)", line)
    replicas = re.search(r"replica_count=(\d+)", line)
    if partitions is None and replicas is None:
        return name, None
    return name, int(partitions[1] if partitions else 1) * int(replicas[1] if replicas else 1)


def _parse_instruction(line: str) -> _Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    rest = match["rest"]
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, tail = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, tail = rest.partition(" ")
    opcode = _OPCODE.match(tail)
    if opcode is None:
        return None
    start = opcode.end() - 1
    end = _closing(tail, start)
    operands = _split_top(tail[start + 1 : end])
    return _Instruction(match["name"], shape, opcode["opcode"], operands, tail[end + 1 :])


def _closing(text: str, start: int) -> int:
    """The index of the bracket that closes ``text[start]`` (the end of text if none)."""
    depth, quoted = 0, False
    for i in range(start, len(text)):
        c = text[i]
        if c == '"' and text[i - 1] != "\\":
            quoted = not quoted
        elif quoted:
            continue
        elif c in _OPEN:
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def _split_top(text: str) -> list[str]:
    parts, depth, begin = [], 0, 0
    for i, c in enumerate(text):
        if c in _OPEN:
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[begin:i].strip())
            begin = i + 1
    last = text[begin:].strip()
    return [*parts, last] if last else parts


def _arrays(shape: str) -> tuple[Operand, ...]:
    return tuple(
        Operand(m["dtype"], tuple(int(d) for d in re.findall(r"\d+", m["dims"])))
        for m in _ARRAY.finditer(shape)
    )


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    small_float = re.match(r"f(\d+)e", dtype)  # f8e4m3fn, f8e5m2, f4e2m1fn, f6e3m2fn, ...
    if small_float:
        return int(small_float[1])
    raise ValueError(f"census: unknown HLO element type {dtype!r}")


# ---------------------------------------------------------------------------------------
# the walk from ENTRY
# ---------------------------------------------------------------------------------------

_CALLS = re.compile(
    r"\b(?P<key>calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(?P<value>\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT = re.compile(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_MAX_DEPTH = 200


def _walk(
    module: _Module,
    name: str,
    trips: tuple[int | None, ...],
    mesh: tuple[tuple[str, int], ...] | None,
    rows: list[Collective],
    depth: int,
) -> None:
    computation = module.computations.get(name)
    if computation is None or depth > _MAX_DEPTH:
        return
    for instruction in computation.instructions:
        kind = _kind(instruction.opcode)
        if kind is not None:
            rows.append(_row(kind, instruction, computation, module, trips, mesh))
        if instruction.opcode.endswith("-done") or instruction.opcode == "async-update":
            continue  # the -start that began it already led to the computation it runs
        for key, callee in _callees(instruction.attrs):
            inner = trips
            if instruction.opcode == "while" and key in ("body", "condition"):
                inner = (*trips, _trip_count(instruction.attrs))
            _walk(module, callee, inner, mesh, rows, depth + 1)


def _kind(opcode: str) -> str | None:
    if opcode.endswith("-done"):
        return None
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


def _callees(attrs: str) -> list[tuple[str, str]]:
    return [
        (m["key"], callee)
        for m in _CALLS.finditer(attrs)
        for callee in re.findall(r"%?([\w.\-]+)", m["value"])
    ]


def _trip_count(attrs: str) -> int | None:
    match = _TRIP_COUNT.search(attrs)
    return int(match[1]) if match else None


def _row(
    kind: str,
    instruction: _Instruction,
    computation: _Computation,
    module: _Module,
    trips: tuple[int | None, ...],
    mesh: tuple[tuple[str, int], ...] | None,
) -> Collective:
    operands = tuple(b for text in instruction.operands for b in _operand_buffers(text, computation))
    results = _result_buffers(kind, instruction, operands)
    raw, groups, hlo_axes = _replica_groups(instruction.attrs, module.num_devices)
    pairs = _source_target_pairs(instruction.attrs)
    op_name = _OP_NAME.search(instruction.attrs)
    name = op_name[1] if op_name else ""
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
        axes=_axes(groups, pairs, hlo_axes, mesh),
        source_target_pairs=pairs,
        trip_counts=trips,
        op_name=name,
    )
    count = len(_part_buffers(row))
    if count <= 1:
        return row
    return dataclasses.replace(row, buffer_op_names=_buffer_op_names(instruction, computation, name, count))


def _buffer_op_names(
    instruction: _Instruction, computation: _Computation, name: str, count: int
) -> tuple[str, ...]:
    """Each buffer's operation: from the get-tuple-elements of its results, else split from ``name``."""
    result = computation.done.get(instruction.name, instruction.name)
    pieces = computation.pieces.get(result, {})
    split = _split_combined(name)
    fallback = split if len(split) == count else [name] * count
    return tuple(pieces.get(i, fallback[i]) for i in range(count))


def _split_combined(name: str) -> list[str]:
    """``"a/b/(c/d:e)"`` (XLA's name for a combined collective) as ``["a/b/c/d", "a/b/e"]``."""
    if not name.endswith(")"):
        return [name]
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            break
    if depth or not (i == 0 or name[i - 1] == "/"):
        return [name]
    prefix, inner = name[:i], name[i + 1 : -1]
    pieces, depth, begin = [], 0, 0
    for j, c in enumerate(inner):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == ":" and depth == 0:
            pieces.append(inner[begin:j])
            begin = j + 1
    pieces.append(inner[begin:])
    return [prefix + piece for piece in pieces]


def _operand_buffers(text: str, computation: _Computation) -> tuple[Operand, ...]:
    """An operand's buffers: from its inline shape, or from the instruction defining it."""
    name = _operand_name(text)
    inline = text[: len(text) - len(text.split()[-1])] if text.split() else ""
    return _arrays(inline) if _ARRAY.search(inline) else _arrays(computation.shapes.get(name, ""))


def _result_buffers(
    kind: str, instruction: _Instruction, operands: tuple[Operand, ...]
) -> tuple[Operand, ...]:
    results = _arrays(instruction.shape)
    started = instruction.opcode.endswith("-start")
    if kind == "all-gather" and started and len(results) == 2 * len(operands) > 0:
        return results[len(operands) :]  # all-gather-start: (operands..., gathered...)
    if kind == "collective-permute" and started and len(results) >= 2:
        return results[1:2]  # (operand, result, context...)
    if kind == "recv":
        return results[:1]  # (buffer, context, token)
    return results


def _buffer_bytes(kind: str, operands: tuple[Operand, ...], results: tuple[Operand, ...]) -> int:
    if kind in ("all-gather", "recv"):
        return sum(b.bytes for b in results)
    if kind in ("collective-permute", "send", "ragged-all-to-all"):
        return operands[0].bytes if operands else sum(b.bytes for b in results[:1])
    if not operands and kind in ("all-reduce", "all-to-all", "collective-broadcast"):
        return sum(b.bytes for b in results)  # same sizes in and out
    return sum(b.bytes for b in operands)


# ---------------------------------------------------------------------------------------
# replica groups and mesh axes
# ---------------------------------------------------------------------------------------

_MESH_GROUPS = re.compile(r"mesh\[(?P<axes>[^\]]*)\](?P<suffix>\S*)\s*\{(?P<selected>[^}]*)\}")
_IOTA_GROUPS = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")

Groups = tuple[tuple[int, ...], ...]


def _replica_groups(attrs: str, num_devices: int | None) -> tuple[str, Groups | None, tuple[str, ...] | None]:
    """The raw replica groups, the groups as device ids, and the axes the HLO names."""
    at = attrs.find("replica_groups=")
    if at < 0:
        return "", None, None
    value = attrs[at + len("replica_groups=") :]
    mesh_form = _MESH_GROUPS.match(value)
    if mesh_form:
        return mesh_form[0], *_mesh_groups(mesh_form)
    iota = _IOTA_GROUPS.match(value)
    if iota:
        return iota[0], _iota_groups(iota), None
    if value.startswith("{"):
        raw = value[: _closing(value, 0) + 1]
        listed = tuple(
            tuple(int(d) for d in re.findall(r"\d+", g)) for g in re.findall(r"\{([\d,\s]*)\}", raw[1:-1])
        )
        if listed:
            return raw, listed, None
        return raw, (tuple(range(num_devices)),) if num_devices else None, None
    return value.split(",")[0], None, None


def _mesh_groups(match: re.Match[str]) -> tuple[Groups | None, tuple[str, ...]]:
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']*)'\s*=\s*(\d+)", match["axes"])]
    selected = tuple(re.findall(r"'([^']*)'", match["selected"]))
    names = [name for name, _ in axes]
    if match["suffix"] or not axes or any(s not in names for s in selected):
        return None, selected  # a device order given after the mesh: not read here
    return _groups_over(axes, selected), selected


def _groups_over(axes: Sequence[tuple[str, int]], selected: Sequence[str]) -> Groups:
    """Logical device ids grouped over ``selected`` axes of a row-major mesh."""
    names = [name for name, _ in axes]
    ids = np.arange(math.prod(size for _, size in axes)).reshape([size for _, size in axes])
    moved = np.moveaxis(ids, [names.index(s) for s in selected], range(-len(selected), 0))
    size = math.prod(dict(axes)[s] for s in selected)
    return tuple(tuple(int(i) for i in g) for g in moved.reshape(-1, size))


def _iota_groups(match: re.Match[str]) -> Groups:
    shape = [int(d) for d in match["shape"].split(",")]
    dims = [int(d) for d in match["dims"].split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match["perm"]:
        ids = ids.transpose([int(p) for p in match["perm"].split(",")])
    return tuple(tuple(int(i) for i in g) for g in ids.reshape(shape[0], -1))


def _source_target_pairs(attrs: str) -> tuple[tuple[int, int], ...] | None:
    at = attrs.find("source_target_pairs=")
    if at < 0:
        return None
    value = attrs[at + len("source_target_pairs=") :]
    raw = value[: _closing(value, 0) + 1]
    return tuple((int(s), int(t)) for s, t in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", raw))


def _axes(
    groups: Groups | None,
    pairs: tuple[tuple[int, int], ...] | None,
    hlo_axes: tuple[str, ...] | None,
    mesh: tuple[tuple[str, int], ...] | None,
) -> tuple[str, ...] | None:
    if mesh is not None and groups is not None:
        named = _axes_of_groups(groups, mesh)
        if named is not None:
            return named
    if mesh is not None and pairs:
        return _axes_of_pairs(pairs, mesh)
    return hlo_axes


def _axes_of_groups(groups: Groups, mesh: tuple[tuple[str, int], ...]) -> tuple[str, ...] | None:
    want = {frozenset(g) for g in groups}
    moving = [name for name, size in mesh if size > 1]
    for n in range(len(moving) + 1):
        for subset in itertools.combinations(moving, n):
            if {frozenset(g) for g in _groups_over(mesh, subset)} == want:
                return subset
    return None


def _axes_of_pairs(
    pairs: tuple[tuple[int, int], ...], mesh: tuple[tuple[str, int], ...]
) -> tuple[str, ...] | None:
    sizes = [size for _, size in mesh]
    total = math.prod(sizes)
    if any(not (0 <= s < total and 0 <= t < total) for s, t in pairs):
        return None
    differ: set[int] = set()
    for s, t in pairs:
        a, b = np.unravel_index(s, sizes), np.unravel_index(t, sizes)
        differ |= {i for i in range(len(sizes)) if a[i] != b[i]}
    return tuple(mesh[i][0] for i in sorted(differ))


# ---------------------------------------------------------------------------------------
# the expected communication of a data-parallel step
# ---------------------------------------------------------------------------------------

SOURCES = ("gradients", "parameters", "loss", "metrics", "batch stats", "update", "model")
"""What an expected buffer is for, in the order ``str()`` lists them.

``"gradients"``: a gradient's reduction; ``"parameters"``: an FSDP parameter gathered
before use; ``"loss"``, ``"metrics"``: their reductions; ``"batch stats"``: the explicit
step's average of a BatchNorm statistic; ``"update"``: what the optimizer update (and the
step's non-finite guard) communicates; ``"model"``: a collective the model's own forward or
backward pass issues, attributed from the compiled program (``compare(...,
attribute_model=True)``).
"""


@dataclass(frozen=True)
class ExpectedCollective:
    """One buffer a step should communicate.

    Attributes:
      kind: the collective, e.g. ``"reduce-scatter"``.
      what: what it is: the parameter's path, ``"loss"``, ``"metrics"``, ``"metric 'x'"``,
        a statistic's path; for update and model buffers, ``"<source>: <operation>"``.
      bytes: its bytes per device per step (a parameter's full, unsplit size).
      source: one of ``SOURCES``; ``""`` reads it from ``what`` (``"loss"``, ``"metric..."``,
        else ``"gradients"``).
      scopes: the library scopes it may be compiled under (``"substrax.grad_reduce"``, ...;
        ``None``: under none); ``()``: anywhere.
      optional: the step is right with or without it; ``why`` says when it is absent.
      buffer: its element type and shape (``"f32[4,16]"``), ``""`` when not known.
      why: for an optional buffer, why the compiler may leave it out.
    """

    kind: str
    what: str
    bytes: int
    source: str = ""
    scopes: tuple[str | None, ...] = ()
    optional: bool = False
    buffer: str = ""
    why: str = ""

    @property
    def category(self) -> str:
        """``source``, or the source ``what`` implies."""
        if self.source:
            return self.source
        if self.what == "loss":
            return "loss"
        return "metrics" if self.what.startswith("metric") else "gradients"

    def __str__(self) -> str:
        buffer = f" {self.buffer}" if self.buffer and self.buffer not in self.what else ""
        optional = ", optional" if self.optional else ""
        return f"{self.what}{buffer} ({self.kind}, {self.bytes:,} B{optional})"


@dataclass(frozen=True)
class Expected:
    """The communication a data-parallel step should compile to, per device and per step.

    Attributes:
      layout: ``"replicated"``, ``"zero1"`` or ``"fsdp"``.
      mode: ``"implicit"`` or ``"explicit"``.
      microbatches: the gradient-accumulation steps; every collective of the library still
        runs once per step, outside the accumulation loop.
      items: the buffers: one per parameter and collective, the loss, the metrics, and
        what else the step was found to need (``SOURCES``).
    """

    layout: str
    mode: str
    microbatches: int
    items: tuple[ExpectedCollective, ...]

    def bytes(self, kind: str | None = None, *, optional: bool = False) -> int:
        """Bytes per step of ``kind`` (all kinds when ``None``); optional buffers only if ``optional``."""
        return sum(
            i.bytes for i in self.items if (kind is None or i.kind == kind) and (optional or not i.optional)
        )

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds called for, in the order of ``KINDS``."""
        present = {i.kind for i in self.items}
        return tuple(k for k in KINDS if k in present)

    def with_items(self, items: Sequence[ExpectedCollective]) -> Expected:
        """The same expectation with ``items`` added."""
        return dataclasses.replace(self, items=self.items + tuple(items))

    def __str__(self) -> str:
        lines = [f"expected communication: {self.layout}, {self.mode}, {self.microbatches} microbatch(es)"]
        for source in _sources(self.items):
            for kind in self.kinds:
                chosen = [i for i in self.items if i.kind == kind and i.category == source]
                if not chosen:
                    continue
                whats = [i.what + (" (optional)" if i.optional else "") for i in chosen]
                total = sum(i.bytes for i in chosen)
                lines.append(f"  {source:<11} {kind:<15} {total:>14,} B  ({_shorten(whats, 6)})")
        return "\n".join(lines)


def _sources(items: Sequence[ExpectedCollective]) -> list[str]:
    present = {i.category for i in items}
    return [s for s in SOURCES if s in present] + sorted(present - set(SOURCES))


def expected_communication(
    leaves: Sequence[tuple[str, Sequence[int], Any, bool]],
    *,
    layout: str,
    mode: str,
    microbatches: int = 1,
    extra_reduce_bytes: int = 0,
    loss_bytes: int = 4,
    communicated_dtype: Any = None,
    update: Sequence[ExpectedCollective] | None = None,
) -> Expected:
    """The collectives a data-parallel step of ``layout`` should compile to.

    The rule, per device and per step (bytes are full, unsplit sizes):

    - ``"replicated"``: one all-reduce of every gradient;
    - ``"zero1"`` (optimizer state split): a reduce-scatter of each split leaf's gradient,
      an all-gather of its updated parameter, an all-reduce of the other gradients;
    - ``"fsdp"`` (parameters split): an all-gather of each split parameter, a
      reduce-scatter of its gradient, an all-reduce of the other gradients;
    - every layout: an all-reduce of the loss (``loss_bytes``) and of the reduced
      metrics (``extra_reduce_bytes``);
    - ``microbatches > 1``: the same bytes, every collective outside the loop.

    Args:
      leaves: one ``(path, shape, dtype, split)`` per trainable parameter; ``split`` says
        the parameter (``"fsdp"``) or its optimizer state (``"zero1"``) is split over the
        data axis. Ignored for ``"replicated"``.
      layout: one of ``LAYOUTS``.
      mode: ``"implicit"`` or ``"explicit"``; recorded for ``compare``.
      microbatches: the gradient-accumulation steps, at least 1.
      extra_reduce_bytes: the bytes of the metrics the step reduces.
      loss_bytes: the bytes of the reduced loss (a float32 scalar: 4; 0: none).
      communicated_dtype: optional; the floating type the compiler moves narrower floating
        leaves in. XLA CPU moves bfloat16 and float16 collectives in float32 (measured, jax
        0.12: a bfloat16 psum or all_gather compiles to an f32 one), so pass ``"float32"``
        to predict a CPU program; leave it ``None`` for the leaves' own types.
      update: optional; what the optimizer update communicates, found by compiling it
        (``substrax._step_census.update_items``). Given, it replaces the rule's own
        guess for the update: ZeRO-1's all-gather of each updated parameter.

    Returns:
      An ``Expected``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"expected_communication: layout must be one of {LAYOUTS}, not {layout!r}")
    if mode not in _MODES:
        raise ValueError(f"expected_communication: mode must be one of {_MODES}, not {mode!r}")
    if microbatches < 1:
        raise ValueError(f"expected_communication: microbatches must be at least 1, not {microbatches}")
    items: list[ExpectedCollective] = []
    for path, shape, dtype, split in leaves:
        itemsize = _itemsize(dtype, communicated_dtype)
        size = math.prod(shape) * itemsize
        buffer = f"{_hlo_type(dtype, itemsize)}[{','.join(str(d) for d in shape)}]"
        for kind in _leaf_kinds(layout, split):
            source = "gradients" if kind in _REDUCTIONS else "parameters" if layout == "fsdp" else "update"
            if source == "update" and update is not None:
                continue
            items.append(ExpectedCollective(kind, str(path), size, source, buffer=buffer))
    if loss_bytes:
        items.append(ExpectedCollective("all-reduce", "loss", loss_bytes, "loss"))
    if extra_reduce_bytes:
        items.append(ExpectedCollective("all-reduce", "metrics", extra_reduce_bytes, "metrics"))
    items.extend(update or ())
    return Expected(layout, mode, microbatches, tuple(items))


def _itemsize(dtype: Any, communicated: Any) -> int:
    leaf = np.dtype(dtype)
    if communicated is None or not jnp.issubdtype(leaf, jnp.floating):
        return leaf.itemsize
    return max(leaf.itemsize, np.dtype(communicated).itemsize)


def _hlo_type(dtype: Any, itemsize: int) -> str:
    """The HLO name of ``dtype`` moved in ``itemsize`` bytes (``"f32"``, ``"bf16"``, ``"s32"``)."""
    kind = np.dtype(dtype).kind
    if kind == "b":
        return "pred"
    letter = {"f": "f", "V": "bf", "i": "s", "u": "u", "c": "c"}.get(kind, "?")
    if np.dtype(dtype).name == "bfloat16" and itemsize == 2:
        letter = "bf"
    elif letter == "bf":
        letter = "f"
    return f"{letter}{itemsize * 8}"


def _leaf_kinds(layout: str, split: bool) -> tuple[str, ...]:
    if layout == "replicated" or not split:
        return ("all-reduce",)
    if layout == "zero1":
        return ("reduce-scatter", "all-gather")
    return ("all-gather", "reduce-scatter")


# ---------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """A census held against the expected communication.

    Unpacks as ``matches, differences = compare(report, expected)``.

    Attributes:
      matches: whether the compiled program communicates as expected.
      differences: one sentence per difference, naming the buffers involved (element
        type, shape, bytes, instruction and the JAX operation they came from).
      notes: what was accepted and why: optional buffers not compiled, buffers compiled
        combined, the implicit-mode bound.
      report: the census.
      expected: the expected communication, with the model's own buffers added when
        ``attribute_model`` found any (source ``"model"``).
      matched: each expected buffer with the compiled buffers it was matched to (none for
        one not compiled).
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
    """Hold a census against the expected communication of a step.

    The compiled buffers (``Collective.parts``: each operand of a combined all-reduce on
    its own, with its own JAX operation) are matched to the expected buffers:

    1. One to one, by collective and bytes, within the scopes an expected buffer allows
       (``ExpectedCollective.scopes``: the step's ``jax.named_scope``\\ s, such as
       ``substrax.grad_reduce``), required buffers first. ``"implicit"`` mode compares
       all-reduce and reduce-scatter as one kind (XLA's partitioner may compile a
       reduce-scatter as an all-reduce and a slice). A gradient prefers a buffer of the
       backward pass, the loss and metrics one of the forward pass.
    2. What is left, combined: the required buffers still unmatched of one kind and scope,
       all together, against at most four compiled ones of the same total bytes (XLA
       concatenates buffers, or cuts one; a note says which).
    3. With ``attribute_model``, a compiled buffer still unmatched, under no library scope,
       whose operation ran inside the differentiated loss (``jvp(...)`` or
       ``transpose(jvp(...))`` in its name: BatchNorm's ``pmean`` of its statistics with
       ``axis_name`` and its transpose; in implicit mode, the all-reduce XLA makes of any
       reduction over the batch the model computes, and what its partitioner moves inside
       the forward and backward pass for the layout (measured: BatchNorm's 16-element
       vectors all-gathered under ZeRO-1 and FSDP)) is the model's own: it is added
       to the expectation as a ``"model"`` buffer, counted and listed, and may run in a
       loop (once per microbatch).

    Then the differences: an expected buffer not compiled (unless optional); a compiled
    buffer nothing accounts for (an unscoped one outside the loss, or one under a library
    scope that no buffer of that scope expects); a buffer the library communicates inside
    a ``while`` loop (with microbatches it belongs after the loop). In ``"implicit"``
    mode with a ``"zero1"`` or ``"fsdp"`` layout, a program that differs only in which
    buffers it moves still matches if it communicates no more bytes in all than expected
    (the partitioner may move activations instead of gradients: measured on 8 CPU devices
    with large weights and a small batch); a note says what it chose.

    Args:
      report: a census (``census(compiled)``).
      expected: ``expected_communication(...)`` for the step.
      attribute_model: count the model's own collectives as above (``TrainStep.census``
        does); ``False`` makes every unmatched buffer a difference.

    Returns:
      A ``Comparison``; ``str()`` of it shows the census, expected against compiled
      bytes per source and kind, the model's buffers, and each difference.
    """
    return _Matcher(report, expected, attribute_model).result()


def _key(kind: str, mode: str) -> str:
    return _REDUCTION_KEY if mode == "implicit" and kind in _REDUCTIONS else kind


def _ordered(keys: set[str]) -> list[str]:
    order = [_REDUCTION_KEY, *KINDS]
    return sorted(keys, key=lambda k: order.index(k) if k in order else len(order))


_PHASE_ORDER = {
    "gradients": {"backward": 0, None: 1, "forward": 2},
    "loss": {"forward": 0, None: 1, "backward": 2},
    "metrics": {"forward": 0, None: 1, "backward": 2},
}
_OTHER_ORDER = {None: 0, "forward": 1, "backward": 2}
_SEARCH_LIMIT = 1 << 12  # partial sums kept while looking for a combined buffer
_SEARCH_BUDGET = 1 << 21  # partial sums tried in all, per comparison: a bound on its time
_PIECES = 4  # compiled buffers that may stand for expected ones combined or cut differently


class _Matcher:
    """The matching of ``compare``, step by step."""

    def __init__(self, report: CensusReport, expected: Expected, attribute_model: bool) -> None:
        self.report, self.expected, self.mode = report, expected, expected.mode
        self.parts = [p for row in report.rows for p in row.parts]
        self.items = [i for i in expected.items if i.bytes > 0]
        self.assigned: dict[int, list[int]] = {}  # item -> parts
        self.taken: set[int] = set()
        self.notes: list[str] = []
        self.budget = [_SEARCH_BUDGET]
        self._one_to_one()
        self._combined()
        left = [j for j in range(len(self.parts)) if j not in self.taken]
        self.model = [j for j in left if attribute_model and self._model_like(self.parts[j])]
        self.unexpected = [j for j in left if j not in self.model]

    def _fits(self, item: ExpectedCollective, part: Part) -> bool:
        return _key(item.kind, self.mode) == _key(part.kind, self.mode) and (
            not item.scopes or part.scope in item.scopes
        )

    def _preference(self, item: ExpectedCollective, j: int) -> tuple[int, int, bool, int]:
        part = self.parts[j]
        order = _PHASE_ORDER.get(item.category, _OTHER_ORDER)
        return order.get(part.phase, 3), _shape_distance(item.buffer, part.buffer), part.row.in_loop, j

    def _order(self) -> list[int]:
        return sorted(
            range(len(self.items)),
            key=lambda i: (self.items[i].optional, not self.items[i].scopes, -self.items[i].bytes, i),
        )

    def _one_to_one(self) -> None:
        for i in self._order():
            item = self.items[i]
            free = [
                j
                for j, p in enumerate(self.parts)
                if j not in self.taken and p.bytes == item.bytes and self._fits(item, p)
            ]
            if free:
                j = min(free, key=lambda j: self._preference(item, j))
                self.assigned[i] = [j]
                self.taken.add(j)

    def _combined(self) -> None:
        """Buffers XLA combined or cut differently: the required buffers still unmatched of one
        kind and scope, all of them, against at most ``_PIECES`` compiled ones of the same total."""
        groups: dict[tuple[str, tuple[str | None, ...]], list[int]] = {}
        for i in self._order():
            item = self.items[i]
            if i not in self.assigned and not item.optional:
                groups.setdefault((_key(item.kind, self.mode), item.scopes), []).append(i)
        for left in groups.values():
            item = self.items[left[0]]
            free = [j for j, p in enumerate(self.parts) if j not in self.taken and self._fits(item, p)]
            total = sum(self.items[i].bytes for i in left)
            chosen = _subset_sum([self.parts[j].bytes for j in free], total, self.budget)
            if chosen is None or (len(chosen) == 1 and len(left) == 1):
                continue  # (one to one was tried)
            for i in left:
                self.assigned[i] = [free[k] for k in chosen]
            self.taken.update(free[k] for k in chosen)
            whats = _shorten([self.items[i].what for i in left], 4)
            pieces = "; ".join(str(self.parts[free[k]]) for k in chosen)
            self.notes.append(f"{whats} ({total:,} B) compiled combined differently, as {pieces}")

    @staticmethod
    def _model_like(part: Part) -> bool:
        return part.scope is None and part.phase is not None

    def result(self) -> Comparison:
        expected, parts = self.expected, self.parts
        differences = self._loop_differences()
        loops = bool(differences)
        differences += self._kind_differences()
        notes = list(self.notes)
        for i, item in enumerate(self.items):
            if item.optional and i not in self.assigned:
                notes.append(f"not compiled, optional: {item}" + (f": {item.why}" if item.why else ""))
        if differences and not loops and self._bound_applies():
            notes.append(self._bound_note())
            differences = []
        model_items = [
            ExpectedCollective(
                parts[j].kind,
                f"model: {parts[j].op_name or parts[j].row.name}",
                parts[j].bytes_per_step,
                "model",
                buffer=str(parts[j].buffer),
            )
            for j in self.model
        ]
        matched = tuple(
            (item, tuple(parts[j] for j in self.assigned.get(i, ()))) for i, item in enumerate(self.items)
        )
        matched += tuple((m, (parts[j],)) for m, j in zip(model_items, self.model, strict=True))
        return Comparison(
            matches=not differences,
            differences=tuple(differences),
            notes=tuple(notes),
            report=self.report,
            expected=expected.with_items(model_items) if model_items else expected,
            matched=matched,
            model=tuple(parts[j] for j in self.model),
            unexpected=tuple(parts[j] for j in self.unexpected),
        )

    def _loop_differences(self) -> list[str]:
        rows: list[Collective] = []
        for i, js in self.assigned.items():
            for j in js:
                row = self.parts[j].row
                if row.in_loop and row not in rows:
                    rows.append(row)
        rows += [
            self.parts[j].row
            for j in self.unexpected
            if self.parts[j].row.in_loop and self.parts[j].row not in rows
        ]
        carried: dict[int, list[str]] = {}
        for i, js in self.assigned.items():
            for j in js:
                carried.setdefault(id(self.parts[j].row), []).append(self.items[i].what)
        return [
            _loop_difference(row, self.expected, carried.get(id(row), []))
            for row in sorted(rows, key=self.report.rows.index)
        ]

    def _kind_differences(self) -> list[str]:
        mode = self.mode
        keys = _ordered({_key(i.kind, mode) for i in self.items} | {_key(p.kind, mode) for p in self.parts})
        out = []
        for key in keys:
            extra = [self.parts[j] for j in self.unexpected if _key(self.parts[j].kind, mode) == key]
            missing = [
                item
                for i, item in enumerate(self.items)
                if not item.optional and i not in self.assigned and _key(item.kind, mode) == key
            ]
            items = [i for i in self.items if _key(i.kind, mode) == key]
            want = sum(i.bytes for i in items if not i.optional)
            model = {id(self.parts[j]) for j in self.model}
            got = sum(
                p.bytes_per_step for p in self.parts if _key(p.kind, mode) == key and id(p) not in model
            )
            if extra and not items:
                out.append(
                    f"unexpected {key}: {sum(p.bytes_per_step for p in extra):,} B per step that the "
                    f"{self.expected.layout} layout does not call for: " + _listed(extra)
                )
            elif extra:
                surplus = sum(p.bytes_per_step for p in extra)
                out.append(
                    f"extra {key}: compiled {got:,} B per step, expected {want:,} B ({surplus:,} B more); "
                    + _twice(surplus, items)
                    + "nothing expected accounts for "
                    + _listed(extra)
                )
            if missing:
                short = sum(i.bytes for i in missing)
                named = _listed(missing)
                if not any(_key(p.kind, mode) == key for p in self.parts):
                    out.append(
                        f"missing {key}: expected {want:,} B per step, compiled none; not compiled: {named}"
                    )
                else:
                    out.append(
                        f"too little {key}: compiled {got:,} B per step, expected {want:,} B ({short:,} B short); "
                        f"not compiled: {named}"
                    )
        return out

    def _bound_applies(self) -> bool:
        sharded_implicit = self.mode == "implicit" and self.expected.layout != "replicated"
        got = sum(p.bytes_per_step for p in self.parts)
        want = sum(i.bytes for i in self.items)
        return sharded_implicit and got <= want

    def _bound_note(self) -> str:
        mode = self.mode
        want: dict[str, int] = {}
        for i in self.items:
            want[_key(i.kind, mode)] = want.get(_key(i.kind, mode), 0) + i.bytes
        got: dict[str, int] = {}
        for p in self.parts:
            got[_key(p.kind, mode)] = got.get(_key(p.kind, mode), 0) + p.bytes_per_step
        keys = [k for k in _ordered({*want, *got}) if want.get(k, 0) != got.get(k, 0)]
        changes = ", ".join(f"{k} {want.get(k, 0):,} -> {got.get(k, 0):,} B" for k in keys)
        return (
            f"implicit mode: XLA chose its own collectives ({changes}); accepted because the step communicates "
            f"{sum(got.values()):,} B in all, no more than the {sum(want.values()):,} B expected"
        )


def _shape_distance(buffer: str, compiled: Operand) -> int:
    """How far a compiled buffer is from the expected one's shape (``buffer``, as written).

    0: the same; 1: its dimensions in another order; 2: the same ones but for unit
    dimensions; 3: other (or nothing to compare with).
    """
    if buffer == str(compiled):
        return 0
    dims = [int(d) for d in re.findall(r"\d+", buffer.partition("[")[2])] if "[" in buffer else None
    if dims is None:
        return 3
    if sorted(dims) == sorted(compiled.shape):
        return 1
    return 2 if sorted(d for d in dims if d != 1) == sorted(d for d in compiled.shape if d != 1) else 3


def _subset_sum(values: Sequence[int], target: int, budget: list[int]) -> tuple[int, ...] | None:
    """Indices of at most ``_PIECES`` of ``values`` that add up to ``target`` (the fewest), or ``None``.

    ``budget[0]`` partial sums may be tried; it is decreased by those tried (none left: ``None``).
    """
    reach: dict[int, tuple[int, ...]] = {0: ()}
    for k, v in enumerate(values):
        if v <= 0 or v > target:
            continue
        budget[0] -= len(reach)
        if budget[0] < 0:
            return None
        for total, chosen in list(reach.items()):
            t = total + v
            if t <= target and len(chosen) < _PIECES and (t not in reach or len(reach[t]) > len(chosen) + 1):
                reach[t] = (*chosen, k)
        if len(reach) > _SEARCH_LIMIT:
            return None
    return reach.get(target) or None


def _loop_difference(row: Collective, expected: Expected, carried: Sequence[str] = ()) -> str:
    runs = f"{row.trip_count} times" if row.trip_count is not None else "an unstated number of times"
    what = f", carrying {_shorten(list(carried), 4)}," if carried else ""
    return (
        f"{row.kind} {row.name} ({_describe(row)}){what} sits inside a while loop and runs {runs} per step; "
        f"the {expected.layout} layout with {expected.microbatches} microbatch(es) expects every "
        f"collective of the step once per step, outside loops"
    )


_LISTED = 24  # buffers a difference names one by one


def _listed(things: Sequence[Any]) -> str:
    """The buffers, each named, up to ``_LISTED`` of them (then how many more, and their bytes)."""
    shown = "; ".join(map(str, things[:_LISTED]))
    rest = things[_LISTED:]
    if not rest:
        return shown
    size = sum(getattr(t, "bytes_per_step", getattr(t, "bytes", 0)) for t in rest)
    return f"{shown}; and {len(rest)} more ({size:,} B; Comparison.unexpected and .matched list them all)"


def _twice(surplus: int, items: list[ExpectedCollective]) -> str:
    leaves = [i for i in items if i.category == "gradients"]
    if leaves and surplus == sum(i.bytes for i in leaves):
        return "the surplus is every parameter's gradient once more (gradients reduced twice?); "
    same = [i.what for i in items if i.bytes == surplus]
    return f"the surplus is the size of {_shorten(same, 3)} (reduced twice?); " if same else ""


def _describe(row: Collective) -> str:
    where = f" from {row.op_name}" if row.op_name else ""
    return f"{row.kind} {row.name} [{_buffers(row)}, {row.bytes:,} B]{where}"


# ---------------------------------------------------------------------------------------
# str()
# ---------------------------------------------------------------------------------------


def _format_report(report: CensusReport) -> str:
    if not report.rows:
        return "census: no collectives"
    total = report.bytes_per_step()
    head = f"census: {report.count()} collective(s), {total:,} B per device per step"
    table = [("#", "kind", "instruction", "axes", "buffers", "bytes", "runs")]
    for i, row in enumerate(report.rows):
        table.append(
            (str(i), row.kind, row.name, _axes_text(row), _buffers(row), f"{row.bytes:,}", _runs(row))
        )
    totals = [("totals", "count", "bytes", "bytes/step")]
    for t in report.totals().values():
        totals.append((t.kind, str(t.count), f"{t.bytes:,}", f"{t.bytes_per_step:,}"))
    return "\n".join([head, *_table(table, right={0, 5}), *_table(totals, right={1, 2, 3})])


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
        cell = rows.setdefault((item.category, _key(item.kind, mode)), [0, 0, 0])
        cell[1 if item.optional else 0] += item.bytes
        for p in parts:
            if id(p) not in seen:
                seen.add(id(p))
                cell[2] += p.bytes_per_step
    for p in comparison.unexpected:
        rows.setdefault(("not expected", _key(p.kind, mode)), [0, 0, 0])[2] += p.bytes_per_step
    sources = [*_sources([i for i, _ in comparison.matched]), "not expected"]
    table = [("source", "kind", "expected", "optional", "compiled")]
    for source in sources:
        for key in _ordered({k for s, k in rows if s == source}):
            want, optional, got = rows[source, key]
            table.append((source, key, f"{want:,}", f"{optional:,}" if optional else "", f"{got:,}"))
    lines = [str(comparison.report), head, *_table(table, right={2, 3, 4})]
    lines += [f"  model: {p}" for p in comparison.model]
    lines += [f"  difference: {d}" for d in comparison.differences]
    lines += [f"  note: {n}" for n in comparison.notes]
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    ]


def _axes_text(row: Collective) -> str:
    if row.axes is not None:
        return ",".join(row.axes) or "-"
    if row.groups is not None:
        return f"{len(row.groups)}x{row.group_size} groups"
    if row.source_target_pairs is not None:
        return f"{len(row.source_target_pairs)} pairs"
    return row.replica_groups or "?"


def _buffers(row: Collective) -> str:
    buffers = row.results if row.kind == "all-gather" else row.operands
    return _shorten([str(b) for b in buffers], 3)


def _runs(row: Collective) -> str:
    if not row.in_loop:
        return "once"
    return f"loop x{row.trip_count}" if row.trip_count is not None else "loop x?"


def _shorten(items: Sequence[str], keep: int) -> str:
    shown = ", ".join(items[:keep])
    return shown + (f", +{len(items) - keep} more" if len(items) > keep else "")
