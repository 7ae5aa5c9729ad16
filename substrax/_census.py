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

``expected_communication`` states what a data-parallel step of a given layout should
communicate, and ``compare`` (or ``CensusReport.check``) holds a census against it; see
``compare`` for the rule.
"""

from __future__ import annotations

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
    "CensusReport",
    "Collective",
    "Comparison",
    "Expected",
    "ExpectedCollective",
    "Operand",
    "census",
    "compare",
    "expected_communication",
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
      op_name: the JAX operation it came from (the HLO metadata), ``""`` when absent.
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
    if not entry:
        raise ValueError(
            "census: no ENTRY computation in this HLO text; pass compiled.as_text() of a program"
        )
    return _Module(name, entry, computations, num_devices)


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
    return Collective(
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
        op_name=op_name[1] if op_name else "",
    )


def _operand_buffers(text: str, computation: _Computation) -> tuple[Operand, ...]:
    """An operand's buffers: from its inline shape, or from the instruction defining it."""
    name = text.split()[-1].lstrip("%") if text.split() else ""
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


@dataclass(frozen=True)
class ExpectedCollective:
    """One buffer a layout's step should communicate.

    Attributes:
      kind: the collective, e.g. ``"reduce-scatter"``.
      what: the parameter's path, ``"loss"`` or ``"metrics"``.
      bytes: its full (unsplit) size in bytes.
    """

    kind: str
    what: str
    bytes: int


@dataclass(frozen=True)
class Expected:
    """The communication a data-parallel step should compile to, per device and per step.

    Attributes:
      layout: ``"replicated"``, ``"zero1"`` or ``"fsdp"``.
      mode: ``"implicit"`` or ``"explicit"``.
      microbatches: the gradient-accumulation steps; every collective still runs once
        per step, outside the accumulation loop.
      items: the buffers, one per parameter and collective, plus the loss and metrics.
    """

    layout: str
    mode: str
    microbatches: int
    items: tuple[ExpectedCollective, ...]

    def bytes(self, kind: str | None = None) -> int:
        """Bytes per step of ``kind`` (all kinds when ``None``)."""
        return sum(i.bytes for i in self.items if kind is None or i.kind == kind)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds called for, in the order of ``KINDS``."""
        present = {i.kind for i in self.items}
        return tuple(k for k in KINDS if k in present)

    def __str__(self) -> str:
        lines = [f"expected communication: {self.layout}, {self.mode}, {self.microbatches} microbatch(es)"]
        for kind in self.kinds:
            whats = [i.what for i in self.items if i.kind == kind]
            lines.append(f"  {kind:<15} {self.bytes(kind):>14,} B  ({_shorten(whats, 6)})")
        return "\n".join(lines)


def expected_communication(
    leaves: Sequence[tuple[str, Sequence[int], Any, bool]],
    *,
    layout: str,
    mode: str,
    microbatches: int = 1,
    extra_reduce_bytes: int = 0,
    loss_bytes: int = 4,
    communicated_dtype: Any = None,
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
      loss_bytes: the bytes of the reduced loss (a float32 scalar: 4).
      communicated_dtype: optional; the floating type the compiler moves narrower floating
        leaves in. XLA CPU moves bfloat16 and float16 collectives in float32 (measured, jax
        0.12: a bfloat16 psum or all_gather compiles to an f32 one), so pass ``"float32"``
        to predict a CPU program; leave it ``None`` for the leaves' own types.

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
        size = math.prod(shape) * _itemsize(dtype, communicated_dtype)
        items.extend(ExpectedCollective(kind, str(path), size) for kind in _leaf_kinds(layout, split))
    items.append(ExpectedCollective("all-reduce", "loss", loss_bytes))
    if extra_reduce_bytes:
        items.append(ExpectedCollective("all-reduce", "metrics", extra_reduce_bytes))
    return Expected(layout, mode, microbatches, tuple(items))


def _itemsize(dtype: Any, communicated: Any) -> int:
    leaf = np.dtype(dtype)
    if communicated is None or not jnp.issubdtype(leaf, jnp.floating):
        return leaf.itemsize
    return max(leaf.itemsize, np.dtype(communicated).itemsize)


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
      differences: one sentence per difference, naming the instructions involved.
      notes: what was accepted under the implicit-mode rule, and why.
      report: the census.
      expected: the expected communication.
    """

    matches: bool
    differences: tuple[str, ...]
    notes: tuple[str, ...]
    report: CensusReport
    expected: Expected

    def __iter__(self) -> Iterator[Any]:
        return iter((self.matches, list(self.differences)))

    def __str__(self) -> str:
        return _format_comparison(self)


