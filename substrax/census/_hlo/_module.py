"""An HLO module's text, read into its computations and instructions (``parse_module``).

``Operand`` is one array buffer, ``arrays`` those a shape holds, ``op_name`` the JAX
operation an instruction's metadata names.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

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
    defs: dict[str, Instruction] = field(default_factory=dict)  # name -> the instruction defining it
    root: str = ""  # the name of its ROOT instruction


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


def op_name(attrs: str) -> str:
    """The JAX operation an instruction came from (its metadata's ``op_name``), ``""`` when absent."""
    match = _OP_NAME.search(attrs)
    return match[1] if match else ""


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
                current.defs[instruction.name] = instruction
                if line.lstrip().startswith("ROOT "):
                    current.root = instruction.name
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
    source = operand_name(instruction.operands[0])
    if instruction.opcode == "get-tuple-element":
        index, op_name = _INDEX.search(instruction.attrs), _OP_NAME.search(instruction.attrs)
        if index and op_name:
            computation.pieces.setdefault(source, {})[int(index[1])] = op_name[1]
    elif instruction.opcode.endswith("-done"):
        computation.done[source] = instruction.name


def operand_name(text: str) -> str:
    """The instruction an operand names (its last word, without ``%``)."""
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
        end = closing(rest, 0)
        shape, tail = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, tail = rest.partition(" ")
    opcode = _OPCODE.match(tail)
    if opcode is None:
        return None
    start = opcode.end() - 1
    end = closing(tail, start)
    operands = _split_top(tail[start + 1 : end])
    return Instruction(match["name"], shape, opcode["opcode"], operands, tail[end + 1 :])


def closing(text: str, start: int) -> int:
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


def arrays(shape: str) -> tuple[Operand, ...]:
    """The array buffers an HLO shape (or an operand's inline shape) holds, in order."""
    return tuple(
        Operand(m["dtype"], tuple(int(d) for d in re.findall(r"\d+", m["dims"])))
        for m in _ARRAY.finditer(shape)
    )
