"""A reader of optimized HLO text: the collective instructions a program runs, and what each says.

It knows HLO, not substrax: ``parse_module`` reads the text of a compiled module
(``compiled.as_text()``) into its computations and instructions; ``collective_sites``
walks from ``ENTRY`` through every called computation (``while`` bodies with their trip
counts, conditionals, calls, async wrappers) to each collective instruction, an
asynchronous ``-start``/``-done`` pair counted once at its ``-start``. The functions
after it read one instruction: its buffers (``operand_buffers``, ``result_buffers``),
its replica groups in any of HLO's three forms and the mesh axes they span
(``replica_groups``, ``mesh_axes``), a collective-permute's pairs, and the JAX operation
of the instruction and of each of its buffers (``op_name``, ``buffer_op_names``: XLA
combines several collectives into one instruction, and the ``get-tuple-element`` that
takes each result back out keeps its own operation's metadata).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "KINDS",
    "Computation",
    "Groups",
    "Instruction",
    "Module",
    "Operand",
    "Site",
    "buffer_op_names",
    "collective_sites",
    "mesh_axes",
    "op_name",
    "operand_buffers",
    "parse_module",
    "replica_groups",
    "result_buffers",
    "source_target_pairs",
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


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    small_float = re.match(r"f(\d+)e", dtype)  # f8e4m3fn, f8e5m2, f4e2m1fn, f6e3m2fn, ...
    if small_float:
        return int(small_float[1])
    raise ValueError(f"census: unknown HLO element type {dtype!r}")


# ---------------------------------------------------------------------------------------
# HLO text
# ---------------------------------------------------------------------------------------


@dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)
    pieces: dict[str, dict[int, str]] = field(default_factory=dict)  # tuple -> {index: op_name of its gte}
    done: dict[str, str] = field(default_factory=dict)  # an async -start -> its -done


@dataclass
class Module:
    name: str
    entry: str
    computations: dict[str, Computation]
    num_devices: int | None


_COMMENT = re.compile(r"/\*.*?\*/")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s({]+)")
_OPCODE = re.compile(r"(?P<opcode>[a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_OPEN = {"(": ")", "[": "]", "{": "}"}
_INDEX = re.compile(r"\bindex=(\d+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


def parse_module(text: str) -> Module:
    """The computations and instructions of an HLO module's text."""
    name, num_devices = "", None
    computations: dict[str, Computation] = {}
    entry = ""
    current: Computation | None = None
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw).rstrip()
        if line.startswith("HloModule"):
            name, num_devices = _module_header(line)
        elif current is None and line.endswith("{") and not line[:1].isspace():
            header = _HEADER.match(line)
            if header:
                current = Computation(header["name"])
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
    return Module(name, entry, computations, num_devices)


def _note_users(computation: Computation, instruction: Instruction) -> None:
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


def _parse_instruction(line: str) -> Instruction | None:
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
    return Instruction(match["name"], shape, opcode["opcode"], operands, tail[end + 1 :])


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


# ---------------------------------------------------------------------------------------
# the walk from ENTRY
# ---------------------------------------------------------------------------------------