def compare(report: CensusReport, expected: Expected) -> Comparison:
    """Hold a census against the expected communication of a step.

    The rule, bytes per device per step, by kind (not instruction counts: XLA combines
    reductions into one variadic all-reduce, and may split them again):

    1. Every collective runs once per step: any collective inside a ``while`` loop is a
       difference (with microbatches, the reductions belong after the loop).
    2. ``"explicit"`` mode: the bytes of each kind equal the expected bytes of that kind,
       and a kind the layout does not call for is a difference.
    3. ``"implicit"`` mode: XLA's partitioner picks the collectives, so all-reduce and
       reduce-scatter bytes are compared as one sum (a reduce-scatter may compile to an
       all-reduce and a slice); other kinds as in 2. For ``"replicated"`` that is the
       whole rule. For ``"zero1"`` and ``"fsdp"``, when the kinds do not match, the
       program still matches if it communicates no more bytes in total than expected
       (the partitioner may move activations instead of gradients: measured on 8 CPU
       devices with large weights and a small batch); a note says what it chose.

    Args:
      report: a census (``census(compiled)``).
      expected: ``expected_communication(...)`` for the step.

    Returns:
      A ``Comparison``; ``str()`` of it shows the census, expected against compiled
      bytes per kind, and each difference.
    """
    differences = [_loop_difference(row, expected) for row in report.rows if row.in_loop]
    want, got = _by_kind(expected.items, expected.mode), _by_kind(report.rows, expected.mode)
    mismatched = [k for k in _ordered({*want, *got}) if want.get(k, 0) != got.get(k, 0)]
    notes: list[str] = []
    if mismatched and _bound_applies(expected, differences, got, want):
        notes.append(_bound_note(mismatched, want, got))
        mismatched = []
    differences += [_kind_difference(k, want.get(k, 0), got.get(k, 0), report, expected) for k in mismatched]
    return Comparison(not differences, tuple(differences), tuple(notes), report, expected)


def _key(kind: str, mode: str) -> str:
    return _REDUCTION_KEY if mode == "implicit" and kind in _REDUCTIONS else kind


def _by_kind(items: Sequence[ExpectedCollective] | Sequence[Collective], mode: str) -> dict[str, int]:
    totals: dict[str, int] = {}
    for item in items:
        size = item.bytes_per_step if isinstance(item, Collective) else item.bytes
        key = _key(item.kind, mode)
        totals[key] = totals.get(key, 0) + size
    return totals


def _ordered(keys: set[str]) -> list[str]:
    order = [_REDUCTION_KEY, *KINDS]
    return sorted(keys, key=order.index)


def _bound_applies(expected: Expected, loops: list[str], got: dict[str, int], want: dict[str, int]) -> bool:
    sharded_implicit = expected.mode == "implicit" and expected.layout != "replicated"
    return sharded_implicit and not loops and sum(got.values()) <= sum(want.values())


def _bound_note(keys: list[str], want: dict[str, int], got: dict[str, int]) -> str:
    changes = ", ".join(f"{k} {want.get(k, 0):,} -> {got.get(k, 0):,} B" for k in keys)
    return (
        f"implicit mode: XLA chose its own collectives ({changes}); accepted because the step communicates "
        f"{sum(got.values()):,} B in all, no more than the {sum(want.values()):,} B expected"
    )


def _loop_difference(row: Collective, expected: Expected) -> str:
    runs = f"{row.trip_count} times" if row.trip_count is not None else "an unstated number of times"
    return (
        f"{row.kind} {row.name} ({_describe(row)}) sits inside a while loop and runs {runs} per step; "
        f"the {expected.layout} layout with {expected.microbatches} microbatch(es) expects every "
        f"collective once per step, outside loops"
    )


def _kind_difference(key: str, want: int, got: int, report: CensusReport, expected: Expected) -> str:
    rows = [r for r in report.rows if _key(r.kind, expected.mode) == key]
    if not want:
        return (
            f"unexpected {key}: {got:,} B per step that the {expected.layout} layout does not call for: "
            + ("; ".join(_describe(r) for r in rows))
        )
    if not got:
        whats = [i.what for i in expected.items if _key(i.kind, expected.mode) == key]
        return f"missing {key}: expected {want:,} B per step ({_shorten(whats, 6)}), compiled none"
    if got < want:
        return f"too little {key}: compiled {got:,} B per step, expected {want:,} B ({want - got:,} B short)"
    return (
        f"extra {key}: compiled {got:,} B per step, expected {want:,} B ({got - want:,} B more); "
        + _culprit(rows, got - want, [i for i in expected.items if _key(i.kind, expected.mode) == key])
    )


def _culprit(rows: list[Collective], surplus: int, items: list[ExpectedCollective]) -> str:
    """Name the instruction (or the operand of a combined one) the size of the surplus.

    Failing that, name the expected buffers of that size (reduced twice?) and list the rows.
    """
    for row in rows:
        if row.bytes_per_step == surplus:
            return f"the surplus is {_describe(row)}"
    for row in rows:
        for i, buffer in enumerate(row.operands):
            if buffer.bytes == surplus and len(row.operands) > 1:
                return f"the surplus is operand {i} ({buffer}) of {_describe(row)}"
    return _twice(surplus, items) + "compiled: " + "; ".join(_describe(r) for r in rows)


def _twice(surplus: int, items: list[ExpectedCollective]) -> str:
    leaves = [i for i in items if i.what not in ("loss", "metrics")]
    if leaves and surplus == sum(i.bytes for i in leaves):
        return "the surplus is every parameter's buffer once more (gradients reduced twice?); "
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
    verdict = "matches" if comparison.matches else "does NOT match"
    head = (
        f"{verdict} the expected communication of {expected.layout} ({expected.mode}, "
        f"{expected.microbatches} microbatch(es)), bytes per device per step:"
    )
    want = _by_kind(expected.items, expected.mode)
    got = _by_kind(comparison.report.rows, expected.mode)
    table = [("kind", "expected", "compiled")]
    for key in _ordered({*want, *got}):
        table.append((key, f"{want.get(key, 0):,}", f"{got.get(key, 0):,}"))
    lines = [str(comparison.report), head, *_table(table, right={1, 2})]
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
