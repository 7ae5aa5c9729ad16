"""One collective instruction's buffers, and each one's JAX operation (from its ``get-tuple-element``)."""

from __future__ import annotations

import re

from ._module import Computation, Instruction, Module, Operand, arrays, operand_name


def buffer_op_names(
    instruction: Instruction, computation: Computation, name: str, count: int
) -> tuple[str, ...]:
    """Each of ``count`` buffers' operation: from the get-tuple-elements of its results, else split from
    ``name``."""
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


def operand_buffers(
    instruction: Instruction, computation: Computation, module: Module | None = None
) -> tuple[Operand, ...]:
    """The buffers of an instruction's operands, in order.

    An all-reduce of one flat buffer concatenated from several (XLA's GPU compiler concatenates
    the all-reduces it combines) gives the concatenated buffers, each in the shape it had before
    it was flattened (a ``bitcast``'s operand): they are what it reduces.
    """
    if module is not None and instruction.opcode.removesuffix("-start") == "all-reduce":
        pieces = concatenated(instruction, computation, module)
        if pieces:
            return pieces
    return tuple(b for text in instruction.operands for b in _operand_buffers(text, computation))


def concatenated(instruction: Instruction, computation: Computation, module: Module) -> tuple[Operand, ...]:
    """The buffers a one-operand collective's operand concatenates (a ``concatenate``, or a fusion whose
    root is one), unflattened through ``bitcast``s; ``()`` when it is not a concatenation."""
    if len(instruction.operands) != 1:
        return ()
    source = computation.defs.get(operand_name(instruction.operands[0]))
    if source is None:
        return ()
    if source.opcode == "concatenate":
        texts = source.operands
    elif source.opcode == "fusion":
        callee = re.search(r"\bcalls=%?([\w.\-]+)", source.attrs)
        fused = module.computations.get(callee[1]) if callee else None
        root = fused.defs.get(fused.root) if fused is not None else None
        if root is None or root.opcode != "concatenate":
            return ()
        texts = []
        for text in root.operands:
            parameter = fused.defs.get(operand_name(text))
            number = (
                re.fullmatch(r"(\d+)", parameter.operands[0]) if parameter and parameter.operands else None
            )
            if parameter is None or parameter.opcode != "parameter" or number is None:
                return ()
            if int(number[1]) >= len(source.operands):
                return ()
            texts.append(source.operands[int(number[1])])
    else:
        return ()
    buffers = []
    for text in texts:
        found = _operand_buffers(text, computation)
        before = computation.defs.get(operand_name(text))
        if before is not None and before.opcode == "bitcast" and len(found) == 1:
            unflat = _operand_buffers(before.operands[0], computation) if before.operands else ()
            if len(unflat) == 1 and unflat[0].bytes == found[0].bytes and unflat[0].dtype == found[0].dtype:
                found = unflat
        if len(found) != 1:
            return ()
        buffers.append(found[0])
    return tuple(buffers)


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
    if kind == "collective-permute" and started and len(results) >= 2 * len(operands) > 0:
        return results[len(operands) : 2 * len(operands)]  # (operands, results, context...)
    if kind == "recv":
        return results[:1]  # (buffer, context, token)
    return results
