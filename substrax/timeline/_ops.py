"""One instruction's cost, read from the compiled program: its FLOPs and the bytes it moves.

A matrix product (``dot``, ``convolution``, a GPU's GEMM custom call) counts ``2 x`` its result's
elements ``x`` what each sums over; an elementwise operation its result's elements; a reduction
its input's. A fusion counts what it fuses, and moves its operands and results once: an operand
it only slices moves the slices, a buffer it updates in place (``dynamic-update-slice``) the
update. ``seconds`` puts a cost at its bound on a target: the matrix units or the memory.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from substrax.census import arrays, operand_name
from substrax.timeline._targets import Target

__all__ = ["FREE", "Cost", "instruction_cost", "seconds"]

FREE = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
    "replica-id", "opt-barrier", "optimization-barrier", "add-dependency", "copy-start", "copy-done",
    "slice-start", "slice-done", "send-done", "recv-done", "domain", "iota",
})  # fmt: skip
"""What moves no bytes of its own: views, tuples, markers; and a TPU's asynchronous copies between
its memories (``copy-start``, ``slice-start``: its DMA engines run them beside the compute)."""

_MOVES = frozenset({
    "broadcast", "reshape", "transpose", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate",
    "pad", "copy", "gather", "scatter", "reverse", "convert", "bitcast-convert", "select",
})  # fmt: skip
"""Operations that move or choose elements: no arithmetic counted (a ``convert``, a ``select``)."""
_SLICES = frozenset({"slice", "dynamic-slice", "gather"})
_FREE_CALLS = re.compile(r'custom_call_target="(?:ConcatBitcast|AllocateBuffer|Assume\w*|\w*Bitpacked\w*)"')
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_DEPTH = 16


@dataclasses.dataclass(frozen=True)
class Cost:
    """One instruction's work, once.

    Attributes:
      flops: Every floating-point operation (matrix products, elementwise, reductions).
      matrix_flops: Those of matrix products at the bfloat16 rate.
      f32_matrix_flops: Those of float32 matrix products (their own rate, ``Target.f32_flops``).
      bytes: Bytes read and written in memory (HBM).
    """

    flops: float = 0.0
    matrix_flops: float = 0.0
    f32_matrix_flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True))
        )

    def times(self, n: float) -> Cost:
        return Cost(*(a * n for a in dataclasses.astuple(self)))


def seconds(cost: Cost, target: Target) -> float:
    """``cost`` at its bound: the matrix units' time or the memory's, whichever is longer."""
    compute = cost.matrix_flops / target.flops + cost.f32_matrix_flops / target.f32_flops
    return max(compute, cost.bytes / target.hbm_bytes_per_s)


def instruction_cost(module: Any, computation: Any, instruction: Any) -> Cost:
    """The cost of ``instruction`` of ``computation`` (a fusion: what it fuses), run once."""
    if instruction.opcode in FREE or _FREE_CALLS.search(instruction.attrs):
        return Cost()
    flops = _flops(module, computation, instruction)
    if instruction.opcode in ("fusion", "fusion-start"):
        fused = module.computations.get(_called(instruction))
        moved = _fusion_bytes(computation, instruction, fused, module) if fused is not None else 0
    else:
        moved = _size(instruction.shape) + sum(_size(_shape(computation, o)) for o in instruction.operands)
    return dataclasses.replace(flops, bytes=float(moved))


def _flops(module: Any, computation: Any, instruction: Any) -> Cost:
    """The FLOPs of ``instruction`` (a fusion's: of what it fuses, nested fusions too)."""
    opcode = instruction.opcode
    if opcode in ("fusion", "fusion-start"):
        fused = module.computations.get(_called(instruction))
        total = Cost()
        for inner in fused.instructions if fused is not None else ():
            if inner.opcode not in FREE:
                total = total + _flops(module, fused, inner)
        return total
    if opcode in ("dot", "convolution") or (opcode == "custom-call" and _is_gemm(instruction.attrs)):
        count = 2.0 * _elements(_first(instruction.shape)) * _summed(computation, instruction)
        f32 = _shape(computation, instruction.operands[0]).lstrip("(").startswith(("f32", "f64"))
        return Cost(count, 0.0 if f32 else count, count if f32 else 0.0)
    if opcode == "reduce" or opcode == "reduce-window":
        return Cost(float(_elements(_first(_shape(computation, instruction.operands[0])))))
    if opcode in _MOVES or opcode in FREE or opcode == "custom-call":
        return Cost()
    return Cost(float(_elements(instruction.shape)))


def _summed(computation: Any, instruction: Any) -> float:
    """How many products each result element of a matrix product sums (on average, for a convolution)."""
    lhs = arrays(_shape(computation, instruction.operands[0]))
    if instruction.opcode == "convolution":
        return _window_taps(computation, instruction)
    found = _CONTRACTING.search(instruction.attrs) or _GEMM_CONTRACTING.search(instruction.attrs)
    if not lhs or found is None:
        return 1
    dims = [int(d) for d in re.findall(r"\d+", found.group(1))]
    return math.prod(lhs[0].shape[d] for d in dims if d < len(lhs[0].shape))


def _window_taps(computation: Any, instruction: Any) -> float:
    """A convolution's input features times the window taps, per result element, that meet input:
    not dilation's holes (the TPU writes a batched matrix product as a convolution whose window spans
    the batch, dilated), nor padding (and a matrix product as one whose window spans the heads over
    an input of one position padded to them: ``size=32 pad=31_31``, one tap in 32 on input)."""
    labels = _LABELS.search(instruction.attrs)
    lhs = arrays(_shape(computation, instruction.operands[0]))
    kernel = arrays(_shape(computation, instruction.operands[1])) if len(instruction.operands) > 1 else ()
    if labels is None or not kernel or not lhs:
        return 1
    features = math.prod(k for k, c in zip(kernel[0].shape, labels.group(2), strict=False) if c == "i")
    window = _WINDOW.search(instruction.attrs)
    text = window.group(1) if window else ""
    sizes = _dims(text, "size")
    n = len(sizes)
    inputs = [lhs[0].shape[labels.group(1).index(str(d))] for d in range(n)]
    pads = [tuple(int(x) for x in p.split("_")) for p in re.findall(r"\d+_\d+", _field(text, "pad"))]
    pads = pads if len(pads) == n else [(0, 0)] * n
    strides = _dims(text, "stride") or [1] * n
    lhs_dilations = _dims(text, "lhs_dilate") or [1] * n
    rhs_dilations = _dims(text, "rhs_dilate") or [1] * n
    taps = 1.0
    for i in range(n):
        taps *= _taps_on_input(inputs[i], sizes[i], pads[i], strides[i], lhs_dilations[i], rhs_dilations[i])
    return features * taps


def _taps_on_input(size: int, window: int, pad: tuple[int, int], stride: int, lhs: int, rhs: int) -> float:
    """Along one dimension: the window's taps per output position that fall on an input element
    (not padding, not a hole of the input's dilation), averaged over the output positions."""
    span = (size - 1) * lhs + 1 + pad[0] + pad[1]  # the dilated, padded input
    outputs = max(0, (span - ((window - 1) * rhs + 1)) // stride + 1)
    if outputs == 0:
        return 0.0
    hits = 0
    for k in range(window):  # output o meets input at o * stride + k * rhs - pad[0]: in range, on an element
        at = k * rhs - pad[0]
        first = -(at // stride) if at < 0 else 0  # ceil(-at / stride)
        last = min(outputs - 1, ((size - 1) * lhs - at) // stride)
        if last < first:
            continue
        if lhs == 1:
            hits += last - first + 1
        elif stride == 1:  # the o congruent to -at modulo the dilation
            r = -at % lhs
            hits += (last - r) // lhs - (first - 1 - r) // lhs
        else:
            hits += sum(1 for o in range(first, last + 1) if (o * stride + at) % lhs == 0)
    return hits / outputs


def _field(window: str, key: str) -> str:
    found = re.search(rf"\b{key}=(\S+)", window)
    return found.group(1) if found else ""


def _dims(window: str, key: str) -> list[int]:
    found = re.search(rf"\b{key}=([\dx]+)", window)
    return [int(x) for x in found.group(1).split("x")] if found else []


def _fusion_bytes(computation: Any, instruction: Any, fused: Any, module: Any) -> int:
    """The bytes a fusion moves: each operand as it reads it (``_read``), and its results (an
    in-place update's: the update)."""
    moved = sum(
        _read(module, fused, _parameter(fused, number), _size(_shape(computation, operand)))
        for number, operand in enumerate(instruction.operands)
    )
    return moved + _result_bytes(fused)


def _read(module: Any, fused: Any, name: str | None, size: int, depth: int = 0) -> int:
    """The bytes of ``fused``'s value ``name`` (``size`` in all) its users read: a slice's, none of
    a buffer updated in place, through views and nested fusions; all of it where another reads it."""
    users = [u for u in fused.instructions if any(operand_name(o) == name for o in u.operands)]
    if name is None or depth > _DEPTH:
        return size
    total = 0
    for user in users:
        first = operand_name(user.operands[0]) == name
        if user.opcode in _SLICES and first:
            total += _size(user.shape)
        elif user.opcode == "dynamic-update-slice" and first and len(user.operands) > 1:
            continue  # updated in place: the update is written, the rest stays
        elif user.opcode == "bitcast":
            total += _read(module, fused, user.name, size, depth + 1)
        elif user.opcode == "fusion" and (inner := module.computations.get(_called(user))) is not None:
            numbers = [i for i, o in enumerate(user.operands) if operand_name(o) == name]
            total += sum(_read(module, inner, _parameter(inner, i), size, depth + 1) for i in numbers)
        else:
            return size
    return min(total, size)


def _parameter(fused: Any, number: int) -> str | None:
    """The name of ``fused``'s parameter ``number``."""
    return next(
        (i.name for i in fused.instructions if i.opcode == "parameter" and i.operands == [str(number)]), None
    )


def _result_bytes(fused: Any) -> int:
    root = fused.defs.get(fused.root)
    if root is None:
        return 0
    outputs = [fused.defs.get(operand_name(o)) for o in root.operands] if root.opcode == "tuple" else [root]
    total = 0
    for out in outputs:
        if out is not None and out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
            total += _size(fused.shapes.get(operand_name(out.operands[1]), ""))
        elif out is not None:
            total += _size(out.shape)
    return total


def _is_gemm(attrs: str) -> bool:
    return bool(re.search(r'custom_call_target="[^"]*(?:gemm|matmul)[^"]*"', attrs, re.I))


def _called(instruction: Any) -> str:
    found = _CALLS.search(instruction.attrs)
    return found.group(1) if found else ""


def _shape(computation: Any, operand: str) -> str:
    """An operand's shape: written inline, or its instruction's in ``computation``."""
    name = operand_name(operand)
    return computation.shapes.get(name) or (operand.rsplit(" ", 1)[0] if " " in operand else "")


def _first(shape: str) -> str:
    """The first array of a shape (a GEMM's result beside its workspace)."""
    found = arrays(shape)
    return str(found[0]) if found else ""


def _elements(shape: str) -> int:
    return sum(math.prod(a.shape) for a in arrays(shape))


def _size(shape: str) -> int:
    return sum(a.bytes for a in arrays(shape) if a.dtype != "token")
