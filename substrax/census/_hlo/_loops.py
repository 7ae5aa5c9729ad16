"""How many times a ``while`` loop runs its body: stated by the compiler, or read from the program.

XLA's CPU and GPU compilers state it in the loop's ``backend_config`` (``known_trip_count``);
the TPU compiler does not. There the count is read from the loop itself: the condition
compares one element of the loop's tuple (the induction variable) with a constant, the
while's operand starts it at a constant, and the body adds a constant to it.
"""

from __future__ import annotations

import re

from ._module import Computation, Instruction, Module, operand_name

__all__ = ["trip_count"]

_KNOWN = re.compile(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_CALLS = re.compile(r"\b(?P<key>condition|body|calls)=%?(?P<name>[\w.\-]+)")
_DIRECTION = re.compile(r"\bdirection=(\w+)")
_INDEX = re.compile(r"\bindex=(\d+)")
_SAME = ("copy", "bitcast", "reshape", "convert", "copy-done", "optimization-barrier")
_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}
_DEPTH = 64

# A value as this reader follows it: an element of the loop's tuple plus a constant,
# ``(index, offset)``, or a constant alone, ``(None, value)``; ``None`` when it is neither.
Value = tuple[int | None, int]


def trip_count(
    module: Module, instruction: Instruction, computation: Computation | None = None
) -> int | None:
    """The times the ``while`` ``instruction`` runs its body, ``None`` when not known.

    ``computation`` holds ``instruction`` (found in ``module`` when not given). The count is
    the compiler's ``known_trip_count`` where stated, else read from the loop: an induction
    variable started at a constant, stepped by a constant, compared with a constant (or with
    an element the body leaves as it is, started at a constant).
    """
    if instruction.opcode != "while":
        raise ValueError(f"trip_count takes a while instruction, not {instruction.opcode} {instruction.name}")
    known = _KNOWN.search(instruction.attrs)
    if known:
        return int(known[1])
    called = {m["key"]: m["name"] for m in _CALLS.finditer(instruction.attrs)}
    condition, body = (
        module.computations.get(called.get("condition", "")),
        module.computations.get(called.get("body", "")),
    )
    holder = computation or _holder(module, instruction)
    if condition is None or body is None or holder is None or len(instruction.operands) != 1:
        return None
    compared = _comparison(module, condition)
    if compared is None:
        return None
    left, direction, right = compared
    if left[0] is None:  # the constant on the left: the same test read from the right
        left, direction, right = right, _FLIP[direction], left
    if left[0] is None or left[1] != 0:
        return None
    index = left[0]
    start = _element(module, holder, instruction.operands[0], index)
    step = _stepped(module, body, index)
    bound = _bound(module, holder, body, instruction.operands[0], right)
    if start is None or step is None or bound is None:
        return None
    return _count(start, step, bound, direction)


def _holder(module: Module, instruction: Instruction) -> Computation | None:
    holders = (c for c in module.computations.values() if c.defs.get(instruction.name) is instruction)
    return next(holders, None)


def _comparison(module: Module, condition: Computation) -> tuple[Value, str, Value] | None:
    """The condition's ``compare`` as (left, direction, right), through a fusion that computes it."""
    root = condition.defs.get(condition.root)
    if root is None:
        return None
    scope, compare, outer = condition, root, None
    if root.opcode == "fusion":
        fused = module.computations.get(_called(root))
        inner = fused.defs.get(fused.root) if fused else None
        if fused is None or inner is None:
            return None
        scope, compare, outer = fused, inner, (condition, root)
    direction = _DIRECTION.search(compare.attrs)
    if compare.opcode != "compare" or direction is None or len(compare.operands) != 2:
        return None
    left, right = (_value(module, scope, operand_name(o), outer) for o in compare.operands)
    if left is None or right is None or direction[1] not in _FLIP:
        return None
    return left, direction[1], right


def _stepped(module: Module, body: Computation, index: int) -> int | None:
    """The constant the body adds to element ``index`` of the loop's tuple each time round."""
    after = _root_element(module, body, index)
    return after[1] if after is not None and after[0] == index and after[1] != 0 else None


def _bound(module: Module, holder: Computation, body: Computation, init: str, right: Value) -> int | None:
    """The bound's value: a constant, or an element the body passes on unchanged, started at one."""
    index, offset = right
    if index is None:
        return offset
    if _root_element(module, body, index) != (index, 0):
        return None
    start = _element(module, holder, init, index)
    return None if start is None else start + offset


