"""What a multi-slice TPU program's send/recv pairs carry, and which collective feeds which.

The TPU compiler compiles one slice's program of a mesh over several slices; an all-reduce whose
groups cross the slices becomes send/recv pairs run by the TPU runtime across them (DCN), which
its attributes name (``_xla_megascale_transfer_type="ALL_REDUCE"``, one rendezvous per pair), with
an all-reduce or a reduce-scatter and all-gather over the slice's own chips around them.
"""

from __future__ import annotations

import re

from ._module import Computation, Instruction, arrays, operand_name

__all__ = ["crossing", "source_of", "unpadded"]

_TRANSFER = re.compile(r'_xla_megascale_transfer_type="(?P<type>[A-Z_]+)"')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="(?P<name>[^"]*)"')
# what moves a buffer without computing on it: a collective's result read through these is its result
_MOVES = {"bitcast", "copy", "reshape", "get-tuple-element", "copy-start", "copy-done"}
_CROPS = ('custom_call_target="ZeroCrop"',)  # the TPU compiler's crop of a padded buffer
_MAX_STEPS = 32


def crossing(attrs: str) -> tuple[str, str]:
    """``(collective, rendezvous)`` of a send or recv the TPU runtime runs across slices: the
    collective in HLO's name (``"all-reduce"``), the name it pairs the send and the recv by;
    ``("", "")`` for any other."""
    transfer, rendezvous = _TRANSFER.search(attrs), _RENDEZVOUS.search(attrs)
    if transfer is None or rendezvous is None:
        return "", ""
    return transfer["type"].lower().replace("_", "-"), rendezvous["name"]


def source_of(instruction: Instruction, computation: Computation) -> str:
    """The instruction whose result ``instruction``'s first operand is, read through moves (bitcasts,
    copies, tuple elements, crops) and an asynchronous pair's ``-done``: its name, ``""`` when the
    operand is computed (a fusion, a parameter)."""
    return _walk(instruction, computation)[0]


def unpadded(instruction: Instruction, computation: Computation) -> int | None:
    """The bytes ``instruction``'s first operand held before the TPU compiler padded it to whole
    tiles for it (a ``ZeroCrop`` on the way, which zeroes the tiles' tail), ``None`` if not padded."""
    return _walk(instruction, computation)[1]


def _walk(instruction: Instruction, computation: Computation) -> tuple[str, int | None]:
    if not instruction.operands:
        return "", None
    name, before = operand_name(instruction.operands[0]), None
    for _ in range(_MAX_STEPS):
        found = computation.defs.get(name)
        if found is None:
            return "", before
        crop = found.opcode == "custom-call" and any(c in found.attrs for c in _CROPS)
        if crop and found.operands and before is None:
            held = arrays(computation.shapes.get(operand_name(found.operands[0]), ""))
            before = held[0].bytes if len(held) == 1 else None
        if found.opcode.endswith("-done") and found.opcode != "copy-done":
            return (operand_name(found.operands[0]) if found.operands else ""), before
        if not (found.opcode in _MOVES or crop) or not found.operands:
            return found.name, before
        name = operand_name(found.operands[0])
    return "", before