_CALLS = re.compile(
    r"\b(?P<key>calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(?P<value>\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT = re.compile(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_MAX_DEPTH = 200


@dataclass(frozen=True)
class Site:
    """A collective instruction where the walk from ``ENTRY`` reaches it (once per call site).

    Attributes:
      kind: one of ``KINDS``.
      instruction: the instruction (a ``-start`` for an asynchronous pair).
      computation: the computation that holds it.
      trip_counts: the trip count of each ``while`` loop around it, outermost first;
        ``None`` where the compiler does not state it; ``()`` outside loops.
    """

    kind: str
    instruction: Instruction
    computation: Computation
    trip_counts: tuple[int | None, ...]


def collective_sites(module: Module) -> list[Site]:
    """Every collective instruction reached from ``ENTRY``, in program order."""
    sites: list[Site] = []
    _walk(module, module.entry, (), sites, depth=0)
    return sites


def _walk(module: Module, name: str, trips: tuple[int | None, ...], sites: list[Site], depth: int) -> None:
    computation = module.computations.get(name)
    if computation is None or depth > _MAX_DEPTH:
        return
    for instruction in computation.instructions:
        kind = _kind(instruction.opcode)
        if kind is not None:
            sites.append(Site(kind, instruction, computation, trips))
        if instruction.opcode.endswith("-done") or instruction.opcode == "async-update":
            continue  # the -start that began it already led to the computation it runs
        for key, callee in _callees(instruction.attrs):
            inner = trips
            if instruction.opcode == "while" and key in ("body", "condition"):
                inner = (*trips, _trip_count(instruction.attrs))
            _walk(module, callee, inner, sites, depth + 1)


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


# ---------------------------------------------------------------------------------------
# one instruction: buffers and operation names
# ---------------------------------------------------------------------------------------


def op_name(attrs: str) -> str:
    """The JAX operation an instruction came from (its metadata's ``op_name``), ``""`` when absent."""
    match = _OP_NAME.search(attrs)
    return match[1] if match else ""


def buffer_op_names(
    instruction: Instruction, computation: Computation, name: str, count: int
) -> tuple[str, ...]:
    """Each of ``count`` buffers' operation: from the get-tuple-elements of its results, else split from ``name``."""
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


def operand_buffers(instruction: Instruction, computation: Computation) -> tuple[Operand, ...]:
    """The buffers of an instruction's operands, in order."""
    return tuple(b for text in instruction.operands for b in _operand_buffers(text, computation))


def _operand_buffers(text: str, computation: Computation) -> tuple[Operand, ...]:
    """An operand's buffers: from its inline shape, or from the instruction defining it."""
    name = _operand_name(text)
    inline = text[: len(text) - len(text.split()[-1])] if text.split() else ""
    return _arrays(inline) if _ARRAY.search(inline) else _arrays(computation.shapes.get(name, ""))


def result_buffers(kind: str, instruction: Instruction, operands: tuple[Operand, ...]) -> tuple[Operand, ...]:
    """A collective's result buffers (of an asynchronous ``-start``: the received ones only)."""
    results = _arrays(instruction.shape)
    started = instruction.opcode.endswith("-start")
    if kind == "all-gather" and started and len(results) == 2 * len(operands) > 0:
        return results[len(operands) :]  # all-gather-start: (operands..., gathered...)
    if kind == "collective-permute" and started and len(results) >= 2:
        return results[1:2]  # (operand, result, context...)
    if kind == "recv":
        return results[:1]  # (buffer, context, token)
    return results


# ---------------------------------------------------------------------------------------
# replica groups and mesh axes
# ---------------------------------------------------------------------------------------

_MESH_GROUPS = re.compile(r"mesh\[(?P<axes>[^\]]*)\](?P<suffix>\S*)\s*\{(?P<selected>[^}]*)\}")
_IOTA_GROUPS = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")

Groups = tuple[tuple[int, ...], ...]


def replica_groups(attrs: str, num_devices: int | None) -> tuple[str, Groups | None, tuple[str, ...] | None]:
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


def source_target_pairs(attrs: str) -> tuple[tuple[int, int], ...] | None:
    """A collective-permute's ``(source, target)`` pairs, ``None`` when it states none."""
    at = attrs.find("source_target_pairs=")
    if at < 0:
        return None
    value = attrs[at + len("source_target_pairs=") :]
    raw = value[: _closing(value, 0) + 1]
    return tuple((int(s), int(t)) for s, t in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", raw))


def mesh_axes(
    groups: Groups | None,
    pairs: tuple[tuple[int, int], ...] | None,
    hlo_axes: tuple[str, ...] | None,
    mesh: tuple[tuple[str, int], ...] | None,
) -> tuple[str, ...] | None:
    """The axes of ``mesh`` (``(name, size)`` pairs) the groups or pairs span, else those the HLO names."""
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