def _root_element(module: Module, body: Computation, index: int) -> Value | None:
    """Element ``index`` of the tuple the body gives back, as a ``Value`` of its parameter's elements."""
    root = body.defs.get(body.root)
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return None
    return _value(module, body, operand_name(root.operands[index]), None)


def _element(module: Module, holder: Computation, init: str, index: int) -> int | None:
    """The constant element ``index`` of the while's operand starts at, ``None`` if not a constant."""
    tuple_ = _defined(holder, operand_name(init))
    if tuple_ is None or tuple_.opcode != "tuple" or index >= len(tuple_.operands):
        return None
    start = _value(module, holder, operand_name(tuple_.operands[index]), None, loop=False)
    return start[1] if start is not None and start[0] is None else None


def _defined(computation: Computation, name: str) -> Instruction | None:
    """The instruction that defines ``name``, looking through copies and bitcasts."""
    for _ in range(_DEPTH):
        found = computation.defs.get(name)
        if found is None or found.opcode not in _SAME or not found.operands:
            return found
        name = operand_name(found.operands[0])
    return None


def _value(
    module: Module,
    scope: Computation,
    name: str,
    outer: tuple[Computation, Instruction] | None,
    *,
    loop: bool = True,
    depth: int = 0,
) -> Value | None:
    """``name`` in ``scope`` as a ``Value``: a constant, an element of ``scope``'s tuple parameter
    (``loop``), or a sum or difference of such; inside a fusion (``outer``: the computation and
    the fusion that calls it) a parameter is the fusion's operand."""
    found = _defined(scope, name)
    if found is None or depth > _DEPTH:
        return None
    recurse = lambda s, n, o: _value(module, s, n, o, loop=loop, depth=depth + 1)  # noqa: E731
    if found.opcode == "constant":
        return _constant(found)
    if found.opcode == "parameter" and outer is not None:
        number = int(found.operands[0]) if found.operands and found.operands[0].isdigit() else -1
        computation, fusion = outer
        if not 0 <= number < len(fusion.operands):
            return None
        return recurse(computation, operand_name(fusion.operands[number]), None)
    if found.opcode == "get-tuple-element" and outer is None:
        source, index = _defined(scope, operand_name(found.operands[0])), _INDEX.search(found.attrs)
        if source is None or index is None:
            return None
        if source.opcode == "tuple" and int(index[1]) < len(source.operands):
            return recurse(scope, operand_name(source.operands[int(index[1])]), None)
        return (int(index[1]), 0) if loop and source.opcode == "parameter" else None
    if found.opcode == "fusion":
        fused = module.computations.get(_called(found))
        return None if fused is None else recurse(fused, fused.root, (scope, found))
    if found.opcode in ("add", "subtract") and len(found.operands) == 2:
        a, b = (recurse(scope, operand_name(o), outer) for o in found.operands)
        return _combined(a, b, found.opcode == "subtract")
    return None


def _combined(a: Value | None, b: Value | None, subtract: bool) -> Value | None:
    if a is None or b is None:
        return None
    if subtract:
        return None if b[0] is not None else (a[0], a[1] - b[1])
    if a[0] is not None and b[0] is not None:
        return None
    return (a[0] if a[0] is not None else b[0]), a[1] + b[1]


def _constant(instruction: Instruction) -> Value | None:
    text = instruction.operands[0] if instruction.operands else ""
    return (None, int(text)) if re.fullmatch(r"-?\d+", text) else None


def _called(instruction: Instruction) -> str:
    found = _CALLS.search(instruction.attrs)
    return found["name"] if found and found["key"] == "calls" else ""


def _count(start: int, step: int, bound: int, direction: str) -> int | None:
    """The times ``v`` in ``start, start + step, ...`` passes ``v <direction> bound`` before it fails."""
    distance = bound - start
    inclusive = direction in ("LE", "GE")
    if direction in ("LT", "LE", "GT", "GE"):
        upward = direction in ("LT", "LE")
        if (distance < 0 if upward else distance > 0) or (distance == 0 and not inclusive):
            return 0
        if (step < 0) if upward else (step > 0):
            return None  # moving away from the bound: not a loop this reader counts
        return -(-distance // step) + (inclusive and distance % step == 0)
    if direction == "NE":
        return distance // step if distance % step == 0 and distance // step >= 0 else None
    return None
