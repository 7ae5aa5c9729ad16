"""One collective instruction's buffers, and each one's JAX operation (from its ``get-tuple-element``)."""

from __future__ import annotations

from ._module import Computation, Instruction, Operand, arrays, operand_name


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
    inline = text[: len(text) - len(text.split()[-1])] if text.split() else ""
    return arrays(inline) or arrays(computation.shapes.get(operand_name(text), ""))


def result_buffers(kind: str, instruction: Instruction, operands: tuple[Operand, ...]) -> tuple[Operand, ...]:
    """A collective's result buffers (of an asynchronous ``-start``: the received ones only)."""
    results = arrays(instruction.shape)
    started = instruction.opcode.endswith("-start")
    if kind == "all-gather" and started and len(results) == 2 * len(operands) > 0:
        return results[len(operands) :]  # all-gather-start: (operands..., gathered...)
    if kind == "collective-permute" and started and len(results) >= 2:
        return results[1:2]  # (operand, result, context...)
    if kind == "recv":
        return results[:1]  # (buffer, context, token)
    return results
